"""Transformer-layer specs for Megatron-Core whose core attention is ``NPUFusionAttention``.

Built from Megatron's own local spec, called with keywords only (its parameters drift between
releases), then two kinds of submodule are swapped:

- ``self_attention.submodules.core_attention`` -> ``NPUFusionAttention`` (with ``kernel`` and a
  cu_seqlens memo shared by every layer of the spec);
- the torch norms (input, pre-MLP, q/k, and the block's final norm) -> ``SequenceParallelNorm``,
  the same ``torch.nn`` norms but usable under sequence parallelism.

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
from mcore_npu.transformer.norms import SequenceParallelNorm


def get_gpt_layer_npu_spec(*, kernel: str = "auto", **local_spec_kwargs) -> ModuleSpec:
    """Megatron's local GPT layer spec with ``NPUFusionAttention`` as core attention.

    Args:
        kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"`` (see ``mcore_npu.ops``).
        **local_spec_kwargs: the keywords of the installed ``get_gpt_layer_local_spec``
            (``num_experts``, ``moe_grouped_gemm``, ``qk_layernorm``, ``normalization``, ...).

    Returns:
        A ``ModuleSpec`` for ``TransformerLayer``, to pass as ``transformer_layer_spec``. With
        ``sequence_parallel=True`` pass ``get_gpt_decoder_block_npu_spec(config)`` instead, so
        that the block's final norm supports it too.
    """
    _check_kernel(kernel)
    _check_keywords(local_spec_kwargs, megatron_specs.get_gpt_layer_local_spec)
    spec = copy.deepcopy(megatron_specs.get_gpt_layer_local_spec(**local_spec_kwargs))
    return _swap_npu_parts(spec, kernel, SeqLengthsMemo())


def get_gpt_decoder_block_npu_spec(config, *, kernel: str = "auto", **block_spec_kwargs):
    """Megatron's GPT decoder-block spec (dense and MoE layers as ``config`` says), NPU parts in.

    Mirrors ``get_gpt_decoder_block_spec(config, use_transformer_engine=False, ...)``: the same
    layer pattern (``moe_layer_freq``), pipeline-stage slicing and final norm, with every layer's
    core attention and every torch norm swapped as in ``get_gpt_layer_npu_spec``.

    Args:
        config: Megatron ``TransformerConfig``.
        kernel: as for ``get_gpt_layer_npu_spec``.
        **block_spec_kwargs: the installed ``get_gpt_decoder_block_spec`` keywords besides
            ``use_transformer_engine`` (``normalization``, ``qk_l2_norm``, ``vp_stage``,
            ``pp_rank``, ...).

    Returns:
        ``TransformerBlockSubmodules`` to pass as ``transformer_layer_spec``.
    """
    _check_kernel(kernel)
    build = megatron_specs.get_gpt_decoder_block_spec
    _check_keywords(block_spec_kwargs, build, exclude=("config", "use_transformer_engine"))
    block = copy.deepcopy(build(config, use_transformer_engine=False, **block_spec_kwargs))
    memo = SeqLengthsMemo()  # one per model: every layer shares the cu_seqlens conversion
    swapped: dict[int, ModuleSpec] = {}
    block.layer_specs = [
        swapped.setdefault(id(spec), _swap_npu_parts(spec, kernel, memo))
        for spec in block.layer_specs
    ]
    block.layer_norm = SequenceParallelNorm
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


def _swap_npu_parts(layer: ModuleSpec, kernel: str, memo: SeqLengthsMemo) -> ModuleSpec:
    """Swap core attention and torch norms inside one (already copied) layer spec."""
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
            setattr(owner, name, SequenceParallelNorm)
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
