"""Norm fused into the following column-parallel linear: the Transformer Engine parameter layout.

``NormColumnParallelLinear`` is Megatron's ``ColumnParallelLinear`` plus ``layer_norm_weight`` (and
``layer_norm_bias`` for LayerNorm) applied to its input first: the names of TE's
``TELayerNormColumnParallelLinear``. Under sequence parallelism the norm runs on this rank's
``[s/tp, b, h]`` shard before the linear's all-gather; its parameters are tagged
``sequence_parallel = True`` so Megatron sums their gradients over the TP group. Zero-centred gamma
as in ``mcore_npu.transformer.norms``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_npu.ops import rms_norm
from mcore_npu.ops.registry import check_kernel


class NormColumnParallelLinear(ColumnParallelLinear):
    """``norm(x) @ W.T (+ b)`` with the parameter names of ``TELayerNormColumnParallelLinear``.

    The norm is ``config.normalization`` with ``norm_epsilon`` (None: ``config.layernorm_epsilon``);
    RMSNorm runs through
    ``npu_rms_norm`` with ``norm_kernel``, or torch's when it is None. Input ``[s, b, h]``
    (``[s/tp, b, h]`` under SP) -> ``([s, b, o/tp], bias or None)``; ``weight`` ``[o/tp, h]``,
    ``layer_norm_weight`` / ``layer_norm_bias`` ``[h]``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        norm_kernel=None,
        norm_epsilon: float | None = None,
        **linear_kwargs,
    ):
        _check_norm(config)
        if norm_kernel is not None:
            check_kernel(norm_kernel, what="norm_kernel")
        super().__init__(input_size, output_size, config=config, **linear_kwargs)
        self.norm_kernel = norm_kernel
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon if norm_epsilon is None else norm_epsilon
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        device = self.weight.device if self.weight is not None else None
        factory = dict(dtype=config.params_dtype, device=device)
        start = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(start(input_size, **factory))
        self.layer_norm_bias = None
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, **factory))
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, input_: torch.Tensor, weight=None, runtime_gather_output=None):
        """Normalise the (local) input over its last dimension, then the column-parallel linear."""
        return super().forward(self.norm(input_), weight, runtime_gather_output)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The fused norm alone: ``[..., h] -> [..., h]``."""
        shape = (x.shape[-1],)
        if self.zero_centered_gamma:
            return self._zero_centered_norm(x)
        if self.normalization == "RMSNorm" and self.norm_kernel is not None:
            gamma = self.layer_norm_weight.to(x.dtype)
            return rms_norm(x, gamma, self.eps, kernel=self.norm_kernel)
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, shape, self.layer_norm_weight, self.eps)
        return F.layer_norm(x, shape, self.layer_norm_weight, self.layer_norm_bias, self.eps)

    def _zero_centered_norm(self, x: torch.Tensor) -> torch.Tensor:
        """``x_hat * (1 + layer_norm_weight) (+ layer_norm_bias)``; ``1 + w`` in float32."""
        shape, gamma = (x.shape[-1],), 1.0 + self.layer_norm_weight.float()
        if self.normalization == "RMSNorm" and self.norm_kernel is not None:
            return rms_norm(x, gamma.to(x.dtype), self.eps, kernel=self.norm_kernel)
        if self.normalization == "RMSNorm":
            return F.rms_norm(x.float(), shape, gamma, self.eps).to(x.dtype)
        bias = None if self.layer_norm_bias is None else self.layer_norm_bias.float()
        return F.layer_norm(x.float(), shape, gamma, bias, self.eps).to(x.dtype)


def _check_norm(config) -> None:
    if config.normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(
            f"normalization: {config.normalization!r} is not supported by NormColumnParallelLinear;"
            " use 'LayerNorm' or 'RMSNorm'"
        )
