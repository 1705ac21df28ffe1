"""Empty ``_extra_state`` entries where Transformer Engine's modules carry one.

TE modules store FP8 metadata as ``_extra_state`` (a pickled byte tensor). Megatron's own
``ColumnParallelLinear`` / ``RowParallelLinear`` keep an empty entry "for compatibility with TE
state dicts"; the TE parameter layout gives the other slots TE fills (core attention, the q/k
norms, the MoE pre-MLP norm, the final norm) the same empty entry, so that a checkpoint from this
layout has the key set of a TE-spec model. A saved TE value is accepted and ignored: nothing here
runs in FP8.

- ``TERMSNorm`` / ``TELayerNorm``: ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm`` with the entry
  (``state_dict`` and ``sharded_state_dict``, as ``TENorm`` in TE >= 2.0, whose norms are
  ``BasicOperation`` s).
- ``mcore_npu.transformer.attention.TELayoutNPUFusionAttention`` uses the mixin for core
  attention.
"""

from __future__ import annotations

import torch


class EmptyExtraState:
    """Mixin: an ``_extra_state`` entry that saves ``None`` and ignores what it is given.

    A state dict without the entry (e.g. from the local layout) still loads: a pre-hook fills
    the missing key with ``None``, as Megatron's ``ColumnParallelLinear`` does.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._register_load_state_dict_pre_hook(_default_extra_state)

    def get_extra_state(self):
        """Nothing to save (TE keeps FP8 metadata here)."""
        return None

    def set_extra_state(self, state) -> None:
        """A TE checkpoint's FP8 metadata is ignored: this module runs no FP8."""


def _default_extra_state(state_dict, prefix, *_args, **_kwargs) -> None:
    state_dict.setdefault(f"{prefix}_extra_state")


class TERMSNorm(EmptyExtraState, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with TE's ``_extra_state`` entry."""


class TELayerNorm(EmptyExtraState, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with TE's ``_extra_state`` entry."""
