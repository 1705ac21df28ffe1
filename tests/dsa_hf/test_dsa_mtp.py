"""Multi-token prediction of GLM-5 and DeepSeek-V3.2 checkpoints through the plugin's DSA bridge.

Both checkpoints ship one MTP layer as ``model.layers.{num_hidden_layers}.*``: ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` and a DSA decoder layer with its own indexer (GLM-5's
layer 78). transformers 5.25 skips those tensors, so the reference here is transformers' own
decoder layer class (``GlmMoeDsaDecoderLayer`` / ``DeepseekV32DecoderLayer``, layer index
``num_hidden_layers``, MoE, a full indexer) holding the checkpoint's MTP tensors, wired as
Megatron's MTP layer is: ``eh_proj(cat(enorm(embed(ids rolled left, last 0)), hnorm(h)))`` with
``h`` the main model's normalised hidden states, the layer at positions 0..S-1, then
``shared_head.norm`` and the main output layer. The MTP tensors are ``dsa_models.add_mtp_layer``'s
(the last layer's plus noise), loaded into transformers' layer strictly. Checked: the MTP layer is the NPU spec's (DSA,
its own indexer), every checkpoint tensor loads and exports bit-exactly, and its logits match
the reference within 1e-5 for 12 and 33 tokens (fp32, reference kernels, one process).
"""

from __future__ import annotations

import copy

import pytest
import safetensors.torch
import torch

pytest.importorskip("mbridge")
pytest.importorskip("transformers.models.glm_moe_dsa")
pytest.importorskip("transformers.models.deepseek_v32")

from tests.dsa_hf.dsa_models import COMMON, MODEL_TYPES, VOCAB, add_mtp_layer, save_tiny
from tests.hf_model_checks import CPU_ARGS, batches, own_attention_variables

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

TOLERANCE = 1e-5
LENGTHS = (12, 33)
LAYERS = COMMON["num_hidden_layers"]  # the MTP layer is model.layers.3


def _mtp_layer(hf_model, tensors: dict):
    """transformers' decoder layer of index ``LAYERS`` (MoE, a full indexer) holding the
    checkpoint's MTP layer (loaded strictly: the tensor set is transformers' own) and its
    config."""
    import transformers

    config = copy.deepcopy(hf_model.config)
    config.num_hidden_layers = LAYERS + 1
    config.mlp_layer_types = [*hf_model.config.mlp_layer_types, "sparse"]
    if hasattr(config, "indexer_types"):
        config.indexer_types = [*hf_model.config.indexer_types, "full"]
    glm = config.model_type == "glm_moe_dsa"
    cls = transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaDecoderLayer if glm else (
        transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32DecoderLayer)  # fmt: skip
    layer = cls(config, LAYERS).eval()
    prefix = f"model.layers.{LAYERS}."
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    own = {k: state.pop(k) for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                     "shared_head.norm.weight")}  # fmt: skip
    layer.load_state_dict(_fused(state), strict=True)
    return layer, config, own


