"""``get_hybrid_stack_npu_spec`` in Megatron's own builder: ``MambaModel`` (megatron-core <= 0.17)
or ``HybridModel`` (0.18+) with a pattern of every layer kind the installed stack has, forward and
backward on CPU, Megatron's TE names, the NPU final norm, and what is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_npu.transformer.mamba.stack import StackSubmodules
from tests.transformer.mamba_models import hybrid_config, hybrid_model

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

SLOTS = {field.name for field in dataclasses.fields(StackSubmodules)}
PATTERN = "M*-" + ("E" if "moe_layer" in SLOTS else "") + ("M" if "moe_layer" in SLOTS else "")
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
           linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip


def _run(model, batch=2, seq=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, seq), generator=gen)
    positions = torch.arange(seq).expand(batch, seq)
    logits = model(ids, positions, attention_mask=None)
    logits.float().square().mean().backward()
    return logits


def test_every_layer_kind_runs_forward_and_backward_with_finite_gradients():
    model = hybrid_model(PATTERN)
    logits = _run(model)
    assert logits.shape == (2, 12, 64) and torch.isfinite(logits).all()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    kinds = [type(layer).__name__ for layer in model.decoder.layers]
    assert kinds[:3] == ["MambaLayer", "TransformerLayer", "MLPLayer"]


def test_names_are_megatrons_te_names_and_the_final_norm_is_the_npu_norm():
    model = hybrid_model(PATTERN)
    keys = {k for k in model.state_dict() if "_extra_state" not in k}
    assert {"decoder.layers.0.mixer.in_proj.layer_norm_weight", "decoder.layers.0.mixer.A_log",
            "decoder.layers.0.mixer.conv1d.bias", "decoder.layers.0.mixer.norm.weight",
            "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.2.mlp.linear_fc1.layer_norm_weight", "decoder.final_norm.weight",
            } <= keys  # fmt: skip
    assert not any(k.startswith("decoder.layers.1.mlp") for k in keys)  # attention only
    assert not any(k.startswith("decoder.layers.2.self_attention") for k in keys)  # MLP only
    if "E" in PATTERN:
        assert "decoder.layers.3.pre_mlp_layernorm.weight" in keys
        assert any(k.startswith("decoder.layers.3.mlp.experts.") for k in keys)
    assert type(model.decoder.final_norm).__module__.startswith("mcore_npu.")


@pytest.mark.skipif("gdn_layer" not in SLOTS, reason="the G slot came with megatron-core 0.17")
def test_gated_deltanet_layers_in_the_pattern():
    model = hybrid_model("MG*G", hybrid_config(num_layers=4, **GDN))
    _run(model)
    assert type(model.decoder.layers[1].self_attention).__name__ == "NPUGatedDeltaNet"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_local_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="param_layout: 'local'.*pass param_layout='te'"):
        hybrid_model("M*", param_layout="local")


@pytest.mark.skipif("dsa_layer" not in SLOTS, reason="the D slot came with megatron-core 0.18")
def test_dsa_layers_in_the_pattern():
    """``D``: the NPU DSA layer (attention only), its indexer choosing 4 of 16 keys and trained
    by its KL loss, so every parameter gets a finite gradient."""
    from tests.transformer.mla_models import dsa_config

    model = hybrid_model("D-D", dsa_config(topk=4, coeff=0.1, num_layers=3, is_hybrid_model=True))
    _run(model)
    assert type(model.decoder.layers[0].self_attention).__name__ == "NPUDSASelfAttention"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def _hybrid_key(key: str) -> str:
    """A GPTModel key -> the HybridModel key of the same weight: GPT layer i is hybrid layers
    2i (its attention / GDN part) and 2i + 1 (its MLP part); ``final_layernorm`` is
    ``final_norm``."""
    head, sep, rest = key.partition("decoder.layers.")
    if not sep:
        return key.replace("decoder.final_layernorm.", "decoder.final_norm.")
    index, _, name = rest.partition(".")
    mlp = name.startswith(("mlp.", "pre_mlp_layernorm."))
    return f"{head}decoder.layers.{2 * int(index) + int(mlp)}.{name}"


@pytest.mark.skipif(
    "gdn_layer" not in SLOTS or "mla_layer" not in SLOTS,
    reason="HybridModel with G layers: megatron-core 0.19",
)
def test_qwen3_5_by_hybrid_model_equals_qwen3_5_by_gpt_model():
    """Qwen3.5's tiny hybrid (tests/transformer/gdn_models.py: [GDN, GDN, GDN, attention], gated
    attention, zero-centred norms) built by GPTModel with get_gpt_decoder_block_npu_spec and by
    HybridModel with pattern ``G-G-G-*-``, the same weights: the same logits."""
    from tests.transformer.gdn_models import gdn_config, gdn_gpt

    config = gdn_config()
    gpt = gdn_gpt(config, seed=3).eval()
    hybrid = hybrid_model("G-G-G-*-", gdn_config(num_layers=8), vocab=96, qk_layernorm=True).eval()
    state = {_hybrid_key(k): v for k, v in gpt.state_dict().items()}
    missing, unexpected = hybrid.load_state_dict(state, strict=False)
    assert not [k for k in missing if "_extra_state" not in k] and not unexpected
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 96, (2, 24), generator=gen)
    positions = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        want, got = gpt(ids, positions, None), hybrid(ids, positions, None)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _stack_recomputes() -> bool:
    """Whether the installed stack has full recompute (0.19's HybridStack: checkpointed_forward)."""
    import sys

    from mcore_npu.transformer.mamba.stack import NPUHybridStack

    return hasattr(sys.modules[NPUHybridStack.__mro__[1].__module__], "checkpointed_forward")


@pytest.mark.skipif(
    not _stack_recomputes(), reason="the stack's full recompute: 0.19's HybridStack"
)
def test_full_recompute_of_the_stack_gives_the_same_gradients():
    """recompute_granularity=full, uniform, 1 layer (the Nemotron recipe's): every layer kind is
    recomputed in the backward and the gradients equal those without recompute."""
    grads = []
    for fields in (
        {},
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ):
        model = hybrid_model(PATTERN, hybrid_config(num_layers=len(PATTERN), **fields))
        _run(model)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.skipif("mtp_block_spec" not in SLOTS, reason="hybrid MTP: megatron-core 0.17+")
def test_a_pattern_with_multi_token_prediction_trains_its_mtp_layers():
    """``M*-/M*`` with ``mtp_num_layers=1``: Megatron builds the MTP depth as a nested stack from
    the NPU slots; the language-model loss (labels given) reaches every MTP parameter."""
    config = hybrid_config(num_layers=3, mtp_num_layers=1, mtp_loss_scaling_factor=0.1)
    model = hybrid_model("M*-/M*", config)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 12), generator=gen)
    loss = model(ids, torch.arange(12).expand(2, 12), None, labels=torch.roll(ids, -1, 1))
    loss.float().mean().backward()
    mtp = {n: p for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert any(".eh_proj." in n for n in mtp) and any(".mixer." in n for n in mtp), sorted(mtp)
    for name, param in mtp.items():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
