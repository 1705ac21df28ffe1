"""LayerNorm / RMSNorm that work with sequence parallelism, for Megatron's norm slots.

Under sequence parallelism each TP rank normalises its own slice of the sequence, so these norms tag
their parameters ``sequence_parallel = True`` and Megatron's ``finalize_model_grads`` sums their
gradients over the TP group. Names (``weight``, ``bias``) are torch's, i.e. the local spec's.
RMSNorm runs through ``npu_rms_norm`` (:class:`NPURMSNorm`); ``kernel=None`` gives
``torch.nn.RMSNorm``. ``extra_state=True`` (the te layout) adds TE's empty ``_extra_state``.
Zero-centred gamma (``layernorm_zero_centered_gamma``, Qwen3.5 / Qwen3-Next): the weight starts at 0
and the norm multiplies by ``1 + weight``, formed in float32 (the fused path casts it to the input's
dtype)."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from mcore_npu.ops import rms_norm
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer.extra_state import EmptyExtraState, TELayerNorm, TERMSNorm


def check_epsilon(name: str, value) -> None:
    """A norm epsilon keyword: a positive real or None (the config's); ValueError naming it."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if value is not None and not (real and value > 0):
        raise ValueError(f"{name}: pass a positive float or None, got {value!r}")


def _tag(module: torch.nn.Module, config) -> torch.nn.Module:
    for param in module.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return module


class NPURMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension through ``npu_rms_norm``: x ``[*, H]`` -> ``[*, H]``;
    ``weight`` ``[H]`` is gamma (``1 + weight`` with ``zero_centered_gamma``)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        kernel: str = "auto",
        zero_centered_gamma: bool = False,
    ) -> None:
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
    """``torch.nn.RMSNorm`` with zero-centred gamma: ``x_hat * (1 + weight)`` in float32, cast back."""

    zero_centered_gamma = True

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), self.normalized_shape, gamma, self.eps).to(x.dtype)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with zero-centred gamma: ``x_hat * (1 + weight) + bias`` in float32,
    cast back."""

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
    """Builds the norm ``config.normalization`` asks for (and its zero-centred variant), from the
    keywords Megatron passes to norm slots plus the spec's ``kernel`` (None: ``torch.nn.RMSNorm``),
    ``extra_state`` and ``epsilon`` (None: the ``eps`` Megatron passes)."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        kernel: str | None = None,
        *,
        extra_state: bool = False,
        epsilon: float | None = None,
        **_unused,
    ):
        eps = eps if epsilon is None else epsilon
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
