"""Transformer-layer specs for Megatron-Core whose core attention is ``NPUFusionAttention``.

Built from Megatron's own local spec, called with keywords only (its parameters drift between
releases), then two kinds of submodule are swapped:

- ``self_attention.submodules.core_attention`` -> ``NPUFusionAttention`` (with ``kernel`` and a
  cu_seqlens memo shared by every layer of the spec);
- the torch norms (input, pre-MLP, q/k, and the block's final norm) -> ``SequenceParallelNorm``,
  usable under sequence parallelism, whose RMSNorm is ``npu_rms_norm`` (``NPURMSNorm``);
- the dense ``MLP`` -> ``NPUMLP`` (SwiGLU through ``npu_swiglu``);
- in MoE layers, the router -> ``NPUTopKRouter`` (no Transformer Engine needed) and the experts
  -> ``NPUGroupedMLP`` (one ``npu_grouped_matmul`` per projection).

The fused operators follow ``kernel`` unless ``rms_norm_kernel`` / ``swiglu_kernel`` /
``grouped_matmul_kernel`` say otherwise; ``"off"`` keeps Megatron's module for that part
(``torch.nn.RMSNorm``, ``MLP``, ``SequentialMLP``). The router is always swapped.

Parameter names stay those of the local spec, so checkpoints move between local-spec (GPU) and
NPU-spec models without conversion. Nothing is patched; Megatron's objects are deep-copied before
anything is changed.

Usage::

    from megatron.core.models.gpt import GPTModel
    from mcore_npu import get_gpt_layer_npu_spec

    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_npu_spec(qk_layernorm=True),
                     vocab_size=32000, max_sequence_length=4096)
"""

from __future__ import annotations

import copy
import inspect

from megatron.core.models.gpt import gpt_layer_specs as megatron_specs
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_npu.masks import SeqLengthsMemo
from mcore_npu.ops import KERNELS
from mcore_npu.transformer.attention import NPUFusionAttention
from mcore_npu.transformer.backends import resolve_backend
from mcore_npu.transformer.experts import PARAM_LAYOUTS, NPUGroupedMLP
from mcore_npu.transformer.mlp import NPUMLP, NPUSharedExpertMLP
from mcore_npu.transformer.norms import SequenceParallelNorm
from mcore_npu.transformer.router import NPUTopKRouter

FUSED_KERNELS = (*KERNELS, "off")
"""Values of ``rms_norm_kernel`` / ``swiglu_kernel`` / ``grouped_matmul_kernel``; None = ``kernel``."""


def get_gpt_layer_npu_spec(
    *,
    kernel: str = "auto",
    rms_norm_kernel: str | None = None,
    swiglu_kernel: str | None = None,
    grouped_matmul_kernel: str | None = None,
    param_layout: str = "local",
    **local_spec_kwargs,
) -> ModuleSpec:
    """Megatron's local GPT layer spec with ``NPUFusionAttention`` as core attention.

    Args:
        kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"`` (see ``mcore_npu.ops``).
        rms_norm_kernel, swiglu_kernel, grouped_matmul_kernel: a kernel for that fused
            operator, ``"off"`` for Megatron's own module, None (default) = ``kernel``.
        param_layout: the experts' parameter names, ``"local"`` (SequentialMLP's) or ``"te"``
            (TEGroupedMLP's ``linear_fc1.weight{e}``).
        **local_spec_kwargs: the keywords of the installed ``get_gpt_layer_local_spec``
            (``num_experts``, ``moe_grouped_gemm``, ``qk_layernorm``, ``normalization``, ...).

    Returns:
        A ``ModuleSpec`` for ``TransformerLayer``, to pass as ``transformer_layer_spec``. With
        ``sequence_parallel=True`` pass ``get_gpt_decoder_block_npu_spec(config)`` instead, so
        that the block's final norm supports it too.
    """
    fused = _fused_kernels(kernel, rms_norm_kernel, swiglu_kernel, grouped_matmul_kernel,
                           param_layout)  # fmt: skip
    _check_keywords(local_spec_kwargs, megatron_specs.get_gpt_layer_local_spec)
    spec = copy.deepcopy(megatron_specs.get_gpt_layer_local_spec(**local_spec_kwargs))
    return _swap_npu_parts(spec, kernel, SeqLengthsMemo(), fused)


