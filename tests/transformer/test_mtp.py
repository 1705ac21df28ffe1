"""Multi-token prediction on the NPU spec: ``get_gpt_mtp_block_npu_spec`` against Megatron's
``get_gpt_mtp_block_spec`` (local spec), with the same weights: the main loss and every
gradient, the MTP layer's included (they get gradients from the MTP loss only), within 1e-5;
and TE's names (``_extra_state``) on the MTP norms and projection in the te layout."""

from __future__ import annotations

import pytest
import torch

from tests.transformer.megatron_models import VOCAB, batch, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


def _mtp_gpt(config, block, mtp, seed=0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(config, transformer_layer_spec=block, vocab_size=VOCAB, max_sequence_length=64,
                    position_embedding_type="rope", mtp_block_spec=mtp)  # fmt: skip


def _npu(config, layout):
    from mcore_npu.transformer.layer_specs import (
        get_gpt_decoder_block_npu_spec,
        get_gpt_mtp_block_npu_spec,
    )

    kernels = dict(kernel="reference", param_layout=layout)
    block = get_gpt_decoder_block_npu_spec(config, normalization=config.normalization, **kernels)
    return _mtp_gpt(config, block, get_gpt_mtp_block_npu_spec(config, block, **kernels), seed=3)


def _loss_and_grads(model, ids, pos):
    model.zero_grad()
    loss = model(ids, pos, None, labels=torch.roll(ids, -1, dims=1))
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_npu_mtp_block_matches_megatrons():
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    # the scale given: megatron-core 0.15 defaults it to None (0.16+: 0.1), which its loss divides
    config = tiny_config(mtp_num_layers=1, mtp_loss_scaling_factor=0.1)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization=config.normalization)  # fmt: skip
    megatron = _mtp_gpt(config, block, get_gpt_mtp_block_spec(config, block, False))
    npu = _npu(config, "local")
    assert type(npu.mtp.layers[0].enorm).__name__ == "NPURMSNorm"  # npu_rms_norm (reference)
    npu.load_state_dict(megatron.state_dict(), strict=True)
    ids, pos = batch(b=2, s=16)
    want, want_grads = _loss_and_grads(megatron, ids, pos)
    got, got_grads = _loss_and_grads(npu, ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert got_grads["mtp.layers.0.eh_proj.weight"].abs().sum() > 0


def test_npu_mtp_block_has_te_names_in_the_te_layout():
    from mcore_npu.transformer.layer_specs import get_gpt_mtp_block_npu_spec

    config = tiny_config(mtp_num_layers=1)
    names = {n for n in _npu(config, "te").state_dict() if n.startswith("mtp.layers.0.")}
    for part in ("enorm", "hnorm", "final_layernorm", "eh_proj"):
        assert {f"mtp.layers.0.{part}.weight", f"mtp.layers.0.{part}._extra_state"} <= names
    # the MTP layer's own layer: transformer_layer (megatron-core <= 0.18), mtp_model_layer (0.19+)
    inner = {name.split(".")[3] for name in names} - {"enorm", "hnorm", "final_layernorm",
                                                       "eh_proj"}  # fmt: skip
    assert inner in ({"transformer_layer"}, {"mtp_model_layer"}), inner
    assert f"mtp.layers.0.{inner.pop()}.self_attention.linear_qkv.layer_norm_weight" in names
    assert get_gpt_mtp_block_npu_spec(tiny_config(), None) is None  # no mtp_num_layers: no MTP


def _mtp_logits_hook(model):
    """Keep the output layer's first call of a forward (``GPTModel`` computes the MTP layer's
    logits first, then the main head's), graph attached: ``[S, B, V]``; a copy, since Megatron's
    cross entropy then works on the logits in place (``.float()`` of fp32 logits is no copy)."""
    calls = []
    handle = model.output_layer.register_forward_hook(
        lambda m, a, out: calls.append(out[0].clone())
    )
    return calls, handle


def _next_but_one_loss(mtp_logits, labels):
    """The MTP layer's loss as Megatron 0.16.1 defines it (``gpt_model.py`` ``_postprocess``):
    cross entropy against the labels shifted once more (the last position dropped), averaged
    over the remaining positions. ``mtp_logits [S, B, V]``, ``labels [B, S]`` -> scalar."""
    shifted = torch.roll(labels, -1, dims=1)
    mask = torch.ones_like(shifted, dtype=torch.float32)
    mask[:, -1] = 0
    ce = torch.nn.functional.cross_entropy(mtp_logits.transpose(0, 1).float().flatten(0, 1),
                                           shifted.flatten(), reduction="none")  # fmt: skip
    return (ce.view_as(mask) * mask).sum() / mask.sum()


@pytest.mark.parametrize("factor", [0.3, 1.0])
def test_megatrons_mtp_builder_takes_the_npu_layer_spec_and_scales_its_loss(factor):
    """``get_gpt_mtp_block_spec(config, get_gpt_layer_npu_spec(...))`` (the single-layer spec,
    unchanged) builds an MTP GPTModel that runs on the CPU. Its gradients are those of
    ``main + factor * mtp``: measured against the same weights built with factor 0, where the
    MTP term is added by hand from the MTP logits, and the MTP loss that Megatron reports
    (``MTPLossLoggingHelper``) is that ``mtp``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec

    def build(scale):
        config = tiny_config(mtp_num_layers=1, mtp_loss_scaling_factor=scale)
        spec = get_gpt_layer_npu_spec(kernel="reference", normalization=config.normalization,
                                      qk_layernorm=config.qk_layernorm)  # fmt: skip
        return _mtp_gpt(config, spec, get_gpt_mtp_block_spec(config, spec, False))

    ids, pos = batch(b=2, s=16)
    labels = torch.roll(ids, -1, dims=1)
    scaled, plain = build(factor), build(0.0)
    plain.load_state_dict(scaled.state_dict(), strict=True)
    MTPLossLoggingHelper.tracker = {}
    main, grads = _loss_and_grads(scaled, ids, pos)
    tracker = MTPLossLoggingHelper.tracker  # the key: "values" (<= 0.18), "loss_values" (0.19+)
    reported = tracker.get("values", tracker.get("loss_values")).clone()  # [mtp_num_layers]
    MTPLossLoggingHelper.tracker = {}

    calls, handle = _mtp_logits_hook(plain)
    plain.zero_grad()
    per_token = plain(ids, pos, None, labels=labels)  # [B, S], the main head's loss only
    handle.remove()
    mtp = _next_but_one_loss(calls[0], labels)
    (per_token.mean() + factor * mtp).backward()
    assert torch.isfinite(mtp) and reported.shape == (1,)
    torch.testing.assert_close(reported[0], mtp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(main, per_token.detach(), rtol=0, atol=0)  # MTP adds no term here
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert grads["mtp.layers.0.eh_proj.weight"].abs().sum() > 0


def test_a_stage_with_mtp_layers_and_no_decoder_layer_is_refused_in_one_line():
    """Megatron's MTP layers copy the stage's last decoder layer spec: a pipeline layout that
    leaves that stage without one is refused naming the way out (Megatron: IndexError)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from mcore_npu.transformer.layer_specs import get_gpt_mtp_block_npu_spec

    empty = TransformerBlockSubmodules(layer_specs=[])
    with pytest.raises(ValueError, match="^pipeline layout: the stage with the MTP layers") as err:
        get_gpt_mtp_block_npu_spec(tiny_config(mtp_num_layers=1), empty)
    assert "\n" not in str(err.value) and "mtp_num_layers=None" in str(err.value)
