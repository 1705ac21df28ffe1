"""LayerNorm / RMSNorm that work with sequence parallelism, for Megatron's norm slots.

Megatron's local ``WrappedTorchNorm`` refuses ``sequence_parallel=True``. Under sequence
parallelism each tensor-parallel rank normalises a different slice of the sequence, so the norm's
weight gradients differ per rank and must be summed over the tensor-parallel group. Megatron's
``finalize_model_grads`` does that for parameters tagged ``sequence_parallel = True``; these norms
tag theirs. Parameter names (``weight``, ``bias``) are those of ``torch.nn.LayerNorm`` /
``torch.nn.RMSNorm``, i.e. of the local spec, so checkpoints move between the two specs.

RMSNorm runs through ``npu_rms_norm`` (:class:`NPURMSNorm`, ``kernel`` as in ``mcore_npu.ops``);
pass ``kernel=None`` for ``torch.nn.RMSNorm``. Each token is normalised on its own, so sequence
parallelism changes nothing in the forward. ``extra_state=True`` (the TE parameter layout) builds
the variants with Transformer Engine's empty ``_extra_state`` entry
(``mcore_npu.transformer.extra_state``).
"""

from __future__ import annotations

import torch

from mcore_npu.ops import KERNELS, rms_norm
from mcore_npu.transformer.extra_state import EmptyExtraState, TELayerNorm, TERMSNorm


def _tag(module: torch.nn.Module, config) -> torch.nn.Module:
    for param in module.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return module


class NPURMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension through ``npu_rms_norm``: x ``[*, H]`` -> ``[*, H]``.

    ``weight`` ``[H]`` (``torch.nn.RMSNorm``'s name) is gamma; ``eps`` is Megatron's
    ``layernorm_epsilon`` (the slot passes it).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, kernel: str = "auto") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps, self.kernel = float(eps), kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return rms_norm(x, gamma, self.eps, kernel=self.kernel)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, kernel={self.kernel!r}"


class TENPURMSNorm(EmptyExtraState, NPURMSNorm):
    """:class:`NPURMSNorm` with TE's ``_extra_state`` entry."""


# (normalization, fused rms_norm kernel given, TE extra state) -> class
_CLASSES = {
    ("LayerNorm", False, False): torch.nn.LayerNorm,
    ("LayerNorm", False, True): TELayerNorm,
    ("RMSNorm", False, False): torch.nn.RMSNorm,
    ("RMSNorm", False, True): TERMSNorm,
    ("RMSNorm", True, False): NPURMSNorm,
    ("RMSNorm", True, True): TENPURMSNorm,
}


class SequenceParallelNorm:
    """Builds ``torch.nn.LayerNorm``, or RMSNorm (``config.normalization``).

    Takes the keywords Megatron passes to norm slots (``config, hidden_size, eps``, ...) plus
    ``kernel`` and ``extra_state`` (from the spec's params): RMSNorm is :class:`NPURMSNorm` with
    that kernel, or ``torch.nn.RMSNorm`` when ``kernel`` is None; ``extra_state=True`` adds TE's
    empty ``_extra_state`` entry.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, kernel: str | None = None,
                *, extra_state: bool = False, **_unused):  # fmt: skip
        if config.layernorm_zero_centered_gamma:
            raise NotImplementedError(
                "layernorm_zero_centered_gamma: not supported by the torch norms of this spec; "
                "set it to False"
            )
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kernel: unknown kernel {kernel!r}; pass one of {', '.join(KERNELS)}")
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization: {config.normalization!r} is not supported; use 'LayerNorm' or "
                "'RMSNorm'"
            )
        fused = config.normalization == "RMSNorm" and kernel is not None
        norm_class = _CLASSES[(config.normalization, fused, bool(extra_state))]
        extra = {"kernel": kernel} if fused else {}
        norm = norm_class(hidden_size, eps=eps, **extra)
        return _tag(norm, config)
