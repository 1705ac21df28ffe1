"""The experts a ``transformers`` MoE model routes each token to, recorded while it runs: what
vLLM returns as ``routed_experts`` when ``rollout.enable_rollout_routing_replay`` is on (verl's
R3 router replay).

:func:`recording` hooks every router (a module named ``…mlp.gate`` that returns the top-k indices
``[T, k]`` among its outputs) for the duration of a ``with``; :meth:`Routes.stacked` gives
``[N, L, k]`` int16 over every token fed through the model (the prompt, then each generated token
but the last, which is never fed back), layers in order.
"""

from __future__ import annotations

import contextlib

import torch


class Routes:
    """Per MoE layer, the ``[t, k]`` indices of each forward call, in call order."""

    def __init__(self, layers: int):
        self.calls: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def stacked(self) -> torch.Tensor:
        """``[N, L, k]`` int16: every token's experts, layer by layer."""
        per_layer = [torch.cat(calls) for calls in self.calls]
        return torch.stack(per_layer, dim=1).to(torch.int16)


def routers(model) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (modules named ``…mlp.gate`` with a ``top_k``)."""
    return [m for name, m in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(m, "top_k")]  # fmt: skip


@contextlib.contextmanager
def recording(model):
    """Yield a :class:`Routes` filled by every router call inside the ``with``."""
    found = routers(model)
    if not found:
        raise ValueError(
            f"enable_rollout_routing_replay: {type(model).__name__} has no MoE router to record "
            "(a module '…mlp.gate' with top_k); turn routing replay off for a dense model"
        )
    routes, handles = Routes(len(found)), []
    for layer, router in enumerate(found):

        def hook(module, args, output, layer=layer):
            routes.calls[layer].append(_indices(output, module.top_k).detach().clone())

        handles.append(router.register_forward_hook(hook))
    try:
        yield routes
    finally:
        for handle in handles:
            handle.remove()


def _indices(output, top_k: int) -> torch.Tensor:
    """The ``[T, k]`` integer tensor among a router's outputs."""
    for tensor in output if isinstance(output, tuple) else (output,):
        integer = isinstance(tensor, torch.Tensor) and not tensor.is_floating_point()
        if integer and tensor.dim() == 2 and tensor.shape[-1] == top_k:
            return tensor
    raise ValueError(f"a router returned no [T, {top_k}] integer indices: {type(output)}")