def get_gpt_decoder_block_npu_spec(
    config,
    *,
    kernel: str = "auto",
    rms_norm_kernel: str | None = None,
    swiglu_kernel: str | None = None,
    grouped_matmul_kernel: str | None = None,
    param_layout: str = "local",
    **block_spec_kwargs,
):
    """Megatron's GPT decoder-block spec (dense and MoE layers as ``config`` says), NPU parts in.

    Mirrors ``get_gpt_decoder_block_spec(config, use_transformer_engine=False, ...)``: the same
    layer pattern (``moe_layer_freq``), pipeline-stage slicing and final norm, with every layer's
    core attention and every torch norm swapped as in ``get_gpt_layer_npu_spec``.

    Args:
        config: Megatron ``TransformerConfig``.
        kernel, rms_norm_kernel, swiglu_kernel, grouped_matmul_kernel, param_layout: as for
            ``get_gpt_layer_npu_spec``.
        **block_spec_kwargs: the installed ``get_gpt_decoder_block_spec`` keywords besides
            ``use_transformer_engine`` (``normalization``, ``qk_l2_norm``, ``vp_stage``,
            ``pp_rank``, ...).

    Returns:
        ``TransformerBlockSubmodules`` to pass as ``transformer_layer_spec``.
    """
    fused = _fused_kernels(kernel, rms_norm_kernel, swiglu_kernel, grouped_matmul_kernel,
                           param_layout)  # fmt: skip
    build = megatron_specs.get_gpt_decoder_block_spec
    _check_keywords(block_spec_kwargs, build, exclude=("config", "use_transformer_engine"))
    block = copy.deepcopy(build(config, use_transformer_engine=False, **block_spec_kwargs))
    memo = SeqLengthsMemo()  # one per model: every layer shares the cu_seqlens conversion
    swapped: dict[int, ModuleSpec] = {}
    block.layer_specs = [
        swapped.setdefault(id(spec), _swap_npu_parts(spec, kernel, memo, fused))
        for spec in block.layer_specs
    ]
    block.layer_norm = _norm_spec(fused["rms_norm"])
    return block


def get_gpt_layer_spec(backend: str = "auto", **kwargs) -> ModuleSpec:
    """One place that picks a GPT layer spec.

    Args:
        backend: ``"npu_fusion"`` (this package), ``"local"`` (Megatron's local spec), ``"te"``
            (Transformer Engine), or ``"auto"``: npu_fusion when an NPU is present, else te when
            transformer-engine imports, else local.
        **kwargs: spec keywords; ``kernel`` only with npu_fusion.
    """
    backend = resolve_backend(backend)
    if backend == "npu_fusion":
        return get_gpt_layer_npu_spec(**kwargs)
    if "kernel" in kwargs:
        raise TypeError(f"kernel: only the npu_fusion backend takes a kernel (backend={backend!r})")
    if backend == "te":
        build = megatron_specs.get_gpt_layer_with_transformer_engine_spec
    else:
        build = megatron_specs.get_gpt_layer_local_spec
    _check_keywords(kwargs, build)
    return build(**kwargs)


def _fused_kernels(kernel, rms_norm, swiglu, grouped_matmul, param_layout) -> dict:
    """Each fused operator's kernel (None = ``kernel``; ``"off"`` = Megatron's module)."""
    _check_kernel(kernel)
    chosen = {}
    for name, value in (("rms_norm", rms_norm), ("swiglu", swiglu),
                        ("grouped_matmul", grouped_matmul)):  # fmt: skip
        value = kernel if value is None else value
        if value not in FUSED_KERNELS:
            raise ValueError(f"{name}_kernel: unknown value {value!r}; pass one of "
                             f"{', '.join(FUSED_KERNELS)} or None (= kernel)")  # fmt: skip
        chosen[name] = value
    if param_layout not in PARAM_LAYOUTS:
        raise ValueError(f"param_layout: unknown layout {param_layout!r}; pass one of "
                         f"{', '.join(PARAM_LAYOUTS)}")  # fmt: skip
    chosen["param_layout"] = param_layout
    return chosen


