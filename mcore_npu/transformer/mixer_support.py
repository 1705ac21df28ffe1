"""What the recurrent sequence mixers (``NPUGatedDeltaNet``, ``NPUMambaMixer``) share: their
process groups, the device their parameters go on, and their sharded checkpoint entries (with
the process groups where the installed megatron-core takes them, 0.16+)."""

from __future__ import annotations

import torch

from mcore_npu.transformer import megatron_features


def process_groups(pg_collection):
    """``pg_collection``, or Megatron's global tp / cp groups when it is None."""
    if pg_collection is not None:
        return pg_collection
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])


def device_of(module) -> torch.device:
    """Where ``module``'s weight lives (the CPU for a module without one)."""
    weight = getattr(module, "weight", None)
    return weight.device if weight is not None else torch.device("cpu")


def sharded_tensors(state, prefix, axes, offsets, metadata, tp_group) -> dict:
    """``make_sharded_tensors_for_checkpoint`` of ``state``, TP-sharded on ``axes``."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    return make_sharded_tensors_for_checkpoint(
        state, prefix, axes, offsets, **_groups(metadata, tp_group)
    )


def sharded_default(module, prefix, offsets, metadata, tp_group) -> dict:
    """``sharded_state_dict_default`` of a child module."""
    from megatron.core.transformer.utils import sharded_state_dict_default

    if not megatron_features.has("checkpoint_groups"):
        return sharded_state_dict_default(module, prefix, offsets, metadata)
    return sharded_state_dict_default(module, prefix, offsets, metadata, tp_group=tp_group)


def _groups(metadata, tp_group) -> dict:
    if not megatron_features.has("checkpoint_groups"):
        return {}
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return dict(tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])
