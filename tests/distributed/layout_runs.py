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
built), ``layout_runs: <name> params: <sha256>`` (rank 0's parameters after the last step, bit
for bit) and ``layout_runs: <name> optimizer state: {...}`` (the bytes of the plugin's Adam state
by placement, device and host; ``{}`` for torch's own Adam). Exit 0 when every run finished, 1
with the traceback otherwise.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import traceback

import torch.distributed as dist

from mcore_npu._warnings import hide_known_harmless_warnings
from mcore_npu.optimizer import plugin_adams
from mcore_npu.training import runtime
from mcore_npu.training.config import load_config
from mcore_npu.training.train import Trainer


def _gpt(trainer: Trainer):
    """The ``GPTModel`` inside the DDP wrapper (and ``Float16Module`` under bf16 / fp16)."""
    model = trainer.model.module
    while not hasattr(model, "decoder"):
        model = model.module
    return model


def _modules(trainer: Trainer) -> str:
    """``attention=..., router=..., experts=...`` of the model's last decoder layer."""
    layer = _gpt(trainer).decoder.layers[-1]
    mlp = getattr(layer, "mlp", None)  # a hybrid model's Mamba layer has a mixer instead
    attention = getattr(layer, "self_attention", getattr(layer, "mixer", None))
    parts = {"attention": type(attention).__name__,
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
    numbers = [layer.layer_number for layer in _gpt(trainer).decoder.layers]
    return f"stage {mpu.get_pipeline_model_parallel_rank()} layers: {numbers}"


def _params_digest(trainer: Trainer) -> str:
    digest = hashlib.sha256()
    for param in trainer.model.module.parameters():
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def _state_bytes(trainer: Trainer) -> dict:
    totals: dict[str, int] = {}
    for adam in plugin_adams(trainer.optimizer):
        for where, count in adam.state_bytes().items():
            totals[where] = totals.get(where, 0) + count
    return totals


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
            print(f"layout_runs: {name} params: {_params_digest(trainer)}", flush=True)
            state = json.dumps(_state_bytes(trainer))
            print(f"layout_runs: {name} optimizer state: {state}", flush=True)
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
