"""verl's SFT loop under torchrun: one verl ``TrainingWorker`` per rank, several layouts in turn.

    torchrun --standalone --nproc-per-node 2 tests/integrations/verl_loop_ranks.py \\
        OUT QWEN3 QWEN3_MOE LAYOUT [LAYOUT ...]

LAYOUT is one of :data:`LAYOUTS`. Per layout, every rank builds a worker whose engine (the
plugin's, picked by verl's registry for ``("npu", "huawei")``) sets up Megatron's parallel state
from verl's own engine config (``MegatronEngine._init_device_mesh``), trains :data:`STEPS` steps
of verl's SFT loss on its data-parallel share of the seeded global batch (what verl's dispatch
would hand it), and writes the metrics it has (verl returns them on the ranks that hold outputs:
last pipeline stage, tensor rank 0) to ``OUT/<layout>.rank<r>.json``. Between layouts Megatron's
parallel state is destroyed; the gloo process group stays. No Ray: verl's worker methods are
called directly, as on the driver of a single-controller run.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> (family, McoreEngineConfig fields); one process of each family is the reference
LAYOUTS = {
    "tp2_sp": ("qwen3", {"tensor_model_parallel_size": 2}),  # vanilla mbridge: SP on at TP > 1
    "pp2": ("qwen3", {"pipeline_model_parallel_size": 2}),
    "dp2": ("qwen3", {}),  # the world is the data-parallel group; distributed optimizer
    "ep2": ("qwen3_moe", {"expert_model_parallel_size": 2}),
}
STEPS = 5


def run_layout(name: str, checkpoints: dict[str, str], out: Path) -> None:
    from megatron.core import parallel_state as mpu

    from tests.integrations import verl_loop as loop

    family, engine_fields = LAYOUTS[name]
    settings = loop.FAMILY_SETTINGS[family]  # those of the one-process reference runs
    config = loop.worker_config(checkpoints[family], **settings, **engine_fields)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    engine = worker.engine
    layout = {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "dp": mpu.get_data_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "sp": bool(engine.tf_config.sequence_parallel),
        "distributed_optimizer": bool(engine.engine_config.use_distributed_optimizer),
    }
    metrics = loop.train_sft(worker, STEPS, dp_rank=engine.get_data_parallel_rank(),
                             dp_size=engine.get_data_parallel_size())  # fmt: skip
    record = {
        "layout": layout,
        "engine": type(engine).__name__,
        "losses": [m["loss"] for m in metrics] if metrics[0] is not None else None,
        "grad_norms": [m["grad_norm"] for m in metrics] if metrics[0] is not None else None,
    }
    (out / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
    del worker, engine
    gc.collect()
    mpu.destroy_model_parallel()


def main(argv: list[str]) -> int:
    out, qwen3, qwen3_moe, *layouts = argv
    from mcore_npu.training import cpu_support

    cpu_support.apply()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        for name in layouts:
            run_layout(name, {"qwen3": qwen3, "qwen3_moe": qwen3_moe}, Path(out))
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
