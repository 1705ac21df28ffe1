"""verl's multi-token-prediction keys (``actor_rollout_ref.model.mtp.*``, as the MiMo-7B recipe
sets them) train a tiny MiMo through verl 0.9.1's ``TrainingWorker`` with the plugin's engine:
the MTP layer is built from the NPU spec (mbridge's MiMo bridge would build TE's), its loss is
finite, is reported by verl (``mtp_losses/mtp_1_loss``), and enters the gradients scaled by
``mtp_loss_scaling_factor``.

Real verl, mbridge, transformers and megatron-core, one gloo process on the CPU. The runs are
fp32 (``verl_loop.worker_config(dtype="float32")``, the test oracle) so that gradients of two
runs can be compared at 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("verl")

from tests.integrations import verl_loop

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

FACTORS = (0.5, 1.0)
MTP_METRIC = "mtp_losses/mtp_1_loss"


def _mimo_worker(path: str, factor: float, detach_encoder: bool = False):
    from verl.workers.config.model import MtpConfig

    mtp = MtpConfig(enable=True, enable_train=True, mtp_loss_scaling_factor=factor,
                    detach_encoder=detach_encoder)  # fmt: skip
    config = verl_loop.worker_config(path, dtype="float32", total_steps=2,
                                     model=dict(trust_remote_code=True, mtp=mtp))  # fmt: skip
    return verl_loop.new_worker(config, verl_loop.sft_loss_fn())


def _gpt(worker):
    from megatron.core.utils import unwrap_model

    return unwrap_model(worker.engine.module[0])


def _train_step_with_grads(worker):
    """One ``train_batch``: (verl's metrics, each parameter's gradient summed over the step's
    micro-batches). The gradients are read with torch's tensor hooks as autograd computes them,
    before Megatron's DDP accumulates them into its buffer (which is empty again after verl's
    step)."""
    grads: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(grad):
            grads[name] = grads.get(name, 0) + grad.detach().float()

        return hook

    params = dict(_gpt(worker).named_parameters())
    handles = [p.register_hook(keep(name)) for name, p in params.items() if p.requires_grad]
    try:
        (metrics,) = verl_loop.train_sft(worker, 1)
    finally:
        for handle in handles:
            handle.remove()
    return metrics, grads


def _one(value) -> float:
    return float(value[0] if isinstance(value, list) else value)


@pytest.fixture(scope="module")
def mimo_runs(cpu_runtime, mimo):
    """Per factor: (worker, metrics of step 1, gradients of step 1, the MTP layer's weights as
    loaded); the same weights and batch. Key ``"detached"``: the highest factor with
    ``detach_encoder=True`` (the MiMo-7B recipe's setting)."""
    runs = {}
    for factor in (*FACTORS, "detached"):
        if factor == "detached":
            worker = _mimo_worker(mimo, FACTORS[-1], detach_encoder=True)
        else:
            worker = _mimo_worker(mimo, factor)
        loaded = {n: p.detach().clone() for n, p in _gpt(worker).named_parameters()
                  if n.startswith("mtp.")}  # fmt: skip
        runs[factor] = (worker, *_train_step_with_grads(worker), loaded)
    return runs


def test_the_mtp_layer_is_built_from_the_npu_spec_with_the_checkpoints_weights(mimo, mimo_runs):
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from safetensors.torch import load_file

    from mcore_npu.transformer.attention import NPUFusionAttention

    model = _gpt(mimo_runs[FACTORS[0]][0])
    assert model.mtp_process and len(model.mtp.layers) == 1
    layer = model.mtp.layers[0]
    assert type(layer.transformer_layer) is TransformerLayer
    assert any(isinstance(m, NPUFusionAttention) for m in layer.modules())
    assert type(layer.enorm).__name__ == "TENPURMSNorm"  # the NPU spec's norm, TE names
    hf = load_file(f"{mimo}/model.safetensors")
    loaded = mimo_runs[FACTORS[0]][3]
    assert torch.equal(
        loaded["mtp.layers.0.eh_proj.weight"], hf["model.mtp_layers.0.input_proj.weight"]
    )
    assert torch.equal(loaded["mtp.layers.0.transformer_layer.mlp.linear_fc2.weight"],
                       hf["model.mtp_layers.0.mlp.down_proj.weight"])  # fmt: skip


def test_the_mtp_loss_is_finite_and_reported_the_same_for_both_factors(mimo_runs):
    (_, low, _, _), (_, high, _, _) = (mimo_runs[f] for f in FACTORS)
    print({f: (_one(mimo_runs[f][1]["loss"]), mimo_runs[f][1][MTP_METRIC]) for f in FACTORS})
    assert math.isfinite(low[MTP_METRIC]) and low[MTP_METRIC] > 0
    assert low[MTP_METRIC] == pytest.approx(high[MTP_METRIC], rel=1e-6)  # same weights, batch
    assert _one(low["loss"]) == pytest.approx(_one(high["loss"]), rel=1e-6)  # main head only


def test_the_mtp_loss_enters_the_gradients_scaled_by_the_factor(mimo_runs):
    """An MTP-only parameter's gradient is ``factor * d(mtp)/dp`` (the main loss does not reach
    it): doubling the factor doubles it. A decoder parameter gets the MTP term too."""
    (_, _, low, _), (_, _, high, _) = (mimo_runs[f] for f in FACTORS)
    ratio = FACTORS[1] / FACTORS[0]
    mtp_only = [name for name in low if name.startswith("mtp.")]
    assert len(mtp_only) == 11, sorted(mtp_only)  # every MTP parameter got a gradient
    for name in mtp_only:
        assert low[name].abs().sum() > 0, name
        torch.testing.assert_close(high[name], ratio * low[name], rtol=1e-5, atol=1e-9, msg=name)
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert (high[qkv] - low[qkv]).abs().max() > 1e-6 * low[qkv].abs().max()


def test_detach_encoder_keeps_the_mtp_loss_out_of_the_decoder(mimo_runs):
    """With ``detach_encoder=True`` the MTP loss trains the MTP layer only: every other
    gradient is the main loss's alone, ``main = 2 * g(0.5) - g(1.0)`` from the two runs above
    (so those are ``main + factor * mtp`` for the decoder too), and the MTP layer's gradients
    are the undetached run's of the same factor."""
    (_, _, low, _), (_, _, high, _) = (mimo_runs[f] for f in FACTORS)
    _, metrics, detached, _ = mimo_runs["detached"]
    assert FACTORS == (0.5, 1.0) and math.isfinite(metrics[MTP_METRIC])
    for name, grad in detached.items():
        want = high[name] if name.startswith("mtp.") else 2 * low[name] - high[name]
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-7, msg=name)


