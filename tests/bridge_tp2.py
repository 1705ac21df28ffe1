"""The body of the TP = 2 bridge checks (``tests/nemotron/tp_export.py``,
``tests/vision_hf/tp_run.py``), run by each rank under ``torchrun --nproc-per-node=2``: the
checkpoint at ``path`` loaded at TP = 2 through the plugin's bridge (``bridge_args``: its extra
config) and exported back, and ``logits(model)`` gathered over TP. Rank 0 prints
``TP_EXPORT <tensors> <names equal> <all torch.equal>`` against the checkpoint's safetensors and
``TP_LOGITS <max |diff|>`` against ``path/tp1_logits.pt`` (the one-process logits)."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist


def check(path: str, bridge_args: dict, logits) -> None:
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
    bridge.set_extra_args(**bridge_args)
    model = build_model(bridge).eval()
    load_hf_weights(model, path, bridge=bridge)
    exported = {name: tensor.detach().cpu() for name, tensor in export_hf_weights(model, bridge)}
    with torch.no_grad():
        got = gather_from_tensor_model_parallel_region(logits(model))
    if dist.get_rank() == 0:
        saved = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            saved.update(safetensors.torch.load_file(file))
        same = sorted(saved) == sorted(exported)
        equal = same and all(torch.equal(saved[n], exported[n]) for n in saved)
        print(f"TP_EXPORT {len(exported)} {same} {equal}", flush=True)
        want = torch.load(Path(path) / "tp1_logits.pt")
        print(f"TP_LOGITS {(got - want).abs().max().item():.3e}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
