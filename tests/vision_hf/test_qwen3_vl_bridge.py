"""The tiny Qwen3-VL checkpoint (safetensors on disk) through the plugin's mbridge bridge
(``npu_bridge`` / ``build_model`` / ``load_hf_weights`` / ``export_hf_weights``), fp32, reference
kernels: the logits with two images are transformers', export is bit-exact, and at TP = 2
(torchrun, gloo, sequence parallel) the weights load split per rank, export bit-exact, and give
the one-process logits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

pytest.importorskip("mbridge")
pytest.importorskip("transformers.models.qwen3_vl")

from tests.vision_hf.qwen3_vl_models import (
    CPU_ARGS,
    EVEN_TEXT,
    GRIDS,
    IMAGE,
    image_prompt,
    pixels,
    save_tiny,
)

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def bridged(checkpoint):
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    bridge = npu_bridge(checkpoint, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, checkpoint, bridge=bridge)
    return bridge, model


def _logits(model, text=EVEN_TEXT):
    with torch.no_grad():
        return model(
            image_prompt(GRIDS, text),
            pixel_values=pixels(GRIDS),
            image_grid_thw=torch.tensor(GRIDS),
        )


def test_bridge_builds_the_plugin_model_with_transformers_logits(checkpoint, bridged):
    from transformers import Qwen3VLForConditionalGeneration

    from mcore_npu.transformer.vision.model import NPUQwen3VLModel

    bridge, model = bridged
    assert type(bridge).__name__ == "Qwen3VLBridge" and isinstance(model, NPUQwen3VLModel)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint).float().eval()
    ids = image_prompt(GRIDS, EVEN_TEXT)
    with torch.no_grad():
        want = hf(
            input_ids=ids,
            pixel_values=pixels(GRIDS),
            image_grid_thw=torch.tensor(GRIDS),
            mm_token_type_ids=(ids == IMAGE).int(),
        ).logits
    assert (_logits(model) - want).abs().max() <= 1e-4


def test_export_through_the_bridge_is_bit_exact(checkpoint, bridged):
    from mcore_npu.integrations.hf import export_hf_weights

    bridge, model = bridged
    saved = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        saved.update(safetensors.torch.load_file(file))
    exported = dict(export_hf_weights(model, bridge))
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[name], saved[name]) for name in saved)


@pytest.mark.distributed
def test_tensor_parallel_2_loads_exports_and_computes_as_one_process(checkpoint, bridged):
    from tests.launch import ROOT, TORCHRUN, run_command

    torch.save(_logits(bridged[1]), Path(checkpoint) / "tp1_logits.pt")
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "tests.vision_hf.tp_run",
        checkpoint,
    ]
    done = run_command(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    export = next(line.split()[1:] for line in lines if line.startswith("TP_EXPORT"))
    assert export[1:] == ["True", "True"] and int(export[0]) > 0, export
    diff = next(float(line.split()[1]) for line in lines if line.startswith("TP_LOGITS"))
    assert diff <= 1e-5, diff
    print(f"TP = 2: {export[0]} tensors exported bit-exact; logits within {diff:.1e} of TP = 1")


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """``{layout: path}``: the tiny Qwen3-VL-MoE as transformers 5 saves it (``gate_up_proj``
    ``[E, 2I, H]``) and in the hub's layout (the expert tensors transposed)."""
    from tests.vision_hf.qwen3_vl_models import tiny_model

    saved = tmp_path_factory.mktemp("qwen3_vl_moe")
    tiny_model(moe=True).save_pretrained(saved, safe_serialization=True)
    hub = tmp_path_factory.mktemp("qwen3_vl_moe_hub")
    for file in Path(saved).iterdir():
        if file.suffix == ".safetensors":
            tensors = safetensors.torch.load_file(file)
            tensors = {k: v.transpose(1, 2).contiguous() if ".experts." in k else v
                       for k, v in tensors.items()}  # fmt: skip
            safetensors.torch.save_file(tensors, hub / file.name, metadata={"format": "pt"})
        else:
            (hub / file.name).write_bytes(file.read_bytes())
    return {"transformers": str(saved), "hub": str(hub)}


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_moe_through_the_bridge_in_either_expert_layout(moe_checkpoints, layout):
    from mcore_npu.integrations.hf import (
        build_model,
        export_hf_weights,
        load_hf_weights,
        npu_bridge,
    )
    from tests.vision_hf.qwen3_vl_models import tiny_model

    path = moe_checkpoints[layout]
    bridge = npu_bridge(path, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, path, bridge=bridge)
    assert bridge.expert_layout == layout and model.language_model.config.num_moe_experts == 4
    ids = image_prompt(GRIDS, EVEN_TEXT)
    with torch.no_grad():
        want = tiny_model(moe=True)(input_ids=ids, pixel_values=pixels(GRIDS),
                                    image_grid_thw=torch.tensor(GRIDS),
                                    mm_token_type_ids=(ids == IMAGE).int()).logits  # fmt: skip
    assert (_logits(model) - want).abs().max() <= 1e-4
    saved = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        saved.update(safetensors.torch.load_file(file))
    exported = dict(export_hf_weights(model, bridge))
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
