"""A test instrument for the ``main_ppo`` runs with router replay: imported into every verl
process of a run through ``VERL_USE_EXTERNAL_MODULES``, it records, for each forward of a
Megatron model in the process, the token ids its embedding took and the experts each MoE router
chose. One file per forward in ``MCORE_NPU_ROUTE_PROBE_DIR``:
``{"ids": [T], "routes": [L tensors [T, k]]}`` (each row's expert ids sorted, layers in call
order).

It observes through torch's public global forward hook
(``torch.nn.modules.module.register_module_forward_hook``); it replaces nothing and changes no
output. Without ``MCORE_NPU_ROUTE_PROBE_DIR`` it registers nothing.
"""

from __future__ import annotations

import itertools
import os

import torch

DIR_ENV = "MCORE_NPU_ROUTE_PROBE_DIR"
_forwards = itertools.count()
_current: dict = {}


def _is(module, class_name: str) -> bool:
    return any(cls.__name__ == class_name for cls in type(module).__mro__)


def _hook(module, args, kwargs, output) -> None:
    if _is(module, "LanguageModelEmbedding"):
        ids = kwargs.get("input_ids", args[0] if args else None)
        _current.clear()
        _current.update(ids=ids.detach().reshape(-1).cpu(), routes=[], n=next(_forwards))
    elif _is(module, "TopKRouter") and _current:
        routing_map = output[1]  # [T, E] bool: True = the token goes to that expert
        experts = routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1)  # [T, k] sorted
        _current["routes"].append(experts.cpu())
        where = f"{os.environ[DIR_ENV]}/forward_{os.getpid()}_{_current['n']}.pt"
        torch.save({"ids": _current["ids"], "routes": _current["routes"]}, where)


if os.environ.get(DIR_ENV):
    os.makedirs(os.environ[DIR_ENV], exist_ok=True)
    torch.nn.modules.module.register_module_forward_hook(_hook, with_kwargs=True)
