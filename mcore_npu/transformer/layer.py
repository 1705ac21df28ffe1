"""The MLP slot of an NPU layer spec, bound so that Megatron's own ``TransformerLayer`` builds it.

``TransformerLayer`` passes process groups to a ``ModuleSpec`` in the ``mlp`` slot only when its
module *is* one of Megatron's classes; for a subclass (``NPUMLP``, ``NPUMoELayer``) it logs "Unknown
MLP type" and passes ``config`` only. So the spec puts those in a :class:`BoundModuleSpec`, whose
``params`` hold the groups given to the spec builder (``pg_collection=``; none: parallel_state's).
megatron-core 0.18+ calls the slot itself; a ``BoundModuleSpec`` takes that call too. Nothing of
Megatron's is patched."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_npu.transformer import megatron_features

_GROUP_KEYWORDS = ("tp_group", "pg_collection")


@dataclasses.dataclass
class BoundModuleSpec:
    """A module spec for the ``mlp`` slot that ``build_module`` builds like a ``ModuleSpec``; not
    one, so ``TransformerLayer`` adds no kwargs and logs nothing. Process groups in ``params`` are
    shared, not copied, by ``copy.deepcopy``."""

    module: type
    params: dict = dataclasses.field(default_factory=dict)
    submodules: Any = None

    def __deepcopy__(self, memo):
        params = {
            key: value if key in _GROUP_KEYWORDS else copy.deepcopy(value, memo)
            for key, value in self.params.items()
        }
        return BoundModuleSpec(self.module, params, copy.deepcopy(self.submodules, memo))

    def __call__(self, config, pg_collection=None, is_mtp_layer: bool = False, name=None):
        """Build the module as megatron-core 0.18+'s ``TransformerLayer`` asks: an MLP subclass gets
        ``tp_group``, an MoE subclass ``pg_collection`` and ``is_mtp_layer``; groups in ``params``
        win."""
        kwargs = dict(self.params)
        if mlp_process_group_keyword(self.module) == "tp_group":
            if pg_collection is not None:
                kwargs.setdefault("tp_group", pg_collection.tp)
        else:
            kwargs.setdefault("pg_collection", pg_collection)
            kwargs["is_mtp_layer"] = is_mtp_layer
        if name is not None:
            kwargs["name"] = name
        return self.module(config=config, submodules=self.submodules, **kwargs)


def _megatron_groups_classes() -> tuple[type, ...]:
    """The classes TransformerLayer passes ``pg_collection`` to (those installed)."""
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.moe.moe_layer import MoELayer

    found = [MoELayer, experts.TEGroupedMLP, experts.SequentialMLP]
    if megatron_features.has("grouped_mlp"):
        found.append(experts.GroupedMLP)
    return tuple(found)


def mlp_process_group_keyword(module) -> str | None:
    """The keyword ``TransformerLayer`` would give the Megatron class ``module`` derives from:
    ``"pg_collection"`` (MoE / experts subclasses), ``"tp_group"`` (``MLP`` subclasses), or None
    (Megatron's own classes, and unrelated ones)."""
    with_groups = _megatron_groups_classes()
    if not isinstance(module, type) or module is MLP or module in with_groups:
        return None
    if issubclass(module, with_groups):
        return "pg_collection"
    if issubclass(module, MLP):
        return "tp_group"
    return None


def bind_mlp_process_groups(mlp, pg_collection=None):
    """``mlp`` as a :class:`BoundModuleSpec` (with ``pg_collection``'s groups when given) when it
    holds a subclass of Megatron's MLP / MoE classes, else ``mlp`` itself.

    Raises:
        TypeError: ``pg_collection`` is neither None nor a ``ProcessGroupCollection``.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is not None and not isinstance(pg_collection, ProcessGroupCollection):
        raise TypeError(
            f"pg_collection: expected a megatron.core ProcessGroupCollection (the one given to "
            f"GPTModel) or None, got {type(pg_collection).__name__}"
        )
    keyword = mlp_process_group_keyword(getattr(mlp, "module", None))
    if not isinstance(mlp, ModuleSpec) or keyword is None:
        return mlp
    params = dict(mlp.params)
    if pg_collection is not None:
        params[keyword] = pg_collection if keyword == "pg_collection" else pg_collection.tp
    return BoundModuleSpec(mlp.module, params, mlp.submodules)
