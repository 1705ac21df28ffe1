"""``NPUMambaMixer``: Megatron-Core's ``MambaMixer`` without mamba_ssm, causal_conv1d, Triton,
CUDA or Transformer Engine.

Megatron's keywords, parameter names, shapes and checkpoint splits, on ``mcore_npu.ops``;
``[s, b, h] -> ([s, b, h], bias)`` (``[s/tp, b, h]`` under SP, packed thd ``[t, 1, h]``):
``in_proj`` -> z | xBC | dt -> causal conv + bias + SiLU on xBC -> ``mamba_chunk_scan_combined``
(``seq_idx`` from the packed offsets) -> gated RMSNorm with z -> ``out_proj``. Heads and groups
split over TP; context parallelism trades the sequence for heads by all-to-all. Inference is
refused. See docs/mamba_layer.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from mcore_npu.ops.gated_delta import causal_conv1d
from mcore_npu.ops.mamba import mamba_chunk_scan_combined
from mcore_npu.transformer.gated_delta_net.layer import NoContextParallel
from mcore_npu.transformer.gated_delta_net.packing import segment_bounds
from mcore_npu.transformer.gated_delta_net.sharded import split_factory
from mcore_npu.transformer.mamba.norm import MambaGatedRMSNorm
from mcore_npu.transformer.mixer_support import (
    device_of,
    process_groups,
    sharded_default,
    sharded_tensors,
)

IN_PROJ_PARTS = ("z", "x", "B", "C", "dt")
CONV_PARTS = ("x", "B", "C")


@dataclass
class NPUMambaMixerSubmodules:
    """Megatron's ``MambaMixerSubmodules`` slots (the same names)."""

    in_proj: ModuleSpec | type = IdentityOp
    out_proj: ModuleSpec | type = IdentityOp


