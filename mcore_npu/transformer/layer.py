"""The MLP slot of an NPU layer spec, bound so that Megatron's own ``TransformerLayer`` builds it.

The NPU spec's layers are Megatron's ``TransformerLayer`` itself (so that builders which want
exactly that class, such as ``get_gpt_mtp_block_spec(config, layer_spec, ...)``, take the NPU
layer spec unchanged). Megatron-Core 0.16.1's ``TransformerLayer.__init__``
(``transformer_layer.py``, "Module 8: MLP block") passes process groups to a ``ModuleSpec`` in
the ``mlp`` slot only when its module *is* one of Megatron's classes: ``MLP`` / ``TEFusedMLP`` get
``tp_group=pg_collection.tp``; ``MoELayer``, ``GroupedMLP``, ``TEGroupedMLP``, ``SequentialMLP``
get ``pg_collection``. For any other class in a ``ModuleSpec`` it logs, once per layer::

    Unknown MLP type: <class '...ModuleSpec'>. Using default kwargs.

and builds it with ``config`` only. A slot that is not a ``ModuleSpec`` is Megatron's own
"no additional kwargs" case: built the same way, without the line.

So the spec puts a subclass of Megatron's MLP / MoE classes (``NPUMLP``, ``NPUMoELayer``) in a
:class:`BoundModuleSpec`: built like a ``ModuleSpec`` by ``build_module``, its ``params``
holding the process groups given to the spec builder (``pg_collection=``), if any. Without them
the module takes parallel_state's groups, as Megatron's own layer does when it is given no
``pg_collection``. A model built on process groups of its own (``GPTModel(...,
pg_collection=groups)``) passes the same ``groups`` to the spec builder. Megatron's own classes
stay ``ModuleSpec``s and get their groups from the layer. Nothing of Megatron's is patched.

megatron-core 0.18+ calls the ``mlp`` slot itself, ``slot(config=, pg_collection=,
is_mtp_layer=, name=)`` (its ``MLP`` has ``as_mlp_submodule`` for that); a ``BoundModuleSpec``
takes that call too (:meth:`BoundModuleSpec.__call__`), so the same spec builds on every version.
"""

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
    """A module spec for the ``mlp`` slot: ``build_module`` builds it like a ``ModuleSpec``
    (``module(*args, **params, **kwargs, submodules=submodules)``); it is deliberately not one,
    so ``TransformerLayer`` adds no kwargs of its own and logs nothing. ``params`` may hold the
    layer's process groups (``tp_group`` or ``pg_collection``), shared, not copied, by
    ``copy.deepcopy``."""

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
        """Build the module as megatron-core 0.18+'s ``TransformerLayer`` asks (it calls the
        slot): an MLP subclass gets ``tp_group=pg_collection.tp``, an MoE subclass
        ``pg_collection`` and ``is_mtp_layer``; groups bound in ``params`` win; ``name`` is
        passed on (the plugin's MLP and MoE classes give it to Megatron's)."""
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


def bind_mlp_process_groups(mlp, pg_collection=None):
    """The layer spec's ``mlp`` slot as a :class:`BoundModuleSpec` when it holds a subclass of
    Megatron's MLP / MoE classes (with ``pg_collection``'s groups in its params when given: a
    ``ProcessGroupCollection``), else ``mlp`` itself (see :func:`mlp_process_group_keyword`).

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
