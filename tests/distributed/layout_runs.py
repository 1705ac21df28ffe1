"""Test-only entry point: several runs of the real trainer, one after another, in one process or
one torchrun launch (one rendezvous and one import of Megatron for all of them).

    [torchrun --standalone --nproc-per-node N] -m tests.distributed.layout_runs CONFIG RUNS_JSON

``RUNS_JSON`` is a JSON list of ``[name, [override, ...]]``. Each run is
``Trainer(load_config(CONFIG, overrides)).train()``, the object ``mcore-npu train`` runs; between
runs Megatron's parallel state is destroyed and the process group kept, so every run sets up its
own parallel layout. After each run rank 0 prints ``layout_runs: <name> layout: {...}`` (the
tensor / context / expert / data-parallel sizes Megatron's parallel state had, and whether
sequence parallelism was on) and ``layout_runs: <name> modules: ...`` (the classes of the last
decoder layer's attention, router and experts: what the run trained) and, for each pipeline
stage, ``layout_runs: <name> stage <R> layers: [n, ...]`` (the decoder layers that stage
built). Exit 0 when every run finished, 1 with the traceback otherwise.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback

import torch.distributed as dist

from mcore_npu._warnings import hide_known_harmless_warnings
from mcore_npu.training import runtime
from mcore_npu.training.config import load_config
from mcore_npu.training.train import Trainer


def _modules(trainer: Trainer) -> str:
    """``attention=..., router=..., experts=...`` of the model's last decoder layer."""
    layer = trainer.model.module.decoder.layers[-1]
    mlp = layer.mlp
    parts = {"attention": type(layer.self_attention).__name__,
             "router": type(getattr(mlp, "router", None)).__name__,
             "experts": type(getattr(mlp, "experts", None)).__name__}  # fmt: skip
    return ", ".join(f"{key}={value}" for key, value in parts.items())


def _layout(trainer: Trainer) -> dict:
    from megatron.core import parallel_state as mpu

    return {"tp": mpu.get_tensor_model_parallel_world_size(),
            "cp": mpu.get_context_parallel_world_size(),
            "ep": mpu.get_expert_model_parallel_world_size(),
            "dp": mpu.get_data_parallel_world_size(),
            "sp": bool(trainer.config.sequence_parallel)}  # fmt: skip


def _stage(trainer: Trainer) -> str | None:
    """``stage <pipeline rank> layers: [n, ...]`` (Megatron's 1-based ``layer_number`` s of the
    decoder layers this stage built) on one rank per stage (tensor, context and data rank 0);
    None on the others."""
    from megatron.core import parallel_state as mpu

    if mpu.get_tensor_model_parallel_rank() or mpu.get_data_parallel_rank(
        with_context_parallel=True
    ):
        return None
    numbers = [layer.layer_number for layer in trainer.model.module.decoder.layers]
    return f"stage {mpu.get_pipeline_model_parallel_rank()} layers: {numbers}"


def run_one(config: str, name: str, overrides: list[str]) -> None:
    from megatron.core import parallel_state

    trainer = Trainer(load_config(config, overrides))
    try:
        summary = trainer.train()
        stages = [None] * dist.get_world_size()  # rank 0 prints them all: no lines run together
        dist.all_gather_object(stages, _stage(trainer))
        if dist.get_rank() == 0:
            for stage in filter(None, stages):
                print(f"layout_runs: {name} {stage}", flush=True)
            print(f"layout_runs: {name} layout: {json.dumps(_layout(trainer))}", flush=True)
            print(f"layout_runs: {name} modules: {_modules(trainer)}", flush=True)
            print(f"layout_runs: {name} {summary.line()}", flush=True)
    finally:
        trainer.close()
    del trainer
    gc.collect()
    parallel_state.destroy_model_parallel()


def main(argv: list[str]) -> int:
    config, runs = argv[0], json.loads(argv[1])
    hide_known_harmless_warnings()
    try:
        for name, overrides in runs:
            run_one(config, name, overrides)
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