def _fused(state: dict) -> dict:
    """The checkpoint's per-expert names as transformers' fused experts (``gate_up_proj
    [E, 2F, H]``, ``down_proj [E, H, F]``), as ``from_pretrained`` reads the main layers'."""
    state, experts = dict(state), {}
    for name in [k for k in state if k.startswith("mlp.experts.")]:
        _, _, e, proj, _ = name.split(".")
        experts.setdefault(int(e), {})[proj] = state.pop(name)
    order = sorted(experts)
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order]
    )
    state["mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return state


@pytest.fixture(scope="module", params=MODEL_TYPES)
def mtp_run(request, tmp_path_factory):
    """A tiny checkpoint with one MTP layer, the plugin's model of it and the reference layer."""
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    path = tmp_path_factory.mktemp(f"{request.param}_mtp")
    hf_model = save_tiny(request.param, path, num_nextn_predict_layers=1)
    add_mtp_layer(path)
    saved = safetensors.torch.load_file(str(path / "model.safetensors"))
    layer, layer_config, own = _mtp_layer(hf_model, saved)
    with own_attention_variables():  # the DeepSeek family's attention_backend: fused
        bridge = npu_bridge(str(path), kernel="reference", dtype=torch.float32)
        bridge.set_extra_args(**CPU_ARGS)
        model = build_model(bridge).eval()
    load_hf_weights(model, str(path), bridge=bridge)
    return dict(path=path, hf_model=hf_model, layer=layer, layer_config=layer_config, own=own,
                saved=saved, bridge=bridge, model=model)  # fmt: skip


def _plugin_mtp_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits ``[B, S, V]`` (its output through the main output layer)."""
    seen = []
    handle = model.mtp.layers[0].register_forward_hook(lambda m, a, out: seen.append(out[0]))
    try:
        with torch.no_grad():
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            model(ids, pos, None, labels=ids)
            logits, _ = model.output_layer(seen[0])
    finally:
        handle.remove()
    return logits.transpose(0, 1)


def _reference_mtp_logits(run, ids: torch.Tensor) -> torch.Tensor:
    """Megatron's MTP wiring around transformers' decoder layer (module docstring)."""
    from transformers.masking_utils import create_causal_mask

    hf, own = run["hf_model"], run["own"]
    eps = hf.config.rms_norm_eps

    def norm(x, name):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), own[name], eps)

    with torch.no_grad():
        hidden = hf.model(input_ids=ids).last_hidden_state
        rolled = torch.roll(ids, -1, dims=1)
        rolled[:, -1] = 0
        embedded = hf.model.embed_tokens(rolled)
        x = torch.cat([norm(embedded, "enorm.weight"), norm(hidden, "hnorm.weight")], -1)
        x = x @ own["eh_proj.weight"].t()
        pos = torch.arange(ids.shape[1])[None]
        mask = create_causal_mask(config=run["layer_config"], inputs_embeds=x, attention_mask=None,
                                  cache=None, position_ids=pos, allow_is_causal_skip=False)  # fmt: skip
        out = run["layer"](x, attention_mask=mask, position_ids=pos,
                           position_embeddings=hf.model.rotary_emb(x, position_ids=pos))  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        return hf.lm_head(norm(out, "shared_head.norm.weight"))


def test_the_mtp_layer_is_the_npu_specs_dsa_layer_with_its_own_indexer(mtp_run):
    from mcore_npu.transformer.dsa import NPUDSASelfAttention

    (mtp,) = mtp_run["model"].mtp.layers
    attention = mtp.transformer_layer.self_attention
    assert isinstance(attention, NPUDSASelfAttention)
    assert attention.core_attention.indexer is not None  # GLM-5's layer 78 ships one
    assert attention.core_attention.layer_number == LAYERS + 1


def test_every_mtp_tensor_loads_and_exports_bit_exactly(mtp_run):
    from mcore_npu.integrations.hf import export_hf_weights

    exported = {k: t.cpu() for k, t in export_hf_weights(mtp_run["model"], mtp_run["bridge"])}
    saved = mtp_run["saved"]
    assert exported.keys() == saved.keys()
    mtp = [k for k in saved if k.startswith(f"model.layers.{LAYERS}.")]
    assert len(mtp) > 20 and any(".indexer." in k for k in mtp)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


@pytest.mark.parametrize("length", LENGTHS)
def test_mtp_logits_match_transformers_layer_in_megatrons_wiring(mtp_run, length):
    ids = batches((length,), VOCAB)[length]
    got = _plugin_mtp_logits(mtp_run["model"], ids)
    want = _reference_mtp_logits(mtp_run, ids)
    assert got.shape == want.shape == (ids.shape[0], length, VOCAB)
    error = float((got - want).abs().max())
    assert error <= TOLERANCE, f"max |MTP logit difference| {error:.2e}"


def test_the_mtp_layer_indexes_itself_where_the_sharing_rule_would_share():
    """GLM-5 with 4 layers at ``index_topk_freq=2`` (full, full, shared, full): Megatron's rule
    would make layer 5 (the MTP layer) reuse layer 4's top-k; the checkpoint's MTP layer ships
    its own indexer, and the plugin builds it with one."""
    from mcore_npu.integrations.hf import bridge_from_config, build_model
    from tests.dsa_hf.dsa_models import tiny_config

    config = tiny_config("glm_moe_dsa", num_hidden_layers=4, index_topk_freq=2,
                         num_nextn_predict_layers=1)  # fmt: skip
    assert config.indexer_types == ["full", "full", "shared", "full"]
    with own_attention_variables():
        bridge = bridge_from_config(config, dtype=torch.float32)
        bridge.set_extra_args(**CPU_ARGS)
        model = build_model(bridge)
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert [core.indexer is None for core in cores] == [False, False, True, False]
    (mtp,) = model.mtp.layers
    core = mtp.transformer_layer.self_attention.core_attention
    assert core.layer_number == 5 and core.source == 5 and core.indexer is not None
    ids = batches((12,), VOCAB)[12]
    loss = model(ids, torch.arange(12).expand_as(ids), None, labels=ids)  # MTP runs too
    assert torch.isfinite(loss).all()


def _exported(bridge, model) -> dict[str, torch.Tensor]:
    from mcore_npu.integrations.hf import export_hf_weights

    return {k: t.cpu() for k, t in export_hf_weights(model, bridge)}


def _loaded(path, **extra):
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    with own_attention_variables():
        bridge = npu_bridge(str(path), kernel="reference", dtype=torch.float32)
        bridge.set_extra_args(**CPU_ARGS, **extra)
        model = build_model(bridge).eval()
    load_hf_weights(model, str(path), bridge=bridge)
    return bridge, model


def test_the_mtp_layers_copies_of_embedding_and_head_export_as_the_checkpoint_has_them(tmp_path):
    """DeepSeek's releases carry ``model.layers.{L}.embed_tokens`` and ``shared_head.head``
    (copies of the embedding and LM head; Megatron's MTP layer shares the main ones), some GLM-5
    releases not: export writes them back exactly where the loaded checkpoint had them."""
    hf_model = save_tiny("glm_moe_dsa", tmp_path, num_nextn_predict_layers=1)
    add_mtp_layer(tmp_path)
    file = tmp_path / "model.safetensors"
    saved = safetensors.torch.load_file(str(file))
    saved[f"model.layers.{LAYERS}.embed_tokens.weight"] = saved["model.embed_tokens.weight"].clone()
    saved[f"model.layers.{LAYERS}.shared_head.head.weight"] = (
        hf_model.lm_head.weight.detach().clone()
    )
    safetensors.torch.save_file(saved, str(file), metadata={"format": "pt"})
    exported = _exported(*_loaded(tmp_path))
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_with_mtp_off_the_main_model_loads_and_exports_without_the_mtp_tensors(mtp_run):
    bridge, model = _loaded(mtp_run["path"], mtp_num_layers=None)
    assert not hasattr(model, "mtp")
    main = {k: v for k, v in mtp_run["saved"].items()
            if not k.startswith(f"model.layers.{LAYERS}.")}  # fmt: skip
    exported = _exported(bridge, model)
    assert exported.keys() == main.keys()
    assert all(torch.equal(exported[k], main[k]) for k in main)
