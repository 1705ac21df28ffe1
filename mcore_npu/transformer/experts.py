"""Grouped experts for Megatron's MoE layer: one ``npu_grouped_matmul`` per projection.

``NPUGroupedMLP`` fills the ``experts`` slot of ``MoESubmodules`` and takes what the slot passes
(``num_local_experts, config, submodules=None, pg_collection=...``) plus the spec's ``kernel``
and ``param_layout``. Forward, for the tokens the dispatcher sorted by local expert::

    x [T, H] --fc1 (grouped, one call, + b1_e)--> [T, F'] --SwiGLU (npu_swiglu) / activation-->
      [T, F] --* probs [T, 1]--> --fc2 (grouped, one call)--> [T, H] --+ b2_e * probs--> [T, H]

With ``add_bias_linear`` each expert has an fc1 bias ``b1_e`` [F'] (the operator's ``bias``,
added before the activation) and an fc2 bias ``b2_e`` [H], which, as in Megatron's
``SequentialMLP`` (``MLP.forward`` with ``per_token_scale``) and ``TEGroupedMLP._apply_bias``,
is scaled by each row's routing probability and added to the output: the layer returns no
separate bias. ``bias_activation_fusion`` changes nothing here: the fused function computes
swiglu(y + b) too (megatron-core 0.16.1's experts raise "Bias is not supported for weighted
swiglu fusion" for it; this module computes what it stands for).

``F`` = ``moe_ffn_hidden_size / expert_tp``, ``F' = 2F`` with a gated linear unit. Backward runs
one grouped matmul for dX and one (``group_type=2``) for all experts' dW per projection
(:class:`mcore_npu.ops.fused.GroupedLinear`). Off-NPU the reference runs with the same arguments.

Parameters (Megatron's linear layout ``[out, in]``), by ``param_layout``:

- ``"local"``: ``local_experts.{e}.linear_fc1.weight`` ``[F', H]`` and
  ``local_experts.{e}.linear_fc2.weight`` ``[H, F]`` (``SequentialMLP``'s names: its state dict
  loads as is), biases ``local_experts.{e}.linear_fc1.bias`` ``[F']`` /
  ``local_experts.{e}.linear_fc2.bias`` ``[H]``;
- ``"te"``: ``linear_fc1.weight{e}`` / ``linear_fc2.weight{e}`` (``TEGroupedMLP``'s names, which
  the Hugging Face bridges map to), biases ``linear_fc1.bias{e}`` / ``linear_fc2.bias{e}``
  (``TEGroupedLinear``'s), with TE's ``_extra_state`` entries: one per linear in
  ``state_dict``, ``_extra_state`` / ``_extra_state{e}`` (e >= 1) per expert in
  ``sharded_state_dict`` (empty; a TE checkpoint's FP8 metadata is ignored on load).

Both layouts write ``SequentialMLP``'s checkpoint keys, so dist checkpoints move between them.

With a gated linear unit a rank's fc1 rows are ``[gate shard; up shard]``, as in Megatron
(the fc1 bias too). Biases start at zero, as Megatron's linears do. With
``use_cpu_initialization`` every rank draws all global experts' weights from the CPU generator
and keeps its own, so the model is the same whatever the expert-parallel layout; otherwise each
rank draws its own under Megatron's expert-parallel RNG stream.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

from mcore_npu.ops import grouped_linear, swiglu
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer.backends import PARAM_LAYOUTS
from mcore_npu.transformer.extra_state import EmptyExtraState
from mcore_npu.transformer.mlp import is_plain_swiglu
from mcore_npu.transformer.param_layout import EXTRA_STATE


class _Weight(torch.nn.Module):
    """Holds one ``weight`` parameter and, with ``add_bias_linear``, one ``bias`` (the
    ``linear_fc1`` / ``linear_fc2`` of an expert).

    Like Megatron's linear layers it has an (empty) ``_extra_state`` entry, so SequentialMLP's
    state dict loads with ``strict=True``.
    """

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
    """``weight0 .. weight{E-1}`` (``bias0 .. bias{E-1}`` with biases) and one
    ``_extra_state``: the state-dict names of TE's ``GroupedLinear`` (Megatron's
    ``TEGroupedLinear``).

    ``NPUGroupedMLP.sharded_state_dict`` splits the entry per expert as ``TEGroupedLinear`` does
    (``_extra_state``, ``_extra_state1`` .. ``_extra_state{E-1}``); a state dict loaded back from
    such a checkpoint has those keys, which a pre-hook drops (TE merges them into its FP8
    metadata; nothing here runs in FP8). A state dict without any entry loads too.
    """

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
    """fc1's grouped weights (``[F', H]`` per expert: the output dimension is split across
    expert tensor parallelism, the role of TE's ``TEColumnParallelGroupedLinear``). A class of
    its own so that converters that find the split by class name (Megatron-Bridge's
    ``AutoMapping``) can tell fc1 from fc2."""


class NPUGroupedRowLinear(_Grouped):
    """fc2's grouped weights (``[H, F]`` per expert: the input dimension is split, the role of
    ``TERowParallelGroupedLinear``)."""


class NPUGroupedMLP(MegatronModule):
    """The routed experts of one MoE layer as two grouped matmuls (see the module docstring).

    Args:
        num_local_experts: experts on this expert-parallel rank (E).
        config: Megatron ``TransformerConfig`` (reads ``moe_ffn_hidden_size``,
            ``gated_linear_unit``, ``activation_func``, ``add_bias_linear``, init settings).
        submodules: ignored (the slot's MLP submodules; the weights live here).
        pg_collection: Megatron's process groups (``ep``, ``expt_tp``, ``expt_dp``).
        kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"`` for grouped matmul and SwiGLU.
        param_layout: ``"local"`` (SequentialMLP names) or ``"te"`` (TEGroupedMLP names).
    """

    def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, *,
                 kernel: str = "auto", param_layout: str = "local", **_unused):  # fmt: skip
        super().__init__(config=config)
        _check_choices(kernel, param_layout, config)
        self.kernel, self.param_layout = kernel, param_layout
        self.num_local_experts = num_local_experts
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        tp = self.tp_group.size()
        if config.moe_ffn_hidden_size % tp:
            raise ValueError(f"moe_ffn_hidden_size: {config.moe_ffn_hidden_size} is not divisible "
                             f"by the expert tensor-parallel size {tp}; pick a multiple")  # fmt: skip
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

    # ------------------------------------------------------------------ weights

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
        """(fc1 biases, fc2 biases): E zero ``[F']`` / ``[H]`` each, or E Nones without
        ``add_bias_linear``, with the attributes Megatron's column / row-parallel linears give
        their biases (fc1's TP-sharded along its rows, fc2's replicated)."""
        c = self.config
        if not c.add_bias_linear:
            return [None] * self.num_local_experts, [None] * self.num_local_experts
        glu = 2 if c.gated_linear_unit else 1
        device = torch.device("cpu") if c.use_cpu_initialization else _current_device()
        made = []
        for size in (glu * self.ffn_per_rank, c.hidden_size):
            params = [torch.nn.Parameter(torch.zeros(size, dtype=c.params_dtype, device=device))
                      for _ in range(self.num_local_experts)]  # fmt: skip
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
        for (rows, cols), init, tp_dim in zip(shapes, (c.init_method, c.output_layer_init_method),
                                              (0, 1)):  # fmt: skip
            local = [torch.empty(rows, cols, dtype=c.params_dtype, device=device)
                     for _ in range(self.num_local_experts)]  # fmt: skip
            if c.perform_initialization:
                self._initialize(local, init, tp_dim, glu if tp_dim == 0 else 1)
            params = [torch.nn.Parameter(w) for w in local]
            for p in params:
                _tag(p, tp_dim)
            made.append(params)
        return made

    def _initialize(self, local, init_method, tp_dim, glu):
        """Fill ``local`` in place (see the module docstring for the two schemes)."""
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

    # ------------------------------------------------------------------ forward

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """Experts on the dispatched tokens.

        Args:
            permuted_local_hidden_states: ``[T, H]``, rows sorted by local expert.
            tokens_per_expert: ``[E]`` rows per local expert (tensor or list; zeros allowed).
            permuted_probs: ``[T]`` routing probability of each row.

        Returns:
            ``(output [T, H], None)`` (no separate bias, as the MoE layer requires).
        """
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            x = (probs.unsqueeze(-1) * x).to(x.dtype)  # probs applied once, before fc1
            probs = torch.ones_like(probs)
        h = grouped_linear(x, self.fc1_weights(), tokens_per_expert, biases=self.fc1_biases(),
                           kernel=self.kernel)  # fmt: skip
        h = self._activation(h)  # [T, F]
        h = (h * probs.unsqueeze(-1)).to(h.dtype)
        out = grouped_linear(h, self.fc2_weights(), tokens_per_expert, kernel=self.kernel)
        if (biases := self.fc2_biases()) is not None:
            out = _add_weighted_bias(out, biases, tokens_per_expert, probs)
        return out, None

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

    # ------------------------------------------------------------------ checkpoints

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The checkpoint keys and shards of ``SequentialMLP`` for the same experts, in both
        layouts, so checkpoints move between the two modules and the two layouts.

        ``{prefix}experts.linear_fc1.weight`` (``.bias``) with the global expert index as a
        sharded axis (Megatron's default), or ``{prefix}experts.{g}.linear_fc1.weight`` when
        ``metadata`` asks for ``singleton_local_shards``; expert-TP shards add the TP axis
        (refused with a gated linear unit): fc1's weight and bias along rows, fc2's weight along
        columns; fc2's bias is replicated over expert TP, as ``RowParallelLinear``'s.
        """
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        if tp > 1 and self.config.gated_linear_unit:
            raise NotImplementedError("NPUGroupedMLP.sharded_state_dict: expert tensor "
                                      "parallelism with a gated linear unit; use "
                                      "expert_tensor_parallel_size=1")  # fmt: skip
        singleton = bool((metadata or {}).get("singleton_local_shards", False))
        first = self.ep_group.rank() * self.num_local_experts
        total = self.ep_group.size() * self.num_local_experts
        dp_rank = self.dp_group.rank()

        def where(e: int, which: str):
            """(sharded key prefix, sharded offsets) of local expert ``e``'s linear."""
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
            axes = [] if tp == 1 or replicated else [(axis, tp_rank, tp)]
            result[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{key}.{leaf}", param, *offsets,
                *[(len(offsets) + a, r, n) for a, r, n in axes],
                replica_id=(0, tp_rank if replicated else 0, dp_rank),
                prepend_axis_num=len(offsets),
            )  # fmt: skip
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
    """The ``sharded_state_dict`` name of local expert ``e``'s extra state for ``which`` linear.

    ``"local"``: ``local_experts.{e}.linear_fc1._extra_state`` (``SequentialMLP``). ``"te"``:
    ``linear_fc1._extra_state`` for expert 0 and ``linear_fc1._extra_state{e}`` for the others,
    as megatron-core 0.16.1's ``TEGroupedLinear._sharded_state_dict_grouped`` names them
    (``megatron/core/extensions/transformer_engine.py``, ``f"{prefix}_extra_state{'' if
    gemm_idx == 0 else gemm_idx}"``). Either way the object's key on disk is
    ``experts.experts.{which}._extra_state`` with the global expert index as a sharded axis.
    """
    if layout == "local":
        return f"local_experts.{e}.{which}.{EXTRA_STATE}"
    return f"{which}.{EXTRA_STATE}{e or ''}"


def _expert_of(name: str, layout: str) -> tuple[int, str, str]:
    """``local_experts.3.linear_fc1.weight`` / ``linear_fc1.weight3`` -> ``(3, "linear_fc1",
    "weight")``; ``...linear_fc2.bias`` / ``linear_fc2.bias3`` -> ``(3, "linear_fc2", "bias")``."""
    parts = name.split(".")
    if layout == "local":
        return int(parts[1]), parts[2], parts[3]
    leaf = "bias" if parts[1].startswith("bias") else "weight"
    return int(parts[1].removeprefix(leaf)), parts[0], leaf


def _add_weighted_bias(out, biases, tokens_per_expert, probs) -> torch.Tensor:
    """``out [T, H] + b2_e * probs`` for every row of expert e (Megatron's expert fc2 bias).

    The row -> expert map comes from ``repeat_interleave`` with ``output_size`` (no host sync).
    """
    counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64).to(out.device)
    experts = torch.arange(len(biases), device=out.device)
    rows = torch.repeat_interleave(experts, counts, output_size=out.shape[0])  # [T]
    per_row = torch.stack(list(biases))[rows]  # [T, H]
    return (out + per_row * probs.unsqueeze(-1)).to(out.dtype)


def _tag(param: torch.nn.Parameter, tp_dim: int) -> None:
    """Megatron's expert-parameter attributes: TP-sharded along ``tp_dim``, reduced over the
    expert-data-parallel group (``allreduce = False``)."""
    param.tensor_model_parallel = True
    param.partition_dim = tp_dim
    param.partition_stride = 1
    param.allreduce = False


def _current_device() -> torch.device:
    from mcore_npu.allocator import device

    return device.current_device()


def _check_choices(kernel, param_layout, config) -> None:
    check_kernel(kernel)
    if param_layout not in PARAM_LAYOUTS:
        raise ValueError(f"param_layout: unknown layout {param_layout!r}; pass one of "
                         f"{', '.join(PARAM_LAYOUTS)}")  # fmt: skip
    if config.fp8 or config.fp4:
        raise ValueError("fp8/fp4: NPUGroupedMLP runs the floating-point grouped matmul; turn "
                         "fp8/fp4 off")  # fmt: skip
