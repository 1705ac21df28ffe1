"""``NPUTransformerLayer``: Megatron's ``TransformerLayer`` whose MLP slot gets the layer's
process groups also when it holds a subclass of Megatron's MLP or MoE modules.

Megatron-Core 0.16.1's ``TransformerLayer.__init__`` (``transformer_layer.py``, "Module 8: MLP
block") passes process groups to the ``mlp`` slot only when the slot's module *is* one of its
own classes: ``MLP`` / ``TEFusedMLP`` get ``tp_group=pg_collection.tp``; ``MoELayer``,
``GroupedMLP``, ``TEGroupedMLP``, ``SequentialMLP`` get ``pg_collection``. Any other class is
built with no process groups and Megatron logs, once per layer::

    Unknown MLP type: <class '...ModuleSpec'>. Using default kwargs.

For the NPU spec's dense ``NPUMLP`` (an ``MLP``) "default kwargs" means ``tp_group=None``:
``MLP`` then takes parallel_state's global tensor-parallel group
(``get_tensor_model_parallel_group_if_none``), not the layer's ``pg_collection.tp``. Nothing
else is lost (0.16.1 passes nothing more; ``MoELayer`` stays Megatron's class, so MoE layers
get their ``pg_collection``), but a model built with its own process groups (``GPTModel(...,
pg_collection=...)``) would run its dense MLPs on the wrong group.

``NPUTransformerLayer`` gives such a slot what Megatron gives the class it derives from, bound
into the slot's spec before ``TransformerLayer.__init__`` runs: the bound spec is a
:class:`BoundModuleSpec` (module, params, submodules), which Megatron's ``build_module`` builds
as it builds a ``ModuleSpec``, and which its type check passes over, so nothing is logged.
Slots holding Megatron's own classes, or classes derived from none of them, are left to
Megatron. Megatron's classes are not patched; ``layer.submodules_config`` is the spec given.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer


@dataclasses.dataclass
class BoundModuleSpec:
    """A module spec whose ``params`` already hold a layer's process groups.

    ``build_module`` builds it like a ``ModuleSpec`` (``module(*args, **params, **kwargs,
    submodules=submodules)``); it is deliberately not one, so ``TransformerLayer`` adds no
    kwargs of its own and logs nothing.
    """

    module: type
    params: dict = dataclasses.field(default_factory=dict)
    submodules: Any = None


def _megatron_groups_classes() -> tuple[type, ...]:
    """The classes TransformerLayer passes ``pg_collection`` to (those installed)."""
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.moe.moe_layer import MoELayer

    found = [MoELayer]
    for name in ("GroupedMLP", "TEGroupedMLP", "SequentialMLP"):
        cls = getattr(experts, name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def mlp_process_group_keyword(module) -> str | None:
    """The keyword ``TransformerLayer`` would give the Megatron class ``module`` derives from:
    ``"pg_collection"`` (``MoELayer`` / ``SequentialMLP`` / ... subclasses), ``"tp_group"``
    (``MLP`` subclasses), or None: Megatron's own classes (it passes their groups itself), and
    classes derived from none of them."""
    with_groups = _megatron_groups_classes()
    if not isinstance(module, type) or module is MLP or module in with_groups:
        return None
    if issubclass(module, with_groups):
        return "pg_collection"
    if issubclass(module, MLP):
        return "tp_group"
    return None


def bind_mlp_process_groups(mlp, pg_collection):
    """The layer's ``mlp`` slot with its process groups bound (a :class:`BoundModuleSpec`), or
    ``mlp`` itself when it needs none from here (see :func:`mlp_process_group_keyword`)."""
    keyword = mlp_process_group_keyword(getattr(mlp, "module", None))
    if not isinstance(mlp, ModuleSpec) or keyword is None:
        return mlp
    value = pg_collection if keyword == "pg_collection" else pg_collection.tp
    return BoundModuleSpec(mlp.module, {**mlp.params, keyword: value}, mlp.submodules)


_LAYER_INIT = inspect.signature(TransformerLayer.__init__)


class NPUTransformerLayer(TransformerLayer):
    """``TransformerLayer`` that hands an MLP-slot subclass (``NPUMLP``, a ``MoELayer``
    subclass) the layer's process groups, as Megatron does for its own classes.

    Takes ``TransformerLayer``'s arguments unchanged (``config, submodules, layer_number,
    hidden_dropout, pg_collection, vp_stage`` in 0.16.1; read from its signature).
    """

    def __init__(self, config, submodules, *args, **kwargs) -> None:
        bound = _LAYER_INIT.bind(self, config, submodules, *args, **kwargs)
        mlp = getattr(submodules, "mlp", None)
        if isinstance(mlp, ModuleSpec) and mlp_process_group_keyword(mlp.module) is not None:
            groups = bound.arguments.get("pg_collection")
            if groups is None:  # what TransformerLayer itself falls back to
                from megatron.core.process_groups_config import ProcessGroupCollection

                groups = ProcessGroupCollection.use_mpu_process_groups()
                bound.arguments["pg_collection"] = groups
            mlp = bind_mlp_process_groups(mlp, groups)
            bound.arguments["submodules"] = dataclasses.replace(submodules, mlp=mlp)
        super().__init__(*bound.args[1:], **bound.kwargs)
        self.submodules_config = submodules
