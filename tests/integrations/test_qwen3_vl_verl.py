"""Qwen3-VL through verl 0.9.1's ``TrainingWorker`` and the plugin's engine, images included.

The tiny checkpoint is tests/vision_hf/qwen3_vl_models.py's (dense 3-layer language model, 2-block
vision tower, deepstack after both), saved with a 160-token word-level tokenizer, weights rounded
to bf16. The engine builds it through the plugin's ``Qwen3VLBridge`` (verl's default weight path,
``vanilla_mbridge=True``) and runs verl's own vision forward (``model_forward_gen(True)``):
``multi_modal_inputs`` (``pixel_values``, ``image_grid_thw``) as verl passes them, the model
computing its positions, and in thd packing its own tokens after the vision embedding.

Checked, in thd and bshd: the log-probs of three rows (two images of different grids; text only;
one image) are within 1e-3 of transformers (fp32 on the same bf16 weights); one backward gives
the patch embedding, the mergers and every vision block a finite, non-zero gradient; and two
``train_batch`` steps give finite losses and non-zero grad norms."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("transformers.models.qwen3_vl")


from tests.integrations import qwen3_vl_data as data
from tests.integrations import verl_loop as loop
from tests.integrations.conftest import (
    accumulated_grad,
    engine_model,
    lm_head_engine,
    training_worker_config,
)
from tests.integrations.log_probs import mean_negative_log_prob
from tests.vision_hf.qwen3_vl_models import pixels

pytestmark = pytest.mark.usefixtures("cpu_runtime", "own_attention_variables")

TOLERANCE = 1e-3


# Qwen3-VL dense and MoE; the tiny Qwen3.5 hub checkpoint (tests/integrations/conftest.py's
# qwen3_5_hub: the GDN hybrid MoE under a 2-block vision tower without deepstack)
FAMILIES = ("dense", "moe", "qwen3_5_hub")
BRIDGES = {"dense": "Qwen3VLBridge", "moe": "Qwen3VLBridge", "qwen3_5_hub": "Qwen3_5VLBridge"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, qwen3_5_hub) -> dict[str, str]:
    made = {f: data.save_checkpoint(tmp_path_factory.mktemp(f"qwen3_vl_{f}"), moe=f == "moe")
            for f in FAMILIES[:2]}  # fmt: skip
    return {**made, "qwen3_5_hub": qwen3_5_hub}


@pytest.fixture(scope="module")
def checkpoint(checkpoints, family) -> str:
    return checkpoints[family]


@pytest.fixture(scope="module")
def rows(family) -> tuple:
    return data.family_rows(family)


@pytest.fixture(scope="module")
def reference(checkpoint, rows) -> list[torch.Tensor]:
    """transformers' log p(token t+1) of every row, fp32 on the bf16-rounded weights."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    image = AutoConfig.from_pretrained(checkpoint).image_token_id
    out = []
    with torch.no_grad():
        for ids, grids, seed in rows:
            extra = {}
            if grids:
                extra = dict(
                    pixel_values=pixels(grids, seed),
                    image_grid_thw=torch.tensor(grids),
                    mm_token_type_ids=(ids[None] == image).int(),
                )
            logits = model.eval()(input_ids=ids[None], **extra).logits[0]
            log_probs = torch.log_softmax(logits.float(), -1)[:-1]
            out.append(log_probs.gather(-1, ids[1:, None])[:, 0])
    return out


def _engine(path: str, *, thd: bool):
    return lm_head_engine(training_worker_config(path, remove_padding=thd))[0]


@pytest.mark.parametrize("thd", [True, False], ids=["thd", "bshd"])
def test_log_probs_with_images_match_transformers(checkpoint, rows, reference, family, thd):
    engine = _engine(checkpoint, thd=thd)
    assert type(engine.bridge).__name__ == BRIDGES[family]
    model = engine_model(engine)
    assert type(model).__name__ == "NPUQwen3VLModel" and model.vision is not None
    model.float()
    result = engine.forward_backward_batch(data.image_batch(rows), mean_negative_log_prob)
    out = result["model_output"]["log_probs"].unbind()
    got = [row[: len(ids) - 1].float() for row, (ids, _, _) in zip(out, rows, strict=True)]
    error = max(float((g - w).abs().max()) for g, w in zip(got, reference, strict=True))
    layout = "thd" if thd else "bshd"
    print(f"qwen3_vl {family} ({layout}): max |log p - log p_hf| = {error:.2e}")
    assert error < TOLERANCE
    grads = {name: accumulated_grad(p) for name, p in model.vision.named_parameters()}
    names = [
        "patch_embed.proj.weight",
        "merger.linear_fc2.weight",
        "blocks.0.self_attention.linear_qkv.weight",
        "blocks.1.mlp.linear_fc2.weight",
    ]
    if family != "qwen3_5_hub":  # Qwen3.5's tower has no deepstack
        names.append("deepstack_merger_list.0.linear_fc1.weight")
    for name in names:
        assert torch.isfinite(grads[name]).all() and grads[name].abs().sum() > 0, name


@pytest.mark.parametrize("thd", [True, False], ids=["thd", "bshd"])
def test_two_training_steps_with_images(checkpoint, rows, family, thd):
    config = loop.worker_config(checkpoint, remove_padding=thd, micro_batch=len(rows))
    worker = loop.new_worker(config, loop.sft_loss_fn())
    metrics = data.train(worker, 2, rows)
    losses = [float(torch.tensor(m["loss"]).mean()) for m in metrics]
    norms = [float(torch.tensor(m["grad_norm"]).mean()) for m in metrics]
    print(f"qwen3_vl {family} ({'thd' if thd else 'bshd'}): losses {losses}, grad norms {norms}")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]
    assert all(n > 0 and torch.isfinite(torch.tensor(n)) for n in norms)
