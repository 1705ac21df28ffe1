"""``NPUGatedDeltaNet``: Megatron-Core 0.16.1's Gated DeltaNet layer without fla, CUDA or TE.

Megatron's ``GatedDeltaNet`` keywords, parameter names, shapes and checkpoint splits, on
``mcore_npu.ops.gated_delta``; ``[s, b, h] -> ([s, b, h], bias)`` (``[s/tp, b, h]`` under SP, packed
thd ``[t, 1, h]``): ``in_proj`` -> causal conv + SiLU on q|k|v -> g, beta ->
``chunk_gated_delta_rule`` (per packed segment) -> gated ``out_norm`` -> ``out_proj``. Context
parallelism goes through a seam (:class:`NoContextParallel`). Inference is refused. See
docs/gdn_layer.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from mcore_npu.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule, l2norm
from mcore_npu.transformer.gated_delta_net.packing import segment_bounds
from mcore_npu.transformer.gated_delta_net.sharded import CONV_PARTS, IN_PROJ_PARTS, split_factory
from mcore_npu.transformer.mixer_support import (
    device_of,
    process_groups,
    sharded_default,
    sharded_tensors,
)


@dataclass
class NPUGatedDeltaNetSubmodules:
    """Megatron's ``GatedDeltaNetSubmodules`` slots (the same names)."""

    in_proj: ModuleSpec | type = IdentityOp
    out_norm: ModuleSpec | type = IdentityOp
    out_proj: ModuleSpec | type = IdentityOp


class NoContextParallel:
    """The context-parallel seam of the layer at CP = 1 (the identity). A CP implementation has:

    - ``to_heads(x, sections, packed_seq_params)``: ``[s/cp, b, C]`` (channels in ``sections``
      order, each ``(heads, head_dim)``: q, k, v, z, beta, alpha) -> ``[s, b, C/cp]`` (the whole
      sequence, this CP rank's share of every section's heads);
    - ``heads(count) -> slice``: which of ``count`` TP-local heads this CP rank holds;
    - ``to_sequence(x, packed_seq_params)``: ``[s, b, Hv/cp * V]`` -> ``[s/cp, b, Hv * V]``."""

    size = 1

    def to_heads(self, x, sections, packed_seq_params):
        return x

    def heads(self, count: int) -> slice:
        return slice(0, count)

    def to_sequence(self, x, packed_seq_params):
        return x


