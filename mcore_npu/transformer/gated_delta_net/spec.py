"""The hybrid Gated DeltaNet block: which layers are GDN, and their ``self_attention`` spec.

``linear_attention_freq`` is read as Megatron does (``get_linear_attention_pattern``) at each
layer's global position. A GDN layer is the NPU spec's layer with ``self_attention`` replaced: te
layout: the input norm in ``in_proj`` (``in_proj.layer_norm_weight``), ``input_layernorm`` stays
``IdentityOp``; local layout: ``input_layernorm`` stays a norm, its checkpoint key mapped to
``self_attention.in_proj.layer_norm_weight``. The MLP / MoE part is untouched."""

from __future__ import annotations

import copy

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_npu.transformer.gated_delta_net.config import GDN
from mcore_npu.transformer.gated_delta_net.layer import NPUGatedDeltaNet, NPUGatedDeltaNetSubmodules
from mcore_npu.transformer.gated_delta_net.out_norm import GatedRMSNorm, TEGatedRMSNorm


def is_gdn(config) -> bool:
    """Whether ``config`` asks for Gated DeltaNet layers."""
    return getattr(config, "experimental_attention_variant", None) == GDN


def linear_attention_pattern(config) -> list[int]:
    """One entry per layer: 1 = GDN, 0 = full attention. An int N makes layer i (from 0) full
    attention when ``(i + 1) % N == 0``; a 0/1 list of ``num_layers`` entries is used as it is.

    Raises:
        ValueError: ``linear_attention_freq`` is neither.
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
    """Global ids (from 0) of the decoder layers this pipeline stage builds, as Megatron slices
    them."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return list(
            layout.get_layer_id_list(
                layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
            )
        )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage, pp_rank)))


def gdn_attention_spec(provider, *, naive_l2norm: bool = False) -> ModuleSpec:
    """``NPUGatedDeltaNet`` in the provider's layout; its rule runs the reference with the
    provider's ``"reference"`` kernel, else ``"auto"``."""
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
    """The config Megatron's dense block builder is given: ``config``, or for a GDN hybrid a shallow
    copy with ``experimental_attention_variant=None`` (megatron-core 0.19 asserts it); the GDN
    positions are swapped in by :func:`hybrid_layer_specs`."""
    if not is_gdn(config):
        return config
    view = copy.copy(config)
    view.experimental_attention_variant = None
    return view


def hybrid_layer_specs(
    layer_specs, config, provider, *, vp_stage=None, pp_rank=None, naive_l2norm: bool = False
) -> list:
    """This stage's layer specs (one per local layer, in order) with the GDN positions' attention
    swapped for GDN; ``provider`` is the block's ``NPUSpecProvider``, ``vp_stage`` / ``pp_rank`` as
    given to the block builder."""
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