class NPUMambaMixer(MegatronModule):
    """Mamba2's mixer with Megatron's names; ``[s, b, h] -> ([s, b, h], bias)``.

    Args: Megatron's ``MambaMixer`` keywords (``d_state``, ``headdim``, ``ngroups`` and
    ``use_mem_eff_path`` come from the config, as there); ``kernel``: the scan's kernel choice.
    ``bias=True`` and ``norm_before_gate=True`` are refused, as Megatron refuses them.
    """

    def __init__(
        self,
        config,
        submodules,
        d_model,
        d_conv=4,
        conv_init=None,
        expand=2,
        A_init_range=(1, 16),
        D_has_hdim=False,
        rmsnorm=True,
        norm_before_gate=False,
        dt_min=0.001,
        dt_max=0.1,
        dt_init="random",
        dt_scale=1.0,
        dt_init_floor=1e-4,
        bias=False,
        conv_bias=True,
        chunk_size=128,
        layer_number=None,
        use_mem_eff_path=None,
        d_state=None,
        headdim=None,
        ngroups=None,
        pg_collection=None,
        pp_layer_offset=0,
        kernel="auto",
        **_unused,
    ):
        _check_arguments(bias, norm_before_gate, A_init_range, dt_min, dt_max)
        super().__init__(config)
        self.d_model, self.d_conv, self.conv_init, self.expand = d_model, d_conv, conv_init, expand
        self.A_init_range, self.D_has_hdim, self.rmsnorm = tuple(A_init_range), D_has_hdim, rmsnorm
        self.dt_range, self.dt_init_floor = (dt_min, dt_max), dt_init_floor
        self.chunk_size, self.layer_number, self.kernel = chunk_size, layer_number, kernel
        self.pg_collection = process_groups(pg_collection)
        self.tp_group = self.pg_collection.tp
        self._set_sizes(config, self.tp_group.size())
        self.in_proj = build_module(
            submodules.in_proj,
            d_model,
            2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
        )
        factory = dict(device=device_of(self.in_proj), dtype=config.params_dtype)
        width = self.conv_dim_local_tp
        self.conv1d = torch.nn.Conv1d(
            width, width, d_conv, groups=width, padding=d_conv - 1, bias=conv_bias, **factory
        )
        heads, device = self.nheads_local_tp, factory["device"]
        self.dt_bias = torch.nn.Parameter(torch.empty(heads, **factory))
        self.A_log = torch.nn.Parameter(torch.empty(heads, dtype=torch.float32, device=device))
        d_size = self.d_inner_local_tp if D_has_hdim else heads
        self.D = torch.nn.Parameter(torch.ones(d_size, device=device))  # fp32
        sharded = [self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D]
        if rmsnorm:
            group = self.d_inner_local_tp // self.ngroups_local_tp
            self.norm = MambaGatedRMSNorm(
                self.d_inner_local_tp, eps=1e-5, group_size=group, tp_group=self.tp_group, **factory
            )
        for param in sharded:
            if param is not None:
                param.tensor_model_parallel, param.partition_dim = True, 0
        self.out_proj = build_module(
            submodules.out_proj,
            self.d_inner,
            d_model,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
        )
        self.context_parallel = _context_parallel(self.pg_collection)
        self.recompute_core = config.recompute_granularity == "selective" and "core_attn" in (
            config.recompute_modules or ()
        )
        self.reset_parameters()

    def _set_sizes(self, config, tp: int) -> None:
        self.d_state, self.headdim = config.mamba_state_dim, config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
        else:
            self.nheads = int(self.expand * self.d_model) // self.headdim
        self.d_inner = self.nheads * self.headdim
        check_sizes(self.nheads, self.ngroups, tp, config)
        self.nheads_local_tp, self.ngroups_local_tp = self.nheads // tp, self.ngroups // tp
        self.d_inner_local_tp = self.d_inner // tp
        self.conv_dim_local_tp = self.d_inner_local_tp + 2 * self.ngroups_local_tp * self.d_state

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron's initialisation (dt_bias = softplus^-1 of a log-uniform dt in (dt_min,
        dt_max), A_log = log U(A_init_range), D = 1, conv1d uniform), drawn for all heads and
        sliced to this TP rank, so a TP model starts from the one-process weights."""
        if not self.config.perform_initialization:
            return
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        low, high = (math.log(v) for v in self.dt_range)
        dt = torch.exp(torch.rand(self.nheads) * (high - low) + low).clamp(min=self.dt_init_floor)
        self.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt))).chunk(tp)[rank])
        a = torch.empty(self.nheads).uniform_(*self.A_init_range)
        self.A_log.copy_(a.log().chunk(tp)[rank])
        self.D.fill_(1.0)
        bound = self.conv_init if self.conv_init is not None else 1 / math.sqrt(self.d_conv)
        rows = self.d_inner + 2 * self.ngroups * self.d_state
        whole = [torch.empty(rows, 1, self.d_conv).uniform_(-bound, bound)]
        targets = [self.conv1d.weight]
        if self.conv1d.bias is not None:
            whole.append(
                torch.empty(rows).uniform_(-1 / math.sqrt(self.d_conv), 1 / math.sqrt(self.d_conv))
            )
            targets.append(self.conv1d.bias)
        for full, target in zip(whole, targets, strict=True):
            parts = full.split(
                [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state]
            )
            target.copy_(torch.cat([p.chunk(tp)[rank] for p in parts]))
        if self.rmsnorm:
            self.norm.weight.fill_(1.0)

    def forward(
        self,
        hidden_states,
        inference_context=None,
        *,
        inference_params=None,
        packed_seq_params=None,
        **_unused,
    ):
        """``[s, b, h]`` (``[s/tp, b, h]`` with SP; thd ``[t, 1, h]``) -> ``(out, bias)``."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(
                "inference_context: NPUMambaMixer keeps no conv / SSM state cache; run hybrid "
                "models for training and full-sequence forwards only"
            )
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, C/tp]
        zxbcdt = self.context_parallel.to_heads(zxbcdt, self._sections(), packed_seq_params)
        bounds = segment_bounds(packed_seq_params, zxbcdt.shape[0], zxbcdt.shape[1])
        if self.recompute_core and self.training:
            from megatron.core import tensor_parallel

            y = tensor_parallel.checkpoint(self._mix, False, zxbcdt, bounds)
        else:
            y = self._mix(zxbcdt, bounds)
        return self.out_proj(self.context_parallel.to_sequence(y, packed_seq_params))

    def _sections(self) -> list[tuple[int, int]]:
        """``(heads or groups, width)`` of z, x, B, C, dt in this TP rank's ``in_proj`` rows."""
        h, g = self.nheads_local_tp, self.ngroups_local_tp
        return [(h, self.headdim), (h, self.headdim), (g, self.d_state), (g, self.d_state), (h, 1)]

    def _mix(self, zxbcdt: torch.Tensor, bounds) -> torch.Tensor:
        """Everything between the projections: ``[s, b, C]`` -> ``[s, b, h * p]`` (this rank's
        heads; ``bounds``: int ``[N + 1]`` segment starts for packed thd, or None)."""
        seq, batch = zxbcdt.shape[:2]
        heads, groups = self._cp_slices()
        h, g = heads.stop - heads.start, groups.stop - groups.start
        p, n = self.headdim, self.d_state
        z, xbc, dt = zxbcdt.transpose(0, 1).split([h * p, h * p + 2 * g * n, h], dim=-1)
        weight, bias = self._conv_params(heads, groups)
        xbc = causal_conv1d(xbc, weight, bias, cu_seqlens=bounds)
        x, B, C = xbc.split([h * p, g * n, g * n], dim=-1)
        D = (
            self.D[heads.start * p : heads.stop * p].view(h, p)
            if self.D_has_hdim
            else self.D[heads]
        )
        z = z.reshape(batch, seq, h, p)
        y = mamba_chunk_scan_combined(
            x.reshape(batch, seq, h, p),
            dt,
            -torch.exp(self.A_log[heads].float()),
            B.reshape(batch, seq, g, n),
            C.reshape(batch, seq, g, n),
            self.chunk_size,
            D=D.float(),
            z=None if self.rmsnorm else z,
            dt_bias=self.dt_bias[heads].float(),
            seq_idx=_seq_idx(bounds, seq),
            dt_softplus=True,
            kernel=self.kernel,
        ).reshape(batch, seq, h * p)
        if self.rmsnorm:
            y = self.norm(y, z.reshape(batch, seq, h * p), slice(heads.start * p, heads.stop * p))
        return y.transpose(0, 1).contiguous()

    def _cp_slices(self) -> tuple[slice, slice]:
        """This CP rank's slices of the TP-local heads and groups."""
        cp = self.context_parallel
        return cp.heads(self.nheads_local_tp), cp.heads(self.ngroups_local_tp)

    def _conv_params(self, heads: slice, groups: slice):
        """``conv1d`` weight / bias rows of this CP rank's x, B and C channels."""
        weight, bias = self.conv1d.weight, self.conv1d.bias
        if self.context_parallel.size == 1:
            return weight, bias
        p, n, h, g = self.headdim, self.d_state, self.nheads_local_tp, self.ngroups_local_tp

        def rows(t):
            x, B, C = t.split([h * p, g * n, g * n])
            pick = lambda v, s, d: v[s.start * d : s.stop * d]  # noqa: E731
            return torch.cat([pick(x, heads, p), pick(B, groups, n), pick(C, groups, n)])

        return rows(weight), None if bias is None else rows(bias)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """Megatron's keys: ``A_log`` / ``dt_bias`` / ``D`` / ``conv1d.*`` / ``norm.weight``
        TP-sharded on axis 0; ``in_proj.weight`` split into z, x, B, C, dt and ``conv1d.*`` into
        x, B, C (each TP-sharded on its own, so a checkpoint loads at another TP size)."""
        tp_group = tp_group if tp_group is not None else self.tp_group
        where = dict(offsets=sharded_offsets, metadata=metadata, tp_group=tp_group)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        result = sharded_tensors(own, prefix, {"A_log": 0, "dt_bias": 0, "D": 0}, **where)
        conv = self.conv1d.state_dict(prefix="", keep_vars=True)
        result.update(sharded_tensors(conv, f"{prefix}conv1d.", {"weight": 0, "bias": 0}, **where))
        for name, module in self.named_children():
            if name != "conv1d":
                result.update(sharded_default(module, f"{prefix}{name}.", **where))
        x, gn, h = self.d_inner_local_tp, self.ngroups_local_tp * self.d_state, self.nheads_local_tp
        key = f"{prefix}in_proj.weight"
        result[key] = split_factory(result[key], [x, x, gn, gn, h], IN_PROJ_PARTS)
        for key in (f"{prefix}conv1d.weight", f"{prefix}conv1d.bias"):
            if key in result:
                result[key] = split_factory(result[key], [x, gn, gn], CONV_PARTS)
        return result