class NPUGatedDeltaNet(MegatronModule):
    """Gated DeltaNet with Megatron 0.16.1's names; ``[s, b, h] -> ([s, b, h], bias)``.

    Args (Megatron's ``GatedDeltaNet`` keywords, and):
        conv_bias: only False (the conv operator has no bias).
        use_qk_l2norm: l2-normalise q and k (in the rule's kernel).
        naive_l2norm: normalise q and k with plain torch before the rule instead (MindSpeed's
            ``use_naive_l2norm``).
        kernel: the rule's kernel choice when the operator takes one (None: its default).
        cp_comm_type: accepted and unused.
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number: int | None = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: float | None = None,
        use_qk_l2norm: bool = True,
        A_init_range: tuple[float, float] = (1, 16),
        pg_collection=None,
        naive_l2norm: bool = False,
        kernel: str | None = None,
        cp_comm_type=None,
        **_unused,
    ):
        _check_arguments(config, conv_bias, A_init_range)
        super().__init__(config)
        self.layer_number, self.bias, self.conv_bias = layer_number, bias, conv_bias
        self.conv_init, self.A_init_range = conv_init, tuple(A_init_range)
        if kernel is not None:
            from mcore_npu.ops.registry import check_kernel

            check_kernel(kernel, op="chunk_gated_delta_rule")
        self.use_qk_l2norm, self.naive_l2norm, self.kernel = use_qk_l2norm, naive_l2norm, kernel
        self.pg_collection = process_groups(pg_collection)
        self.tp_size = self.pg_collection.tp.size()
        self._set_sizes(config)
        linear = dict(config=config, bias=bias, is_expert=False, tp_group=self.pg_collection.tp)
        self.in_proj = build_module(
            submodules.in_proj,
            self.hidden_size,
            self.in_proj_dim,
            init_method=config.init_method,
            gather_output=False,
            skip_bias_add=False,
            tp_comm_buffer_name="fc1",
            **linear,
        )
        factory = dict(dtype=config.params_dtype, device=device_of(self.in_proj))
        width, kernel_size = self.conv_dim_local_tp, self.conv_kernel_dim
        self.conv1d = torch.nn.Conv1d(
            width, width, kernel_size, groups=width, padding=kernel_size - 1, bias=False, **factory
        )
        heads = self.num_v_heads_local_tp
        self.dt_bias = torch.nn.Parameter(torch.ones(heads, **factory))
        self.A_log = torch.nn.Parameter(torch.zeros(heads, **factory))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):
            param.tensor_model_parallel = True
            param.partition_dim = 0
        norm = dict(hidden_size=self.value_head_dim, eps=config.layernorm_epsilon)
        self.out_norm = build_module(
            submodules.out_norm, config=config, tp_group=self.pg_collection.tp, **norm
        )
        self.out_proj = build_module(
            submodules.out_proj,
            self.v_dim,
            self.hidden_size,
            init_method=config.output_layer_init_method,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_comm_buffer_name="fc2",
            **linear,
        )
        self.context_parallel = _context_parallel(self.pg_collection)
        self.recompute_core = config.recompute_granularity == "selective" and "core_attn" in (
            config.recompute_modules or ()
        )
        self.reset_parameters()

    def _set_sizes(self, config) -> None:
        self.hidden_size = config.hidden_size
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * self.num_value_heads
        self.conv_dim = 2 * self.qk_dim + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        self.num_k_heads_local_tp = self.num_key_heads // self.tp_size
        self.num_v_heads_local_tp = self.num_value_heads // self.tp_size

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron's initialisation (dt_bias = 1, A_log = log(U(A_init_range)), conv1d uniform),
        drawn for all heads and sliced to this TP rank, so a TP model starts from the one-process
        weights."""
        if not self.config.perform_initialization:
            return
        tp_rank = self.pg_collection.tp.rank()
        low, high = self.A_init_range
        a = torch.empty(self.num_value_heads, dtype=torch.float32).uniform_(low, high)
        self.A_log.copy_(a.log().chunk(self.tp_size)[tp_rank])
        self.dt_bias.fill_(1.0)
        bound = (
            self.conv_init if self.conv_init is not None else 1 / math.sqrt(self.conv_kernel_dim)
        )
        full = torch.empty(self.conv_dim, 1, self.conv_kernel_dim).uniform_(-bound, bound)
        parts = full.split([self.qk_dim, self.qk_dim, self.v_dim])
        local = [p.chunk(self.tp_size)[tp_rank] for p in parts]
        self.conv1d.weight.copy_(torch.cat(local))

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        key_value_states=None,
        inference_context=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
        **kwargs,
    ):
        """``[s, b, h]`` (``[s/tp, b, h]`` with SP; thd ``[t, 1, h]``) -> ``(out, bias)``.
        ``attention_mask`` is not read (causal by construction)."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(
                "inference_context: NPUGatedDeltaNet has no recurrent-state cache; run GDN "
                "models for training / full-sequence forwards only"
            )
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, C/tp]
        qkvzba = self.context_parallel.to_heads(qkvzba, self._sections(), packed_seq_params)
        bounds = segment_bounds(packed_seq_params, qkvzba.shape[0], qkvzba.shape[1])
        if self.recompute_core and self.training:
            from megatron.core import tensor_parallel

            out = tensor_parallel.checkpoint(self._mix, False, qkvzba, bounds)
        else:
            out = self._mix(qkvzba, bounds)
        out = self.context_parallel.to_sequence(out, packed_seq_params)
        return self.out_proj(out)

    def _sections(self) -> list[tuple[int, int]]:
        """``(heads, head_dim)`` of q, k, v, z, beta, alpha in this TP rank's ``in_proj`` rows."""
        hk, hv = self.num_k_heads_local_tp, self.num_v_heads_local_tp
        k, v = self.key_head_dim, self.value_head_dim
        return [(hk, k), (hk, k), (hv, v), (hv, v), (hv, 1), (hv, 1)]

    def _mix(self, qkvzba: torch.Tensor, bounds) -> torch.Tensor:
        """Everything between the projections: ``[s, b, C]`` -> ``[s, b, hv * V]`` (this rank's
        heads; ``bounds``: int ``[N + 1]`` segment starts for packed thd, or None)."""
        seq, batch = qkvzba.shape[:2]
        hk_slice, hv_slice = self._cp_heads()
        hk, hv = hk_slice.stop - hk_slice.start, hv_slice.stop - hv_slice.start
        dk, dv = self.key_head_dim, self.value_head_dim
        x = qkvzba.transpose(0, 1)  # [b, s, C]
        qkv, z, b, a = x.split([2 * hk * dk + hv * dv, hv * dv, hv, hv], dim=-1)
        qkv = causal_conv1d(qkv, self._conv_weight(hk_slice, hv_slice), cu_seqlens=bounds)
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k = q.reshape(batch, seq, hk, dk), k.reshape(batch, seq, hk, dk)
        v = v.reshape(batch, seq, hv, dv)
        if self.use_qk_l2norm and self.naive_l2norm:
            q, k = l2norm(q), l2norm(k)
        a_log, dt_bias = self.A_log[hv_slice].float(), self.dt_bias[hv_slice].float()
        g = -a_log.exp() * F.softplus(a.float() + dt_bias)  # [b, s, hv], fp32
        o, _ = self._rule(q, k, v, g, b.sigmoid(), bounds)  # [b', s', hv, V]
        o = o.reshape(batch, seq, hv, dv)
        y = self.out_norm(o, z.reshape(batch, seq, hv, dv))
        return y.reshape(batch, seq, hv * dv).transpose(0, 1).contiguous()

    def _rule(self, q, k, v, g, beta, bounds):
        in_kernel = self.use_qk_l2norm and not self.naive_l2norm
        extra = {} if self.kernel is None else {"kernel": self.kernel}
        if bounds is not None and q.shape[0] > 1:  # thd is one row; never reached otherwise
            raise ValueError(f"packed_seq_params: thd needs batch 1, got {q.shape[0]}")
        return chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=bounds, use_qk_l2norm_in_kernel=in_kernel, **extra
        )

    def _cp_heads(self) -> tuple[slice, slice]:
        """This CP rank's slices of the TP-local key and value heads."""
        cp = self.context_parallel
        return cp.heads(self.num_k_heads_local_tp), cp.heads(self.num_v_heads_local_tp)

    def _conv_weight(self, hk: slice, hv: slice) -> torch.Tensor:
        """``conv1d.weight`` rows of the heads in ``hk`` / ``hv`` (all of them at CP = 1)."""
        weight = self.conv1d.weight
        if self.context_parallel.size == 1:
            return weight
        dk, dv = self.key_head_dim, self.value_head_dim
        qk_rows, v_rows = self.num_k_heads_local_tp * dk, self.num_v_heads_local_tp * dv
        q, k, v = weight.split([qk_rows, qk_rows, v_rows])
        rows = lambda t, s, d: t[s.start * d : s.stop * d]  # noqa: E731
        return torch.cat([rows(q, hk, dk), rows(k, hk, dk), rows(v, hv, dv)])

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """Megatron 0.16.1's keys: ``A_log`` / ``dt_bias`` / ``conv1d.weight`` TP-sharded on axis 0,
        ``in_proj.weight`` and ``conv1d.weight`` split into their parts (``sharded.py``)."""
        tp_group = tp_group if tp_group is not None else self.pg_collection.tp
        where = dict(offsets=sharded_offsets, metadata=metadata, tp_group=tp_group)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        result = sharded_tensors(own, prefix, {"A_log": 0, "dt_bias": 0}, **where)
        conv = self.conv1d.state_dict(prefix="", keep_vars=True)
        result.update(sharded_tensors(conv, f"{prefix}conv1d.", {"weight": 0}, **where))
        for name in ("in_proj", "out_norm", "out_proj"):
            result.update(sharded_default(getattr(self, name), f"{prefix}{name}.", **where))
        tp = self.tp_size
        qk, v, hv = self.qk_dim // tp, self.v_dim // tp, self.num_value_heads // tp
        key = f"{prefix}in_proj.weight"
        result[key] = split_factory(result[key], [qk, qk, v, v, hv, hv], IN_PROJ_PARTS)
        key = f"{prefix}conv1d.weight"
        result[key] = split_factory(result[key], [qk, qk, v], CONV_PARTS)
        return result


