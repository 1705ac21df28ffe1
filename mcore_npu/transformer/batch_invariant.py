"""Batch-invariant mode's matmuls: the spec's linears, the router's gating, the experts.

Every matmul of a layer built in the mode goes through ``mcore_npu.ops.batch_invariant_linear``
(the AscendC library on an NPU, a fixed-row-block reference elsewhere): the column / row-parallel
linears (``BatchInvariant*`` subclasses of Megatron's, the same parameters, names and
communication; only ``_forward_impl``'s matmul differs), the router's gating and the grouped
experts (one call per expert). :func:`route_linears` swaps them into a layer spec and refuses
what it cannot route; :func:`make_batch_invariant` turns a built output layer into one. The
log-probs: :mod:`mcore_npu.transformer.vocab_parallel`. See docs/true_on_policy.md.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_npu.ops.batch_invariant_rows import OP_LINEAR, batch_invariant_linear
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer.norm_linear import NormColumnParallelLinear
from mcore_npu.transformer.router import ROUTER_DTYPES, NPUTopKRouter

__all__ = [
    "BatchInvariantColumnParallelLinear",
    "BatchInvariantNormColumnParallelLinear",
    "BatchInvariantRowParallelLinear",
    "BatchInvariantTopKRouter",
    "KERNEL",
    "make_batch_invariant",
    "route_linears",
]

KERNEL = {"auto": "auto", "torch_npu": "batch_invariant_ops", "reference": "reference"}
"""The spec's ``kernel`` -> the mode's matmuls': asked for by name stays asked for by name."""


class _BatchInvariantMatmul:
    """``_forward_impl`` of Megatron's parallel linears with the matmul through
    ``batch_invariant_linear``; the input's communication as Megatron's: gathered from the
    sequence-parallel region (its gradient reduce-scattered), or its gradient all-reduced."""

    def __init__(self, *args, batch_invariant_kernel: str = "auto", **kwargs):
        check_kernel(batch_invariant_kernel, op=OP_LINEAR, what="batch_invariant_kernel")
        _check_config(kwargs["config"])
        super().__init__(*args, **kwargs)
        self.batch_invariant_kernel = batch_invariant_kernel

    def _forward_impl(
        self, input, weight, bias=None, *, sequence_parallel=False, allreduce_dgrad=False,
        tp_group=None, **_megatron,
    ):  # fmt: skip
        """Megatron's ``_forward_impl`` keywords; ``gradient_accumulation_fusion`` needs nothing
        here (the weight gradient is a plain ``.grad``, which Megatron's DDP adds to
        ``main_grad``), deferred embedding gradients are refused when the layer is built."""
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return batch_invariant_linear(input, weight, bias, kernel=self.batch_invariant_kernel)


