"""LayerNorm / RMSNorm that work with sequence parallelism, for Megatron's norm slots.

Megatron's local ``WrappedTorchNorm`` refuses ``sequence_parallel=True``. Under sequence
parallelism each tensor-parallel rank normalises a different slice of the sequence, so the norm's
weight gradients differ per rank and must be summed over the tensor-parallel group. Megatron's
``finalize_model_grads`` does that for parameters tagged ``sequence_parallel = True``; these norms
tag theirs. Parameter names (``weight``, ``bias``) are those of ``torch.nn.LayerNorm`` /
``torch.nn.RMSNorm``, i.e. of the local spec, so checkpoints move between the two specs.
"""

from __future__ import annotations

import torch

from mcore_npu.transformer.extra_state import TELayerNorm, TERMSNorm

_TORCH_CLASSES = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
_TE_CLASSES = {"LayerNorm": TELayerNorm, "RMSNorm": TERMSNorm}


def _tag(module: torch.nn.Module, config) -> torch.nn.Module:
    for param in module.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return module


class SequenceParallelNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (``config.normalization``).

    Takes the keywords Megatron passes to norm slots (``config, hidden_size, eps``, ...).
    ``extra_state=True`` (the TE parameter layout) builds the variants with Transformer Engine's
    empty ``_extra_state`` entry (``mcore_npu.transformer.extra_state``).
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, *, extra_state=False, **_unused):
        if config.layernorm_zero_centered_gamma:
            raise NotImplementedError(
                "layernorm_zero_centered_gamma: not supported by the torch norms of this spec; "
                "set it to False"
            )
        classes = _TE_CLASSES if extra_state else _TORCH_CLASSES
        if config.normalization in classes:
            norm = classes[config.normalization](hidden_size, eps=eps)
        else:
            raise ValueError(
                f"normalization: {config.normalization!r} is not supported; use 'LayerNorm' or "
                "'RMSNorm'"
            )
        return _tag(norm, config)
