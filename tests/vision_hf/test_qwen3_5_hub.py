"""Qwen3.5's hub form (``Qwen3_5MoeForConditionalGeneration``: the Gated DeltaNet hybrid MoE under
a 2-block vision tower without deepstack, tests/integrations/qwen3_5_models.py's tiny one) through
the plugin's bridge (``hf_qwen3_5_vl.Qwen3_5VLBridge``), fp32, reference kernels, one process,
against this environment's transformers (5.10.4 in ``make test-verl``, 5.25 in
``make test-nemotron``): the logits with two images of different grids and on text alone, and a
bit-exact export of every tensor, ``model.visual.*`` included."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

pytest.importorskip("mbridge")
pytest.importorskip("transformers.models.qwen3_5_moe")

from tests.integrations.qwen3_5_models import IMAGE_IDS, save_tiny
from tests.vision_hf.qwen3_vl_models import CPU_ARGS, GRIDS, image_prompt, pixels

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

TOLERANCE = 1e-4
TOKENS = tuple(IMAGE_IDS[k] for k in ("vision_start_token_id", "image_token_id",
                                      "vision_end_token_id"))  # fmt: skip


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """``(path, transformers model, bridge, plugin model)`` of the tiny hub checkpoint."""
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    path = str(tmp_path_factory.mktemp("qwen3_5_hub"))
    hf_model = save_tiny(path, "hub")
    bridge = npu_bridge(path, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, path, bridge=bridge)
    return path, hf_model, bridge, model


def test_the_bridge_builds_the_vision_tower_with_transformers_logits(hub):
    from mcore_npu.transformer.vision.model import NPUQwen3VLModel

    _, hf_model, bridge, model = hub
    assert type(bridge).__name__ == "Qwen3_5VLBridge" and isinstance(model, NPUQwen3VLModel)
    assert model.vision is not None and len(model.vision.deepstack_merger_list) == 0
    ids, grid = image_prompt(GRIDS, tokens=TOKENS), torch.tensor(GRIDS)
    image = IMAGE_IDS["image_token_id"]
    text = torch.tensor([[5, 9, 11, 4, 7, 3, 8, image]])  # an image id, no image: text
    with torch.no_grad():
        want = hf_model(input_ids=ids, pixel_values=pixels(GRIDS), image_grid_thw=grid,
                        mm_token_type_ids=(ids == image).int()).logits  # fmt: skip
        got = model(ids, pixel_values=pixels(GRIDS), image_grid_thw=grid)
        text_error = float((model(text) - hf_model(input_ids=text).logits).abs().max())
    image_error = float((got - want).abs().max())
    print(f"Qwen3.5 hub: max |logit - transformers| two images {image_error:.1e}, "
          f"text {text_error:.1e}")  # fmt: skip
    assert max(image_error, text_error) <= TOLERANCE


def test_export_gives_back_every_tensor_bit_exact(hub):
    from mcore_npu.integrations.hf import export_hf_weights

    path, _, bridge, model = hub
    saved = safetensors.torch.load_file(str(next(Path(path).glob("*.safetensors"))))
    exported = dict(export_hf_weights(model, bridge))
    assert exported.keys() == saved.keys()
    assert any(k.startswith("model.visual.blocks.1.") for k in exported)
    for key, tensor in saved.items():
        assert torch.equal(exported[key], tensor), key