def _norm_spec(rms_norm_kernel: str) -> ModuleSpec:
    kernel = None if rms_norm_kernel == "off" else rms_norm_kernel
    return ModuleSpec(module=SequenceParallelNorm, params={"kernel": kernel})


def _swap_mlp(subs, fused: dict) -> None:
    """Dense MLP -> NPUMLP; MoE router -> NPUTopKRouter, SequentialMLP -> NPUGroupedMLP,
    SharedExpertMLP -> NPUSharedExpertMLP."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    mlp = subs.mlp
    if not isinstance(mlp, ModuleSpec):
        return
    if mlp.module is MLP and fused["swiglu"] != "off":
        subs.mlp = ModuleSpec(module=NPUMLP, params={**mlp.params, "kernel": fused["swiglu"]},
                              submodules=mlp.submodules)  # fmt: skip
        return
    moe = mlp.submodules
    if not hasattr(moe, "experts"):
        return
    if hasattr(moe, "router"):  # megatron-core >= 0.16 has the slot
        moe.router = NPUTopKRouter
    shared = moe.shared_experts
    plain_shared = isinstance(shared, ModuleSpec) and shared.module is SharedExpertMLP
    if plain_shared and fused["swiglu"] != "off":
        params = {**shared.params, "kernel": fused["swiglu"]}
        moe.shared_experts = ModuleSpec(module=NPUSharedExpertMLP, params=params,
                                        submodules=shared.submodules)  # fmt: skip
    experts = moe.experts
    grouped = isinstance(experts, ModuleSpec) and experts.module is SequentialMLP
    if grouped and fused["grouped_matmul"] != "off":
        params = {"kernel": fused["grouped_matmul"], "param_layout": fused["param_layout"]}
        moe.experts = ModuleSpec(module=NPUGroupedMLP, params=params,
                                 submodules=experts.submodules)  # fmt: skip


def _swap_npu_parts(
    layer: ModuleSpec, kernel: str, memo: SeqLengthsMemo, fused: dict | None = None
) -> ModuleSpec:
    """Swap core attention, norms, MLP / MoE parts inside one (already copied) layer spec."""
    fused = fused or _fused_kernels(kernel, None, None, None, "local")
    subs = layer.submodules
    attention = subs.self_attention.submodules
    attention.core_attention = ModuleSpec(
        module=NPUFusionAttention, params={"kernel": kernel, "seq_lengths_memo": memo}
    )
    for owner, name in (
        (subs, "input_layernorm"),
        (subs, "pre_mlp_layernorm"),
        (attention, "q_layernorm"),
        (attention, "k_layernorm"),
        (attention, "kv_layernorm"),
    ):
        if _is_torch_norm(getattr(owner, name, None)):
            setattr(owner, name, _norm_spec(fused["rms_norm"]))
    _swap_mlp(subs, fused)
    return layer


def _is_torch_norm(module) -> bool:
    """Megatron's local norm: ``WrappedTorchNorm`` (possibly wrapped in a ModuleSpec)."""
    target = module.module if isinstance(module, ModuleSpec) else module
    return getattr(target, "__name__", "") == "WrappedTorchNorm"


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel: unknown kernel {kernel!r}; pass one of {', '.join(KERNELS)}")


def _check_keywords(kwargs: dict, function, exclude: tuple[str, ...] = ()) -> None:
    """Refuse keywords the installed Megatron function does not take, listing those it does."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return  # Megatron >= 0.17 forwards **kwargs; it checks them itself
    accepted = [name for name in parameters if name not in exclude]
    unknown = [name for name in kwargs if name not in accepted]
    if unknown:
        raise TypeError(
            f"{unknown[0]}: not a keyword of the installed megatron-core's "
            f"{function.__name__}; it takes {', '.join(accepted)}"
        )
