"""The Megatron-Bridge path (``vanilla_mbridge=False`` with ``import megatron.bridge`` working),
opt-in: ``make test-megatron-bridge`` (not in CI; the file name keeps pytest's default collection
away from it).

The make target builds a scratch megatron-bridge 0.3.1 (``scripts/megatron_bridge_env.py``:
``--no-deps``, its Transformer-Engine- and Triton-only modules replaced by stand-ins) and runs
this module with it on ``PYTHONPATH``. Per model, two verl ``TrainingWorker`` s in one process:
``vanilla_mbridge=True`` (mbridge) and ``False`` (Megatron-Bridge with the NPU spec on the
provider, ``weight_path.megatron_bridge_overrides`` and the plugin's classes registered with
``AutoMapping``). The second must have no fallback, a provider, ``NPUFusionAttention`` in every
layer, and give exactly (``==``) the first's ``infer_batch`` log-probs and the same
``get_per_tensor_param`` tensors (Megatron-Bridge yields them in another order). Qwen3,
Qwen3-MoE with ``norm_topk_prob`` true and false (Megatron-Bridge's Qwen3-MoE bridge fixes the
router form of ``true``). Both paths build in one process: ``attention_backend=auto`` on the
provider keeps Megatron's ``NVTE_*`` check quiet.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("verl")

from mcore_npu.transformer.attention import NPUFusionAttention
from tests.integrations import verl_loop as loop
from tests.integrations.test_weight_path import _log_probs

pytestmark = pytest.mark.usefixtures("cpu_runtime")


@pytest.fixture(scope="module", autouse=True)
def _megatron_bridge_imports():
    from mcore_npu.integrations.verl.weight_path import megatron_bridge_import_error

    error = megatron_bridge_import_error()
    if error is not None:
        pytest.fail(f"import megatron.bridge fails ({error}); run `make test-megatron-bridge`")


def _checkpoint(family: str, path, **fields) -> str:
    """``verl_loop``'s tiny checkpoint of ``family`` with ``fields`` changed in its config."""
    import transformers

    from tests.integrations.conftest import _save_word_level_tokenizer

    config = loop.hf_config(family)
    for key, value in fields.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    _save_word_level_tokenizer(path)
    return str(path)


def _worker(path: str, vanilla: bool):
    config = loop.worker_config(path, total_steps=2, forward_only=True)
    engine = dataclasses.replace(config.engine_config, vanilla_mbridge=vanilla)
    return loop.new_worker(dataclasses.replace(config, engine_config=engine), loop.sft_loss_fn())


def _exported(worker) -> dict[str, torch.Tensor]:
    generator, _ = worker.engine.get_per_tensor_param()
    return {name: tensor.detach().clone() for name, tensor in generator}


def _gpt(engine):
    model = engine.module[0]
    while not hasattr(model, "decoder"):
        model = model.module
    return model


@pytest.mark.parametrize(
    "family, fields",
    [("qwen3", {}), ("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False})],
    ids=["qwen3", "qwen3_moe", "qwen3_moe_unnormalised"],
)
def test_megatron_bridge_equals_mbridge(tmp_path, family, fields):
    path = _checkpoint(family, tmp_path, **fields)
    mbridge, bridge = _worker(path, True), _worker(path, False)
    engine = bridge.engine
    assert engine.provider is not None and not engine.vanilla_bridge and not engine.mbridge_fallback
    layers = _gpt(engine).decoder.layers
    assert all(
        isinstance(layer.self_attention.core_attention, NPUFusionAttention) for layer in layers
    )
    if family == "qwen3_moe":
        want = not fields.get("norm_topk_prob", True)  # the Hugging Face router's form
        assert all(layer.mlp.router.config.moe_router_pre_softmax is want for layer in layers)
    want_lp, got_lp = _log_probs(mbridge), _log_probs(bridge)
    assert all(torch.equal(g, w) for g, w in zip(got_lp, want_lp, strict=True))
    want, got = _exported(mbridge), _exported(bridge)
    assert set(got) == set(want)
    assert all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)
    print(f"{family} {fields}: log-probs and {len(want)} exported tensors equal")
