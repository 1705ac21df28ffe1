"""Empty ``_extra_state`` entries where Transformer Engine's modules carry one (FP8 metadata).

The te parameter layout gives the slots TE fills (core attention, q/k norms, the MoE pre-MLP norm,
the final norm) an empty entry, as Megatron's own linears have, so a checkpoint has a TE-spec
model's key set. A saved TE value is accepted and ignored: nothing here runs in FP8."""

from __future__ import annotations

import torch


class EmptyExtraState:
    """Mixin: an ``_extra_state`` entry that saves ``None`` and ignores what it is given; a state
    dict without the entry still loads."""

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