def _check_arguments(config, conv_bias: bool, A_init_range) -> None:
    if conv_bias:
        raise ValueError(
            "conv_bias: True is not supported by NPUGatedDeltaNet (the causal conv operator has "
            "no bias); pass conv_bias=False, Megatron's default"
        )
    low, high = A_init_range
    if not 0 <= low <= high:
        raise ValueError(f"A_init_range: {A_init_range!r}; pass (low, high) with 0 <= low <= high")
    act = getattr(config, "activation_func", F.silu)
    if act is not F.silu:
        raise ValueError(
            f"activation_func: {getattr(act, '__name__', act)!r}; the GDN conv and output gate "
            "run SiLU (F.silu), as Qwen3.5 / Qwen3-Next do; set activation_func=F.silu"
        )


def _context_parallel(pg_collection):
    """The CP seam: :class:`NoContextParallel` at CP = 1, else the all-to-all implementation."""
    cp_group = getattr(pg_collection, "cp", None)
    if cp_group is None or cp_group.size() == 1:
        return NoContextParallel()
    try:
        from mcore_npu.transformer.gated_delta_net.context_parallel import GDNContextParallel
    except ImportError as err:
        raise ValueError(
            f"context_parallel_size: {cp_group.size()} needs the GDN all-to-all "
            f"(mcore_npu.transformer.gated_delta_net.context_parallel: {err}); run with CP 1"
        ) from err
    return GDNContextParallel(cp_group)