class BatchInvariantColumnParallelLinear(_BatchInvariantMatmul, ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear``, its matmul batch-invariant."""


class BatchInvariantRowParallelLinear(_BatchInvariantMatmul, RowParallelLinear):
    """Megatron's ``RowParallelLinear``, its matmul batch-invariant."""


class BatchInvariantNormColumnParallelLinear(_BatchInvariantMatmul, NormColumnParallelLinear):
    """The te layout's ``NormColumnParallelLinear``, its matmul batch-invariant."""


class BatchInvariantTopKRouter(NPUTopKRouter):
    """``NPUTopKRouter`` whose gating ``[*, H] -> [*, E]`` (in the router dtype) is
    batch-invariant."""

    def __init__(self, *args, batch_invariant_kernel: str = "auto", **kwargs):
        check_kernel(batch_invariant_kernel, op=OP_LINEAR, what="batch_invariant_kernel")
        super().__init__(*args, **kwargs)
        self.batch_invariant_kernel = batch_invariant_kernel

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return batch_invariant_linear(
            input.to(dtype), self.weight.to(dtype), bias, kernel=self.batch_invariant_kernel
        )


def _check_config(config) -> None:
    """What a batch-invariant linear cannot do for a config, refused in one line."""
    for field, why in (
        ("defer_embedding_wgrad_compute", "its weight gradient is computed in backward"),
        ("moe_shared_expert_gate", "Megatron's SharedExpertMLP gates with a plain F.linear"),
    ):
        if getattr(config, field, False):
            raise ValueError(
                f"batch-invariant mode does not support {field}=True ({why}): set it False, "
                "or turn the mode off"
            )


_SWAPS = {
    ColumnParallelLinear: BatchInvariantColumnParallelLinear,
    RowParallelLinear: BatchInvariantRowParallelLinear,
    NormColumnParallelLinear: BatchInvariantNormColumnParallelLinear,
    NPUTopKRouter: BatchInvariantTopKRouter,
}


def route_linears(spec, kernel: str):
    """``spec`` (a layer's ``ModuleSpec`` tree, copied) with every linear, the router and the
    grouped experts batch-invariant, their matmuls through ``kernel`` (the mode's:
    :data:`KERNEL`'s values); modules marked ``takes_batch_invariant_kernel`` (the grouped
    experts, 0.15's router-owning MoE layer) get it as a parameter."""
    if spec is NPUTopKRouter:  # MoELayer calls its router slot: a callable, not a spec
        return functools.partial(BatchInvariantTopKRouter, batch_invariant_kernel=kernel)
    if isinstance(spec, type) and spec in _SWAPS:
        return ModuleSpec(module=_SWAPS[spec], params={"batch_invariant_kernel": kernel})
    if isinstance(spec, type):
        _refuse_unrouted(spec)
    if isinstance(spec, (list, tuple)):  # a block's layer_specs
        return type(spec)(route_linears(item, kernel) for item in spec)
    if _module_spec(spec):  # Megatron's ModuleSpec, the plugin's BoundModuleSpec
        module, params = spec.module, dict(spec.params)
        if isinstance(module, type):
            _refuse_unrouted(module)
        if module in _SWAPS or getattr(module, "takes_batch_invariant_kernel", False):
            module, params["batch_invariant_kernel"] = _SWAPS.get(module, module), kernel
        submodules = route_linears(spec.submodules, kernel)
        return dataclasses.replace(spec, module=module, params=params, submodules=submodules)
    if isinstance(spec, functools.partial):  # 0.17+ builder forms: partial(cls, submodules=...)
        keywords = {k: route_linears(v, kernel) for k, v in spec.keywords.items()}
        return functools.partial(route_linears(spec.func, kernel), *spec.args, **keywords)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = {f.name: route_linears(getattr(spec, f.name), kernel)
                  for f in dataclasses.fields(spec) if f.init}  # fmt: skip
        return dataclasses.replace(spec, **fields)
    return spec


def _refuse_unrouted(module: type) -> None:
    """ValueError for a module whose matmuls the mode cannot route: Megatron's legacy grouped
    experts, a parallel linear of a class :data:`_SWAPS` does not know."""
    from megatron.core.transformer.moe import experts

    legacy = getattr(experts, "GroupedMLP", None)  # gone in megatron-core 0.19
    if legacy is not None and issubclass(module, legacy):
        raise ValueError(
            "batch-invariant mode does not support Megatron's GroupedMLP (param_layout='local' "
            "with moe_grouped_gemm=True): use param_layout='te', or moe_grouped_gemm=False"
        )
    linear = issubclass(module, (ColumnParallelLinear, RowParallelLinear))
    if linear and module not in _SWAPS and not issubclass(module, _BatchInvariantMatmul):
        raise ValueError(
            f"batch-invariant mode cannot route the matmul of {module.__name__} (a parallel "
            "linear it does not know): build the layer from the NPU spec's linears, or turn "
            "the mode off"
        )


def _module_spec(spec) -> bool:
    """A dataclass of ``module``, ``params`` and ``submodules`` (a spec ``build_module`` builds)."""
    names = {f.name for f in dataclasses.fields(spec)} if dataclasses.is_dataclass(spec) else ()
    return not isinstance(spec, type) and {"module", "params", "submodules"} <= set(names)


def make_batch_invariant(linear: ColumnParallelLinear, kernel: str) -> None:
    """Make one built ``ColumnParallelLinear`` (GPTModel's output layer, built outside the spec)
    a :class:`BatchInvariantColumnParallelLinear` in place, by setting that object's class: the
    subclass adds no state, so its parameters, names and state dict stay; only its matmul
    changes. Megatron's classes and modules are not touched."""
    if type(linear) is not ColumnParallelLinear:
        raise TypeError(
            f"linear: expected Megatron's ColumnParallelLinear, got {type(linear).__name__}; "
            "call it once per model, on GPTModel's output_layer"
        )
    check_kernel(kernel, op=OP_LINEAR, what="kernel")
    linear.__class__ = BatchInvariantColumnParallelLinear
    linear.batch_invariant_kernel = kernel