def _seq_idx(bounds, seq: int):
    """int32 ``[1, seq]`` packed-sequence index of each token, or None (sbhd)."""
    if bounds is None:
        return None
    lengths = bounds[1:] - bounds[:-1]
    index = torch.repeat_interleave(torch.arange(len(lengths), device=bounds.device), lengths)
    return index.to(torch.int32)[None]


def _check_arguments(bias, norm_before_gate, A_init_range, dt_min, dt_max) -> None:
    if bias:
        raise ValueError("bias: True; Megatron's MambaMixer has no projection bias, pass False")
    if norm_before_gate:
        raise ValueError(
            "norm_before_gate: True; Mamba2 (Megatron, Nemotron-H) gates before the norm, "
            "as Megatron's MambaMixer requires: pass False"
        )
    low, high = A_init_range
    if not 0 < low <= high:
        raise ValueError(f"A_init_range: {A_init_range!r}; pass (low, high) with 0 < low <= high")
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"dt_min, dt_max: {dt_min}, {dt_max}; pass 0 < dt_min <= dt_max")


def check_sizes(nheads: int, ngroups: int, tp: int, config, cp: int = 1) -> None:
    """ValueError naming the config field when the Mamba sizes cannot split over TP x CP."""
    for name, value in (
        ("mamba_state_dim", config.mamba_state_dim),
        ("mamba_head_dim", config.mamba_head_dim),
        ("mamba_num_groups", ngroups),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"config.{name}: {value!r}; pass a positive int")
    if nheads <= 0 or nheads % ngroups:
        raise ValueError(
            f"config.mamba_num_groups: {ngroups} does not divide the {nheads} Mamba heads; "
            "pass a group count that divides mamba_num_heads"
        )
    if nheads % tp or ngroups % tp:
        raise ValueError(
            f"tensor_model_parallel_size: {tp} must divide the {nheads} Mamba heads and the "
            f"{ngroups} groups (config.mamba_num_heads / mamba_num_groups); pick a TP size that "
            "divides both"
        )
    if (nheads // tp) % cp or (ngroups // tp) % cp:
        raise ValueError(
            f"context_parallel_size: {cp} must divide the {nheads // tp} Mamba heads and "
            f"{ngroups // tp} groups of each TP rank (the all-to-all splits them); pick mamba_num_"
            "heads / mamba_num_groups divisible by tensor x context parallel size"
        )


def _context_parallel(pg_collection):
    """The CP seam: the identity at CP = 1, else the heads <-> sequence all-to-all."""
    cp_group = getattr(pg_collection, "cp", None)
    if cp_group is None or cp_group.size() == 1:
        return NoContextParallel()
    from mcore_npu.transformer.gated_delta_net.context_parallel import GDNContextParallel

    return GDNContextParallel(cp_group)
