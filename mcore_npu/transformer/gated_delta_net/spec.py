"""The hybrid Gated DeltaNet block: which layers are GDN, and their ``self_attention`` spec.

Megatron's reading of the pattern (``experimental_attention_variant_module_specs.py``,
``get_linear_attention_pattern``): ``linear_attention_freq`` an int N -> layer i (from 0) is
full attention when ``(i + 1) % N == 0``, GDN otherwise; a list -> used as it is (1 = GDN, 0 =
full attention), one entry per layer. Pipeline stages take their layers by global layer id
(``pipeline_model_parallel_layout``, or Megatron's offset and count per stage), so the pattern
is read at each layer's global position.

A GDN layer is the NPU spec's layer for that position with ``self_attention`` replaced: in the
TE layout the input norm sits in ``in_proj`` (``NormColumnParallelLinear``,
``in_proj.layer_norm_weight``) and ``input_layernorm`` stays ``IdentityOp``; in the local layout
``input_layernorm`` stays a norm and ``in_proj`` is a ``ColumnParallelLinear`` (its
distributed-checkpoint key maps to ``self_attention.in_proj.layer_norm_weight``, as the local
spec maps attention's). The MLP / MoE part of the layer is untouched.
"""

from __future__ import annotations

import copy

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_npu.transformer.gated_delta_net.config import GDN
from mcore_npu.transformer.gated_delta_net.layer import (
    NPUGatedDeltaNet,
    NPUGatedDeltaNetSubmodules,
)
from mcore_npu.transformer.gated_delta_net.out_norm import GatedRMSNorm, TEGatedRMSNorm


def is_gdn(config) -> bool:
    """Whether ``config`` asks for Gated DeltaNet layers."""
    return getattr(config, "experimental_attention_variant", None) == GDN


def linear_attention_pattern(config) -> list[int]:
    """One entry per layer of the model: 1 = GDN, 0 = full attention (Megatron's reading).

    Raises:
        ValueError: ``linear_attention_freq`` is not a positive int or a 0/1 list of
            ``num_layers`` entries.
    """
    freq, layers = config.linear_attention_freq, config.num_layers
    if isinstance(freq, bool) or not isinstance(freq, int | list):
        raise ValueError(
            f"linear_attention_freq: {freq!r}; pass an int N (every N-th layer is full "
            "attention) or a list of num_layers 0/1 entries (1 = GDN)"
        )
    if isinstance(freq, int):
        if freq <= 0:
            raise ValueError(f"linear_attention_freq: {freq}; pass a positive int")
        return [0 if (i + 1) % freq == 0 else 1 for i in range(layers)]
    if len(freq) != layers or any(x not in (0, 1) for x in freq):
        raise ValueError(
            f"linear_attention_freq: {freq}; a list needs num_layers = {layers} entries, each "
            "0 (full attention) or 1 (GDN)"
        )
    return [int(x) for x in freq]


def local_layer_ids(config, vp_stage=None, pp_rank=None) -> list[int]:
    """Global ids (from 0) of the decoder layers this pipeline stage builds, as Megatron's
    block builders slice them."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage,
                                             pp_rank=pp_rank))  # fmt: skip
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage, pp_rank)))


def gdn_attention_spec(provider, *, naive_l2norm: bool = False) -> ModuleSpec:
    """``NPUGatedDeltaNet`` with the provider's layout (``provider.te_layout``); its rule runs
    the reference when the provider's kernel is ``"reference"``, else ``"auto"`` (on an NPU the
    trainable Ascend kernels, and torch_npu's forward-only one for calls without gradients)."""
    te = provider.te_layout
    in_proj = provider.column_parallel_layer_norm_linear() if te else ColumnParallelLinear
    # the rule's torch_npu kernel is forward-only: "auto" picks the trainable ones on an NPU
    kernel = "reference" if provider.kernel == "reference" else "auto"
    return ModuleSpec(
        module=NPUGatedDeltaNet,
        params={"naive_l2norm": naive_l2norm, "kernel": kernel},
        submodules=NPUGatedDeltaNetSubmodules(
            in_proj=in_proj,
            out_norm=TEGatedRMSNorm if te else GatedRMSNorm,
            out_proj=RowParallelLinear,
        ),
        metainfo={"fuse_input_layernorm": te},
    )


def dense_block_config(config):
    """The config Megatron's dense block builder is given: ``config`` itself, or for a GDN hybrid a
    shallow copy with ``experimental_attention_variant=None`` (megatron-core 0.19's
    ``get_gpt_decoder_layer_specs`` asserts it is None; the GDN positions are swapped in
    afterwards by :func:`hybrid_layer_specs`). The user's config is not written to."""
    if not is_gdn(config):
        return config
    view = copy.copy(config)
    view.experimental_attention_variant = None
    return view


def hybrid_layer_specs(layer_specs, config, provider, *, vp_stage=None, pp_rank=None,
                       naive_l2norm: bool = False) -> list:  # fmt: skip
    """This stage's layer specs with the GDN positions' attention swapped for GDN.

    Args:
        layer_specs: this stage's NPU layer specs, in order (one per local layer).
        config: the model's ``TransformerConfig`` (``linear_attention_freq``, stages).
        provider: the block's ``NPUSpecProvider`` (its layout).
        vp_stage, pp_rank: this stage, as given to the block builder.
        naive_l2norm: see ``NPUGatedDeltaNet``.
    """
    if getattr(config, "multi_latent_attention", False):
        raise ValueError(
            "multi_latent_attention: True with experimental_attention_variant='gated_delta_net'"
            " is not built (Qwen3.5 / Qwen3-Next use GQA full attention); set it to False"
        )
    pattern = linear_attention_pattern(config)
    ids = local_layer_ids(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if len(ids) != len(layer_specs):  # pragma: no cover - Megatron's builders slice alike
        raise ValueError(f"pipeline stage: {len(layer_specs)} layer specs for layers {ids}")
    attention = gdn_attention_spec(provider, naive_l2norm=naive_l2norm)
    made: dict[int, ModuleSpec] = {}
    return [
        made.setdefault(id(spec), _gdn_layer(spec, attention)) if pattern[i] else spec
        for spec, i in zip(layer_specs, ids, strict=True)
    ]


def _gdn_layer(layer: ModuleSpec, attention: ModuleSpec) -> ModuleSpec:
    """A copy of ``layer`` whose ``self_attention`` is ``attention`` (shared, not copied)."""
    new = copy.copy(layer)
    new.submodules = copy.copy(layer.submodules)
    new.submodules.self_attention = attention
    keys = dict(getattr(layer.submodules, "sharded_state_dict_keys_map", None) or {})
    if "input_layernorm." in keys:
        keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    new.submodules.sharded_state_dict_keys_map = keys
    return new
