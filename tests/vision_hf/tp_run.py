"""``torchrun --nproc-per-node=2 -m tests.vision_hf.tp_run <checkpoint>``: the tiny Qwen3-VL at
TP = 2 (sequence parallel, as mbridge sets it) through the plugin's bridge. Rank 0 prints
``TP_EXPORT <tensors> <names equal> <all torch.equal>`` against the checkpoint's safetensors and
``TP_LOGITS <max |diff|>`` against ``tp1_logits.pt`` (two images, deepstack; TP = 1)."""

from __future__ import annotations

import sys
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist

from tests.vision_hf.qwen3_vl_models import CPU_ARGS, EVEN_TEXT, GRIDS, image_prompt, pixels


def main(path: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mcore_npu.integrations.hf import (
        build_model,
        export_hf_weights,
        load_hf_weights,
        npu_bridge,
    )
    from mcore_npu.training import cpu_support

    cpu_support.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(2, 1)
    cpu_support.seed_cpu_streams(1, tp_rank=parallel_state.get_tensor_model_parallel_rank())
    bridge = npu_bridge(path, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, path, bridge=bridge)
    exported = {name: tensor.detach().cpu() for name, tensor in export_hf_weights(model, bridge)}
    with torch.no_grad():
        logits = model(
            image_prompt(GRIDS, EVEN_TEXT),
            pixel_values=pixels(GRIDS),
            image_grid_thw=torch.tensor(GRIDS),
        )
    logits = gather_from_tensor_model_parallel_region(logits)
    if dist.get_rank() == 0:
        saved = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            saved.update(safetensors.torch.load_file(file))
        same = sorted(saved) == sorted(exported)
        equal = same and all(torch.equal(saved[n], exported[n]) for n in saved)
        print(f"TP_EXPORT {len(exported)} {same} {equal}", flush=True)
        want = torch.load(Path(path) / "tp1_logits.pt")
        print(f"TP_LOGITS {(logits - want).abs().max().item():.3e}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
