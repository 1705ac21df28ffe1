"""Norm fused into the following column-parallel linear: the Transformer Engine parameter layout.

Megatron's Transformer Engine spec puts the input norm of attention and of the dense MLP inside
``linear_qkv`` / ``linear_fc1`` (``TELayerNormColumnParallelLinear``), so checkpoints written
through it, by MindSpeed and by the Hugging Face bridges verl uses name the norm weight
``...linear_qkv.layer_norm_weight``. ``NormColumnParallelLinear`` is a torch-native module with
those names: Megatron's ``ColumnParallelLinear`` (``weight``, ``bias``, ``_extra_state``) plus
``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm) applied to its input first.

Under sequence parallelism the input arrives as this rank's ``[s/tp, b, h]`` shard; the norm runs
on it before ``ColumnParallelLinear`` all-gathers the sequence (inside its autograd function), so
each rank's norm-weight gradient covers only its shard. Those parameters are tagged
``sequence_parallel = True`` and Megatron's ``finalize_model_grads`` sums them over the
tensor-parallel group, as it does for the norms of the local spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from mcore_npu.ops import KERNELS, rms_norm


class NormColumnParallelLinear(ColumnParallelLinear):
    """``norm(x) @ W.T (+ b)`` with the parameter names of ``TELayerNormColumnParallelLinear``.

    Takes the keywords Megatron passes to a ``linear_qkv`` / ``linear_fc1`` slot, plus
    ``norm_kernel`` (from the spec's params). The norm is ``config.normalization`` (``"RMSNorm"``
    or ``"LayerNorm"``) with ``config.layernorm_epsilon``; RMSNorm runs through ``npu_rms_norm``
    with ``norm_kernel`` (``mcore_npu.ops.rms_norm``), or ``torch``'s when it is None.

    Shapes (s = sequence, b = batch, h = ``input_size``, o = ``output_size``, tp = TP size):
        input: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).
        output: ``([s, b, o/tp], bias or None)`` as ``ColumnParallelLinear`` returns it.

    Parameters: ``weight`` ``[o/tp, h]``, ``bias`` ``[o/tp]`` (when ``bias=True``),
    ``layer_norm_weight`` ``[h]``, ``layer_norm_bias`` ``[h]`` (LayerNorm only).
    """

    def __init__(
        self, input_size: int, output_size: int, *, config, norm_kernel=None, **linear_kwargs
    ):
        _check_norm(config)
        if norm_kernel is not None and norm_kernel not in KERNELS:
            raise ValueError(
                f"norm_kernel: unknown kernel {norm_kernel!r}; pass one of {', '.join(KERNELS)}"
            )
        super().__init__(input_size, output_size, config=config, **linear_kwargs)
        self.norm_kernel = norm_kernel
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        device = self.weight.device if self.weight is not None else None
        factory = dict(dtype=config.params_dtype, device=device)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, **factory))
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
        if self.normalization == "RMSNorm" and self.norm_kernel is not None:
            gamma = self.layer_norm_weight.to(x.dtype)
            return rms_norm(x, gamma, self.eps, kernel=self.norm_kernel)
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, shape, self.layer_norm_weight, self.eps)
        return F.layer_norm(x, shape, self.layer_norm_weight, self.layer_norm_bias, self.eps)


def _check_norm(config) -> None:
    if config.normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(
            f"normalization: {config.normalization!r} is not supported by NormColumnParallelLinear;"
            " use 'LayerNorm' or 'RMSNorm'"
        )
    if config.layernorm_zero_centered_gamma:
        raise NotImplementedError(
            "layernorm_zero_centered_gamma: not supported by the torch norms of this spec; "
            "set it to False"
        )
