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

Zero-centred gamma (``layernorm_zero_centered_gamma=True``, what Qwen3.5 and Qwen3-Next use): the
weight starts at 0 and the norm multiplies by ``1 + weight``, as Transformer Engine's norms do
with ``zero_centered_gamma`` (Megatron's TE spec passes the flag to every ``TENorm``; its local
``WrappedTorchNorm`` refuses it). The names stay ``weight`` / ``bias``, so a Megatron checkpoint
written with the flag loads unchanged. ``1 + weight`` is formed in float32; the torch path
normalises in float32 and casts back at the end (TE's and Hugging Face's ``Qwen3_5RMSNorm``
order); the fused ``npu_rms_norm`` path takes gamma in the input's dtype, so under bf16 the
``1 + weight`` factor is rounded to bf16 there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.ops import rms_norm
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer.extra_state import EmptyExtraState, TELayerNorm, TERMSNorm


def _tag(module: torch.nn.Module, config) -> torch.nn.Module:
    for param in module.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return module


class NPURMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension through ``npu_rms_norm``: x ``[*, H]`` -> ``[*, H]``.

    ``weight`` ``[H]`` (``torch.nn.RMSNorm``'s name) is gamma; ``eps`` is Megatron's
    ``layernorm_epsilon`` (the slot passes it).
    ``zero_centered_gamma``: the weight starts at 0 and gamma is ``1 + weight`` (formed in
    float32, then cast to x's dtype for the operator).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, kernel: str = "auto",
                 zero_centered_gamma: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.zero_centered_gamma = bool(zero_centered_gamma)
        start = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(start(hidden_size))
        self.eps, self.kernel = float(eps), kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered_gamma:
            gamma = (1.0 + self.weight.float()).to(x.dtype)
        else:
            gamma = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return rms_norm(x, gamma, self.eps, kernel=self.kernel)

    def extra_repr(self) -> str:
        centred = ", zero_centered_gamma=True" if self.zero_centered_gamma else ""
        return f"{self.weight.shape[0]}, eps={self.eps}, kernel={self.kernel!r}{centred}"


class TENPURMSNorm(EmptyExtraState, NPURMSNorm):
    """:class:`NPURMSNorm` with TE's ``_extra_state`` entry."""


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with zero-centred gamma: x ``[*, H]`` -> ``x_hat * (1 + weight)``,
    computed in float32 and cast back to x's dtype; ``weight`` ``[H]`` starts at 0."""

    zero_centered_gamma = True

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), self.normalized_shape, gamma, self.eps).to(x.dtype)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with zero-centred gamma: ``x_hat * (1 + weight) + bias`` in
    float32, cast back to x's dtype; ``weight`` ``[H]`` starts at 0, ``bias`` ``[H]`` at 0."""

    zero_centered_gamma = True

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = 1.0 + self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, gamma, bias, self.eps).to(x.dtype)


class TEZeroCenteredRMSNorm(EmptyExtraState, ZeroCenteredRMSNorm):
    """:class:`ZeroCenteredRMSNorm` with TE's ``_extra_state`` entry."""


class TEZeroCenteredLayerNorm(EmptyExtraState, ZeroCenteredLayerNorm):
    """:class:`ZeroCenteredLayerNorm` with TE's ``_extra_state`` entry."""


# (normalization, fused rms_norm kernel given, TE extra state, zero-centred gamma) -> class
_CLASSES = {
    ("LayerNorm", False, False, False): torch.nn.LayerNorm,
    ("LayerNorm", False, True, False): TELayerNorm,
    ("RMSNorm", False, False, False): torch.nn.RMSNorm,
    ("RMSNorm", False, True, False): TERMSNorm,
    ("RMSNorm", True, False, False): NPURMSNorm,
    ("RMSNorm", True, True, False): TENPURMSNorm,
    ("LayerNorm", False, False, True): ZeroCenteredLayerNorm,
    ("LayerNorm", False, True, True): TEZeroCenteredLayerNorm,
    ("RMSNorm", False, False, True): ZeroCenteredRMSNorm,
    ("RMSNorm", False, True, True): TEZeroCenteredRMSNorm,
    ("RMSNorm", True, False, True): NPURMSNorm,
    ("RMSNorm", True, True, True): TENPURMSNorm,
}


class SequenceParallelNorm:
    """Builds ``torch.nn.LayerNorm``, or RMSNorm (``config.normalization``).

    Takes the keywords Megatron passes to norm slots (``config, hidden_size, eps``, ...) plus
    ``kernel`` and ``extra_state`` (from the spec's params): RMSNorm is :class:`NPURMSNorm` with
    that kernel, or ``torch.nn.RMSNorm`` when ``kernel`` is None; ``extra_state=True`` adds TE's
    empty ``_extra_state`` entry. ``config.layernorm_zero_centered_gamma``: the zero-centred
    variants (``NPURMSNorm(zero_centered_gamma=True)``, :class:`ZeroCenteredRMSNorm`,
    :class:`ZeroCenteredLayerNorm`).
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, kernel: str | None = None,
                *, extra_state: bool = False, **_unused):  # fmt: skip
        if kernel is not None:
            check_kernel(kernel)
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization: {config.normalization!r} is not supported; use 'LayerNorm' or "
                "'RMSNorm'"
            )
        fused = config.normalization == "RMSNorm" and kernel is not None
        centred = bool(config.layernorm_zero_centered_gamma)
        norm_class = _CLASSES[(config.normalization, fused, bool(extra_state), centred)]
        extra = {"kernel": kernel, "zero_centered_gamma": centred} if fused else {}
        norm = norm_class(hidden_size, eps=eps, **extra)
        return _tag(norm, config)
