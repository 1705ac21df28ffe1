"""``NPUGroupedMLP``: the routed experts of an MoE layer, one ``npu_grouped_matmul`` per projection.

Tokens sorted by local expert: ``x [T, H] --fc1 (+b1)--> [T, F'] --act--> [T, F] --*probs-->
--fc2--> [T, H] --+b2*probs--> [T, H]`` (``F = moe_ffn_hidden_size / expert_tp``, ``F' = 2F`` with a
GLU). Names: ``"local"`` = ``SequentialMLP``'s, ``"te"`` = ``TEGroupedMLP``'s; both write
``SequentialMLP``'s checkpoint keys. With ``use_cpu_initialization`` every rank draws all global
experts from the CPU generator and keeps its own. See docs/moe.md."""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

from mcore_npu.ops import batch_invariant_linear, grouped_linear, swiglu
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer.backends import check_param_layout
from mcore_npu.transformer.extra_state import EmptyExtraState
from mcore_npu.transformer.mlp import is_plain_swiglu
from mcore_npu.transformer.param_layout import EXTRA_STATE


class _Weight(torch.nn.Module):
    """One expert linear: ``weight`` and, with ``add_bias_linear``, ``bias``; an empty
    ``_extra_state`` as Megatron's linears have."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        if bias is not None:
            self.bias = bias

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        """Nothing to restore (Megatron's local linears keep None here too)."""


class _Expert(torch.nn.Module):
    def __init__(self, fc1, fc2, bias1=None, bias2=None) -> None:
        super().__init__()
        self.linear_fc1, self.linear_fc2 = _Weight(fc1, bias1), _Weight(fc2, bias2)


class _Grouped(EmptyExtraState, torch.nn.Module):
    """``weight{e}`` (``bias{e}``) and one ``_extra_state``: the names of TE's ``GroupedLinear``.
    The per-expert ``_extra_state{e}`` keys of a loaded sharded checkpoint are dropped."""

    def __init__(self, weights: list[torch.nn.Parameter], biases=None) -> None:
        super().__init__()
        self.num_gemms = len(weights)
        for e, w in enumerate(weights):
            self.register_parameter(f"weight{e}", w)
        for e, b in enumerate(biases or []):
            self.register_parameter(f"bias{e}", b)
        self._register_load_state_dict_pre_hook(self._drop_split_extra_states)

    def _drop_split_extra_states(self, state_dict, prefix, *_args) -> None:
        for e in range(1, self.num_gemms):
            state_dict.pop(f"{prefix}{EXTRA_STATE}{e}", None)


class NPUGroupedColumnLinear(_Grouped):
    """fc1's grouped weights (``[F', H]`` per expert, split over expert TP by rows); a class of its
    own so converters that read the split from the class name tell fc1 from fc2."""


class NPUGroupedRowLinear(_Grouped):
    """fc2's grouped weights (``[H, F]`` per expert, split by columns)."""


class NPUGroupedMLP(MegatronModule):
    """The routed experts of one MoE layer as two grouped matmuls.

    Args:
        num_local_experts: experts on this expert-parallel rank (E).
        submodules: ignored (the weights live here).
        pg_collection: Megatron's process groups (``ep``, ``expt_tp``, ``expt_dp``).
        kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"`` for grouped matmul and SwiGLU.
        param_layout: ``"local"`` (SequentialMLP names) or ``"te"`` (TEGroupedMLP names).
        batch_invariant_kernel: batch-invariant mode: each expert's matmuls through
            ``batch_invariant_linear`` with this kernel instead of the grouped matmul.
    """

    takes_batch_invariant_kernel = True  # batch_invariant.route_linears passes it

    def __init__(
        self,
        num_local_experts,
        config,
        submodules=None,
        pg_collection=None,
        *,
        kernel: str = "auto",
        param_layout: str = "local",
        batch_invariant_kernel: str | None = None,
        **_unused,
    ):
        super().__init__(config=config)
        _check_choices(kernel, param_layout, config)
        if batch_invariant_kernel is not None:
            check_kernel(batch_invariant_kernel, op="batch_invariant_linear",
                         what="batch_invariant_kernel")  # fmt: skip
        self.kernel, self.param_layout = kernel, param_layout
        self.batch_invariant_kernel = batch_invariant_kernel
        self.num_local_experts = num_local_experts
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        tp = self.tp_group.size()
        if config.moe_ffn_hidden_size % tp:
            raise ValueError(
                f"moe_ffn_hidden_size: {config.moe_ffn_hidden_size} is not divisible "
                f"by the expert tensor-parallel size {tp}; pick a multiple"
            )
        self.ffn_per_rank = config.moe_ffn_hidden_size // tp
        fc1, fc2 = self._make_weights()
        bias1, bias2 = self._make_biases()
        if param_layout == "local":
            self.local_experts = torch.nn.ModuleList(
                _Expert(*params) for params in zip(fc1, fc2, bias1, bias2)
            )
        else:
            self.linear_fc1 = NPUGroupedColumnLinear(fc1, bias1 if config.add_bias_linear else None)
            self.linear_fc2 = NPUGroupedRowLinear(fc2, bias2 if config.add_bias_linear else None)

    def fc1_weights(self) -> list[torch.nn.Parameter]:
        """E x ``[F', H]`` in local-expert order."""
        if self.param_layout == "local":
            return [expert.linear_fc1.weight for expert in self.local_experts]
        return [getattr(self.linear_fc1, f"weight{e}") for e in range(self.num_local_experts)]

    def fc2_weights(self) -> list[torch.nn.Parameter]:
        """E x ``[H, F]`` in local-expert order."""
        if self.param_layout == "local":
            return [expert.linear_fc2.weight for expert in self.local_experts]
        return [getattr(self.linear_fc2, f"weight{e}") for e in range(self.num_local_experts)]

    def fc1_biases(self) -> list[torch.nn.Parameter] | None:
        """E x ``[F']`` in local-expert order, or None without ``add_bias_linear``."""
        return self._biases("linear_fc1")

    def fc2_biases(self) -> list[torch.nn.Parameter] | None:
        """E x ``[H]`` in local-expert order, or None without ``add_bias_linear``."""
        return self._biases("linear_fc2")

    def _biases(self, which: str) -> list[torch.nn.Parameter] | None:
        if not self.config.add_bias_linear:
            return None
        if self.param_layout == "local":
            return [getattr(expert, which).bias for expert in self.local_experts]
        return [getattr(getattr(self, which), f"bias{e}") for e in range(self.num_local_experts)]

    def _make_biases(self):
        """E zero fc1 ``[F']`` and fc2 ``[H]`` biases (or Nones), tagged as Megatron tags its
        linears'."""
        c = self.config
        if not c.add_bias_linear:
            return [None] * self.num_local_experts, [None] * self.num_local_experts
        glu = 2 if c.gated_linear_unit else 1
        device = torch.device("cpu") if c.use_cpu_initialization else _current_device()
        made = []
        for size in (glu * self.ffn_per_rank, c.hidden_size):
            params = [
                torch.nn.Parameter(torch.zeros(size, dtype=c.params_dtype, device=device))
                for _ in range(self.num_local_experts)
            ]
            made.append(params)
        for b1, b2 in zip(*made):
            _tag(b1, 0)
            b2.allreduce = False
            b2.sequence_parallel = c.sequence_parallel
        return made

    def _make_weights(self):
        c = self.config
        glu = 2 if c.gated_linear_unit else 1
        shapes = ((glu * self.ffn_per_rank, c.hidden_size), (c.hidden_size, self.ffn_per_rank))
        device = torch.device("cpu") if c.use_cpu_initialization else _current_device()
        made = []
        for (rows, cols), init, tp_dim in zip(
            shapes, (c.init_method, c.output_layer_init_method), (0, 1)
        ):
            local = [
                torch.empty(rows, cols, dtype=c.params_dtype, device=device)
                for _ in range(self.num_local_experts)
            ]
            if c.perform_initialization:
                self._initialize(local, init, tp_dim, glu if tp_dim == 0 else 1)
            params = [torch.nn.Parameter(w) for w in local]
            for p in params:
                _tag(p, tp_dim)
            made.append(params)
        return made

    def _initialize(self, local, init_method, tp_dim, glu):
        """Fill ``local`` in place (CPU scheme: see the module docstring)."""
        if not self.config.use_cpu_initialization:
            from megatron.core.tensor_parallel.random import (
                get_cuda_rng_tracker,
                get_expert_parallel_rng_tracker_name,
            )

            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for w in local:
                    init_method(w)
            return
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        first = self.ep_group.rank() * self.num_local_experts
        rows, cols = local[0].shape
        full = (rows * tp, cols) if tp_dim == 0 else (rows, cols * tp)
        for g in range(self.ep_group.size() * self.num_local_experts):
            master = torch.empty(full, dtype=torch.float32)
            init_method(master)
            e = g - first
            if 0 <= e < self.num_local_experts:
                # [glu * F_total, H] -> glu parts -> this rank's slice of each -> concatenated
                parts = master.chunk(glu, dim=tp_dim)
                mine = [p.chunk(tp, dim=tp_dim)[tp_rank] for p in parts]
                local[e].data.copy_(torch.cat(mine, dim=tp_dim))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """Experts on the dispatched tokens: ``[T, H]`` rows sorted by local expert,
        ``tokens_per_expert`` ``[E]`` (tensor or list), ``permuted_probs`` ``[T]`` ->
        ``(output [T, H], None)``."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            x = (probs.unsqueeze(-1) * x).to(x.dtype)  # probs applied once, before fc1
            probs = torch.ones_like(probs)
        h = self._linear(x, self.fc1_weights(), tokens_per_expert, self.fc1_biases())
        h = self._activation(h)  # [T, F]
        h = (h * probs.unsqueeze(-1)).to(h.dtype)
        out = self._linear(h, self.fc2_weights(), tokens_per_expert)
        if (biases := self.fc2_biases()) is not None:
            out = _add_weighted_bias(out, biases, tokens_per_expert, probs)
        return out, None

    def _linear(self, x, weights, tokens_per_expert, biases=None) -> torch.Tensor:
        """``x [T, K]`` (rows by expert) through each expert's ``[N, K]`` weight -> ``[T, N]``:
        the grouped matmul, or one batch-invariant matmul per expert in the mode."""
        if self.batch_invariant_kernel is None:
            return grouped_linear(x, weights, tokens_per_expert, biases=biases, kernel=self.kernel)
        counts = torch.as_tensor(tokens_per_expert).tolist()
        biases = biases or [None] * len(weights)
        parts = [
            batch_invariant_linear(rows, w, b, kernel=self.batch_invariant_kernel)
            if len(rows) else rows.new_zeros(0, w.shape[0])  # an expert without tokens
            for rows, w, b in zip(x.split(counts), weights, biases, strict=True)
        ]  # fmt: skip
        return torch.cat(parts)

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(h)
        if is_plain_swiglu(c):
            return swiglu(h, -1, kernel=self.kernel)
        gate, linear = torch.chunk(h, 2, dim=-1)
        if (val := c.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(max=val), linear.clamp(min=-val, max=val)
        return c.activation_func(gate) * (linear + c.glu_linear_offset)

    def backward_dw(self):
        """Weight gradients are computed in backward already (no delayed wgrad)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``SequentialMLP``'s checkpoint keys and shards, in both layouts: the global expert index
        is a sharded axis (or in the key with ``singleton_local_shards``); expert-TP shards add the
        TP axis."""
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        if tp > 1 and self.config.gated_linear_unit:
            raise NotImplementedError(
                "NPUGroupedMLP.sharded_state_dict: expert tensor parallelism with a gated linear "
                "unit; use expert_tensor_parallel_size=1"
            )
        singleton = bool((metadata or {}).get("singleton_local_shards", False))
        first = self.ep_group.rank() * self.num_local_experts
        total = self.ep_group.size() * self.num_local_experts
        dp_rank = self.dp_group.rank()

        def where(e: int, which: str):
            if singleton:
                return f"{prefix}experts.{first + e}.{which}", tuple(sharded_offsets)
            expert_axis = (len(sharded_offsets), first + e, total)
            return f"{prefix}experts.{which}", (*sharded_offsets, expert_axis)

        result = {}
        for name, param in self.named_parameters():
            e, which, leaf = _expert_of(name, self.param_layout)
            key, offsets = where(e, which)
            replicated = (which, leaf) == ("linear_fc2", "bias")  # RowParallelLinear's bias
            axis = 0 if which == "linear_fc1" else 1
            axes = [] if tp == 1 or replicated else [(len(offsets) + axis, tp_rank, tp)]
            replica = (0, tp_rank if replicated else 0, dp_rank)
            result[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{key}.{leaf}",
                param,
                *offsets,
                *axes,
                replica_id=replica,
                prepend_axis_num=len(offsets),
            )
        # the linears' (empty) extra state, one object per expert and linear, under the names
        # of SequentialMLP ("local") or TEGroupedLinear ("te"; see _extra_state_name)
        for e in range(self.num_local_experts):
            for which in ("linear_fc1", "linear_fc2"):
                key, offsets = where(e, which)
                name = _extra_state_name(e, which, self.param_layout)
                result[f"{prefix}{name}"] = make_sharded_object_for_checkpoint(
                    None, f"{key}.{EXTRA_STATE}", offsets, replica_id=(0, tp_rank, dp_rank)
                )
        return result


def _extra_state_name(e: int, which: str, layout: str) -> str:
    """The ``sharded_state_dict`` name of local expert ``e``'s extra state: ``SequentialMLP``'s, or
    as ``TEGroupedLinear`` names them (``_extra_state`` for expert 0, ``_extra_state{e}`` after)."""
    if layout == "local":
        return f"local_experts.{e}.{which}.{EXTRA_STATE}"
    return f"{which}.{EXTRA_STATE}{e or ''}"


def _expert_of(name: str, layout: str) -> tuple[int, str, str]:
    """``local_experts.3.linear_fc1.weight`` / ``linear_fc1.weight3`` ->
    ``(3, "linear_fc1", "weight")``."""
    parts = name.split(".")
    if layout == "local":
        return int(parts[1]), parts[2], parts[3]
    leaf = "bias" if parts[1].startswith("bias") else "weight"
    return int(parts[1].removeprefix(leaf)), parts[0], leaf


def _add_weighted_bias(out, biases, tokens_per_expert, probs) -> torch.Tensor:
    """``out [T, H] + b2_e * probs`` for every row of expert e (no host sync)."""
    counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64).to(out.device)
    experts = torch.arange(len(biases), device=out.device)
    rows = torch.repeat_interleave(experts, counts, output_size=out.shape[0])  # [T]
    per_row = torch.stack(list(biases))[rows]  # [T, H]
    return (out + per_row * probs.unsqueeze(-1)).to(out.dtype)


def _tag(param: torch.nn.Parameter, tp_dim: int) -> None:
    """Megatron's expert-parameter attributes: TP-sharded along ``tp_dim``, ``allreduce = False``."""
    param.tensor_model_parallel = True
    param.partition_dim = tp_dim
    param.partition_stride = 1
    param.allreduce = False


def _current_device() -> torch.device:
    from mcore_npu.allocator import device

    return device.current_device()


def _check_choices(kernel, param_layout, config) -> None:
    check_kernel(kernel)
    check_param_layout(param_layout)
    if config.fp8 or config.fp4:
        raise ValueError(
            "fp8/fp4: NPUGroupedMLP runs the floating-point grouped matmul; turn fp8/fp4 off"
        )