def test_a_second_step_trains_with_a_finite_loss(mimo_runs):
    worker = mimo_runs[FACTORS[1]][0]
    (metrics,) = verl_loop.train_sft(worker, 1)
    assert math.isfinite(_one(metrics["loss"])) and math.isfinite(metrics[MTP_METRIC])
    assert math.isfinite(_one(metrics["grad_norm"])) and _one(metrics["grad_norm"]) > 0


def test_npu_bridge_loads_and_exports_the_mtp_layer_bit_exactly(mimo):
    """Outside verl: ``npu_bridge`` on the MiMo checkpoint builds the MTP layer from the NPU spec
    (mbridge's MiMo bridge alone raises ``Invalid spec``), loads every tensor of the file, the
    MTP layer's included, and exports them back unchanged (what verl sends to the rollout)."""
    from safetensors.torch import load_file

    from mcore_npu.integrations.hf import export_hf_weights, npu_bridge
    from tests.integrations.test_hf_bridge import CPU_ARGS, build_and_load

    bridge = npu_bridge(mimo, kernel="reference", dtype=torch.float32, trust_remote_code=True)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_and_load(bridge, mimo)
    assert model.mtp_process and len(model.mtp.layers) == 1
    saved = load_file(f"{mimo}/model.safetensors")
    exported = dict(export_hf_weights(model, bridge))
    assert exported.keys() == saved.keys()
    assert any(name.startswith("model.mtp_layers.0.") for name in saved)
    for name, tensor in saved.items():
        assert torch.equal(exported[name].cpu(), tensor), name


@pytest.fixture(scope="module")
def glm5_mtp(tmp_path_factory) -> str:
    """A tiny GLM-5 (``tests/dsa_hf/dsa_models.py``, bf16-exact) with one MTP layer as GLM-5
    ships it (``model.layers.3.*``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and
    a DSA decoder layer with its own indexer; ``dsa_models.add_mtp_layer``)."""
    from tests.dsa_hf import dsa_models
    from tests.integrations.conftest import save_bf16_exact

    torch.manual_seed(0)
    _, model_class = dsa_models.classes("glm_moe_dsa")
    model = model_class(dsa_models.tiny_config("glm_moe_dsa", num_nextn_predict_layers=1))
    dsa_models.draw(model, dsa_models.SEEDS["glm_moe_dsa"])
    path = save_bf16_exact(model, tmp_path_factory.mktemp("tiny_glm5_mtp"))
    dsa_models.add_mtp_layer(path)
    return path


@pytest.mark.usefixtures("own_attention_variables")  # GLM-5: attention_backend fused
def test_glm5_trains_its_mtp_layer_through_the_npu_dsa_spec(cpu_runtime, glm5_mtp):
    """verl's MTP keys (``mtp.enable``, ``enable_train``, factor 0.1 as the MiMo recipe) on a
    GLM-5 checkpoint: the MTP layer is the NPU spec's DSA layer with its own indexer, holds the
    checkpoint's layer-3 tensors, and a step trains with a finite, reported MTP loss and a
    finite, non-zero gradient on the MTP layer."""
    from safetensors.torch import load_file

    from mcore_npu.transformer.dsa import NPUDSASelfAttention

    worker = _mimo_worker(glm5_mtp, 0.1)
    model = _gpt(worker)
    (layer,) = model.mtp.layers
    attention = layer.transformer_layer.self_attention
    assert isinstance(attention, NPUDSASelfAttention)
    assert attention.core_attention.indexer is not None
    hf = load_file(f"{glm5_mtp}/model.safetensors")
    params = dict(model.named_parameters())
    assert torch.equal(params["mtp.layers.0.eh_proj.weight"], hf["model.layers.3.eh_proj.weight"])
    indexer = (
        "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer.linear_wk.weight"
    )
    assert torch.equal(params[indexer], hf["model.layers.3.self_attn.indexer.wk.weight"])
    metrics, grads = _train_step_with_grads(worker)
    print({"loss": _one(metrics["loss"]), MTP_METRIC: metrics[MTP_METRIC]})
    assert math.isfinite(metrics[MTP_METRIC]) and metrics[MTP_METRIC] > 0
    eh_proj = grads["mtp.layers.0.eh_proj.weight"]
    assert torch.isfinite(eh_proj).all() and eh_proj.abs().max() > 0
