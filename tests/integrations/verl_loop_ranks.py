"""verl's SFT loop under torchrun: one verl ``TrainingWorker`` per rank, several layouts in turn.

    torchrun --standalone --nproc-per-node 2 tests/integrations/verl_loop_ranks.py \\
        OUT QWEN3 QWEN3_MOE DEEPSEEK_V3 RUN [RUN ...]

RUN is a layout of :data:`LAYOUTS`, optionally with a precision: ``tp2_sp`` (fp32, the default)
or ``tp2_sp@bf16`` (:data:`DTYPES`), or ``deepseek_tp2`` (:func:`deepseek_tp2`: the DeepSeek-V3
checkpoint through the plugin's bridge at TP=2, no verl worker), or ``qwen3_5_tp2=PATH``
(:func:`qwen3_5_tp2`: a tiny Qwen3.5 checkpoint the same way), or ``qwen3_5_hub_cp2=PATH``
(:func:`qwen3_5_hub_cp2`: a Qwen3.5 hub checkpoint's log-probs through verl at CP=2, bshd), or
``qwen3_vl=PATH`` (:func:`qwen3_vl_layouts`: the tiny Qwen3-VL with images at TP=2 and PP=2), or
``replay_layouts`` (:func:`replay_layouts`: verl's R2 router replay at PP=2 and EP=2).
fp32 is a test oracle verl's config refuses
(``verl_loop.force_fp32``); bf16 is how verl runs. Per run, every rank builds a worker whose
engine (the plugin's, picked by verl's registry for ``("npu", "huawei")``) sets up Megatron's
parallel state from verl's own engine config (``MegatronEngine._init_device_mesh``), trains
:data:`STEPS` steps of verl's SFT loss on its data-parallel share of the seeded global batch
(what verl's dispatch would hand it), and writes the metrics it has (verl returns them on the
ranks that hold outputs: last pipeline stage, tensor rank 0) to ``OUT/<run>.rank<r>.json``.

The run :data:`RESUME` goes on: ``save_checkpoint`` after step :data:`STEPS` (into
``OUT/<run>.checkpoint``), :data:`STEPS` more steps (the uninterrupted run), then on every rank
the worker is dropped, a fresh one is built with the same config, ``load_checkpoint`` reads the
checkpoint and trains the same :data:`STEPS` steps again; the record holds both loss lists and the
Adam step counters of the fresh worker after the load.

Between runs Megatron's parallel state is destroyed; the gloo process group stays. No Ray:
verl's worker methods are called directly, as on the driver of a single-controller run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> (family, worker_config keywords: McoreEngineConfig fields, remove_padding); one process
# of each family (thd) is the reference
LAYOUTS = {
    "tp2_sp": ("qwen3", {"tensor_model_parallel_size": 2}),  # vanilla mbridge: SP on at TP > 1
    "pp2": ("qwen3", {"pipeline_model_parallel_size": 2}),
    "dp2": ("qwen3", {}),  # the world is the data-parallel group; distributed optimizer
    "ep2": ("qwen3_moe", {"expert_model_parallel_size": 2}),
    # bshd under context parallelism: the engine's own forward splits every row zigzag
    "cp2_bshd": ("qwen3", {"context_parallel_size": 2, "remove_padding": False}),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
STEPS = 5
RESUME = "dp2@bf16"  # DP=2, the distributed optimizer sharded over both ranks, as verl runs it


def parse_run(run: str) -> tuple[str, str]:
    """``"tp2_sp@bf16"`` -> ``("tp2_sp", "bfloat16")``; no ``@``: fp32."""
    name, _, precision = run.partition("@")
    if name not in LAYOUTS or (precision or "fp32") not in DTYPES:
        raise ValueError(f"run: {run!r}; use LAYOUT[@PRECISION], {list(LAYOUTS)} x {list(DTYPES)}")
    return name, DTYPES[precision or "fp32"]


def _losses(metrics) -> list[float] | None:
    return [m["loss"] for m in metrics] if metrics[0] is not None else None


def _resume(worker, config, checkpoint: Path, train) -> dict:
    """Save after this worker's :data:`STEPS` steps, train on (the uninterrupted run), then a
    fresh worker loads the checkpoint and trains the same steps."""
    from tests.integrations import verl_loop as loop

    worker.save_checkpoint(str(checkpoint), global_step=STEPS)
    uninterrupted = _losses(train(worker))
    del worker
    gc.collect()
    fresh = loop.new_worker(config, loop.sft_loss_fn())  # the same parallel state (verl reuses it)
    fresh.load_checkpoint(str(checkpoint))
    steps = [
        state["step"]
        for member in fresh.engine.optimizer.chained_optimizers
        for state in member.optimizer.state.values()
    ]
    record = {  # the counters as loaded (Adam then adds to them in place)
        "steps": sorted({float(step) for step in steps}),
        "step_tensors": [len(steps), len({id(step) for step in steps})],
    }
    record.update(uninterrupted=uninterrupted, resumed=_losses(train(fresh)))
    del fresh
    gc.collect()
    return record


def run_layout(run: str, checkpoints: dict[str, str], out: Path) -> None:
    from megatron.core import parallel_state as mpu

    from tests.integrations import verl_loop as loop

    name, dtype = parse_run(run)
    family, fields = LAYOUTS[name]
    settings = loop.FAMILY_SETTINGS[family]  # those of the one-process reference runs
    config = loop.worker_config(checkpoints[family], **settings, **fields, dtype=dtype)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    engine = worker.engine
    layout = {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "dp": mpu.get_data_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "cp": mpu.get_context_parallel_world_size(),
        "sp": bool(engine.tf_config.sequence_parallel),
        "distributed_optimizer": bool(engine.engine_config.use_distributed_optimizer),
        "params_dtype": str(engine.tf_config.params_dtype),
        "model_dtype": str(next(engine.module[0].parameters()).dtype),
    }

    def train(w):
        return loop.train_sft(w, STEPS, dp_rank=w.engine.get_data_parallel_rank(),
                              dp_size=w.engine.get_data_parallel_size())  # fmt: skip

    own_steps, own_step = [], engine._mask_free_step  # a spy: the engine's own forward ran?

    def counting(*args, **kwargs):
        own_steps.append(1)
        return own_step(*args, **kwargs)

    engine._mask_free_step = counting
    metrics = train(worker)
    record = {
        "layout": layout,
        "engine": type(engine).__name__,
        "own_forward_steps": len(own_steps),
        "losses": _losses(metrics),
        "grad_norms": [m["grad_norm"] for m in metrics] if metrics[0] is not None else None,
    }
    del engine
    if run == RESUME:
        record["resume"] = _resume(worker, config, out / f"{run}.checkpoint", train)
    (out / f"{run}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
    del worker
    gc.collect()
    mpu.destroy_model_parallel()


DEEPSEEK_CPU_ARGS = dict(use_cpu_initialization=True, masked_softmax_fusion=False,
                         bias_activation_fusion=False, bias_dropout_fusion=False,
                         gradient_accumulation_fusion=False, variable_seq_lengths=False)  # fmt: skip


def deepseek_tp2(path: str, out: Path) -> None:
    """The tiny DeepSeek-V3 checkpoint through the plugin's bridge (mbridge's deepseek_v3
    weight maps) at TP=2 with sequence parallelism, fp32: every rank loads the weights, writes
    the full logits of a fixed batch (``OUT/deepseek_tp2.logits.pt``, rank 0), and records
    the MLA down projections' local shapes and TP attributes and whether the exported weights
    equal the checkpoint's bit for bit (``OUT/deepseek_tp2.rank<r>.json``)."""
    import safetensors.torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from mcore_npu.integrations.hf import (
        build_model,
        export_hf_weights,
        load_hf_weights,
        npu_bridge,
    )
    from mcore_npu.training import cpu_support

    _clear_attention_variables()  # DeepSeek-V3's config: attention_backend=fused
    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    cpu_support.seed_cpu_streams(1, tp_rank=mpu.get_tensor_model_parallel_rank())
    bridge = npu_bridge(path, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**DEEPSEEK_CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, path, bridge=bridge)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(
            model(ids, torch.arange(24).expand(2, 24), None))  # fmt: skip
    saved = safetensors.torch.load_file(str(next(Path(path).glob("*.safetensors"))))
    exported = dict(export_hf_weights(model, bridge))
    attention = model.decoder.layers[0].self_attention
    downs = {name: getattr(attention, name).weight
             for name in ("linear_q_down_proj", "linear_kv_down_proj")}  # fmt: skip
    record = {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "sp": bool(bridge.config.sequence_parallel),
        "down_projections": {
            name: {
                "shape": list(w.shape),
                "tensor_model_parallel": bool(w.tensor_model_parallel),
                "partition_dim": int(w.partition_dim),
            }
            for name, w in downs.items()
        },  # fmt: skip
        "exported_names_equal": exported.keys() == saved.keys(),
        "exported_not_equal": sorted(n for n in saved if not torch.equal(exported[n], saved[n])),
    }
    rank = dist.get_rank()
    if rank == 0:
        torch.save(logits, out / "deepseek_tp2.logits.pt")
    (out / f"deepseek_tp2.rank{rank}.json").write_text(json.dumps(record))
    del model, bridge
    gc.collect()
    mpu.destroy_model_parallel()


QWEN3_5_TP2 = "qwen3_5_tp2="  # the run "qwen3_5_tp2=<checkpoint path>"


def qwen3_5_tp2(path: str, out: Path) -> None:
    """A tiny Qwen3.5 checkpoint (tests/integrations/qwen3_5_models.py) through the plugin's
    bridge (``mcore_npu.integrations.hf_qwen3_5``) at TP=2 with sequence parallelism, fp32:
    every rank loads it (``in_proj`` / ``conv1d`` split section by section, the gated
    ``linear_qkv`` by query group), rank 0 writes the full logits of 24 seeded tokens
    (``OUT/qwen3_5_tp2.logits.pt``), and every rank records whether the exported weights equal
    the checkpoint's bit for bit (``OUT/qwen3_5_tp2.rank<r>.json``)."""
    import safetensors.torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from mcore_npu.integrations.hf import (
        build_model,
        export_hf_weights,
        load_hf_weights,
        npu_bridge,
    )

    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    from mcore_npu.training import cpu_support

    cpu_support.seed_cpu_streams(1, tp_rank=mpu.get_tensor_model_parallel_rank())
    bridge = npu_bridge(path, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**DEEPSEEK_CPU_ARGS)
    _clear_attention_variables()
    model = build_model(bridge).eval()
    load_hf_weights(model, path, bridge=bridge)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(
            model(ids, torch.arange(24)[None], None))  # fmt: skip
    saved = safetensors.torch.load_file(str(next(Path(path).glob("*.safetensors"))))
    exported = dict(export_hf_weights(model, bridge))
    gdn = model.decoder.layers[0].self_attention
    record = {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "sp": bool(bridge.config.sequence_parallel),
        "in_proj_rows": int(gdn.in_proj.weight.shape[0]),
        "exported_names_equal": exported.keys() == saved.keys(),
        "exported_not_equal": sorted(n for n in saved if not torch.equal(exported[n], saved[n])),
    }
    rank = dist.get_rank()
    if rank == 0:
        torch.save(logits, out / "qwen3_5_tp2.logits.pt")
    (out / f"qwen3_5_tp2.rank{rank}.json").write_text(json.dumps(record))
    del model, bridge
    gc.collect()
    mpu.destroy_model_parallel()


QWEN3_5_HUB_CP2 = "qwen3_5_hub_cp2="  # the run "qwen3_5_hub_cp2=<checkpoint path>"
HUB_CP2_LENGTHS = (12, 7, 5)


def qwen3_5_hub_cp2(path: str, out: Path) -> None:
    """A Qwen3.5 hub checkpoint (``vision_config``) through verl's ``TrainingWorker`` at CP=2 in
    bshd with the 32k recipe's keys (``kvallgather_cp_algo``; tests/integrations/gdn_recipes.yaml),
    fp32: verl's log-prob pass (``infer_batch``) over rows of :data:`HUB_CP2_LENGTHS` seeded
    tokens; rank 0 writes the rows (``OUT/qwen3_5_hub_cp2.log_probs.pt``), every rank its layout
    and whether the engine's own forward ran (``OUT/qwen3_5_hub_cp2.rank<r>.json``)."""
    import yaml
    from megatron.core import parallel_state as mpu
    from verl.utils import tensordict_utils as tu

    from tests.integrations import verl_loop as loop
    from tests.integrations.log_probs import packed_batch

    recipes = yaml.safe_load((ROOT / "tests" / "integrations" / "gdn_recipes.yaml").read_text())
    keys = next(r["keys"] for r in recipes["recipes"] if r["name"] == "qwen3_5_moe_32k_kvallgather")
    _clear_attention_variables()
    config = loop.worker_config(path, remove_padding=False, dtype="float32",
                                context_parallel_size=2, override_transformer_config=keys)  # fmt: skip
    worker = loop.new_worker(config, loop.sft_loss_fn())
    own_steps, own_step = [], worker.engine._mask_free_step

    def counting(*args, **kwargs):
        own_steps.append(1)
        return own_step(*args, **kwargs)

    worker.engine._mask_free_step = counting
    data, _ = packed_batch(HUB_CP2_LENGTHS)
    tu.assign_non_tensor(data, compute_loss=False)
    with torch.no_grad():
        result = worker.infer_batch(data)  # verl returns it on CP rank 0
    record = {"cp": mpu.get_context_parallel_world_size(), "own_forward_steps": len(own_steps),
              "cp_comm_type": worker.engine.tf_config.cp_comm_type}  # fmt: skip
    rank = dist.get_rank()
    if rank == 0:
        rows = [row.float() for row in tu.get(result, "log_probs").unbind()]
        torch.save(rows, out / "qwen3_5_hub_cp2.log_probs.pt")
    (out / f"qwen3_5_hub_cp2.rank{rank}.json").write_text(json.dumps(record))
    del worker
    gc.collect()
    mpu.destroy_model_parallel()


QWEN3_VL = "qwen3_vl="
QWEN3_VL_LAYOUTS = {  # vanilla mbridge: SP on at TP > 1; PP: the vision tower on stage 0
    "tp2_sp": ("dense", {"tensor_model_parallel_size": 2}),
    "pp2": ("dense", {"pipeline_model_parallel_size": 2}),
    "ep2": ("moe", {"expert_model_parallel_size": 2}),  # DP=2 too: each rank its 2 rows
    "cp2": ("dense", {"context_parallel_size": 2}),  # thd: each rank its chunks of every row
    "hub_pp2": ("qwen3_5_hub", {"pipeline_model_parallel_size": 2}),  # Qwen3.5: GDN, no deepstack
}


def qwen3_vl_layouts(paths: str, out: Path) -> None:
    """The tiny Qwen3-VL, dense and MoE, and the tiny Qwen3.5 hub checkpoint (``paths``:
    ``DENSE,MOE,HUB``; tests/integrations/qwen3_vl_data.py), through verl's worker at each of :data:`QWEN3_VL_LAYOUTS`, fp32, thd:
    :data:`STEPS` ``train_batch`` steps on the image rows; every rank writes its layout, where
    the vision tower is and its losses (``OUT/qwen3_vl_<layout>.rank<r>.json``)."""
    from megatron.core import parallel_state as mpu

    from tests.integrations import qwen3_vl_data as data
    from tests.integrations import verl_loop as loop

    checkpoints = dict(zip(("dense", "moe", "qwen3_5_hub"), paths.split(","), strict=True))
    for name, (family, fields) in QWEN3_VL_LAYOUTS.items():
        rows = data.family_rows(family)
        config = loop.worker_config(checkpoints[family], micro_batch=len(rows),
                                    dtype="float32", **fields)  # fmt: skip
        worker = loop.new_worker(config, loop.sft_loss_fn())
        model = worker.engine.module[0]
        while not hasattr(model, "language_model"):
            model = model.module
        metrics = data.train(worker, STEPS, rows)
        record = {
            "tp": mpu.get_tensor_model_parallel_world_size(),
            "pp": mpu.get_pipeline_model_parallel_world_size(),
            "pp_rank": mpu.get_pipeline_model_parallel_rank(),
            "ep": mpu.get_expert_model_parallel_world_size(),
            "dp": mpu.get_data_parallel_world_size(),
            "cp": mpu.get_context_parallel_world_size(),
            "sp": bool(worker.engine.tf_config.sequence_parallel),
            "vision": model.vision is not None,
            "losses": _losses(metrics),
        }
        (out / f"qwen3_vl_{name}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
        del worker, model
        gc.collect()
        mpu.destroy_model_parallel()


REPLAY = "replay_layouts"
REPLAY_LAYOUTS = {"pp2": {"pipeline_model_parallel_size": 2},
                  "ep2": {"expert_model_parallel_size": 2},
                  "tp2_sp_bshd": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                  "thd": False},
                  "cp2_bshd": {"context_parallel_size": 2, "thd": False}}  # fmt: skip


def replay_layouts(path: str, out: Path) -> None:
    """verl's R2 on the tiny Qwen3-MoE at each of :data:`REPLAY_LAYOUTS` (thd unless named
    bshd, bf16): record in ``compute_log_prob``, perturb the routers, update with the recorded
    routes (broadcast from the rank that holds verl's output, as the trainer hands them to every
    rank). Every rank writes whether each of its routers took the recorded experts for every
    token in the update (forward hooks), and (thd) whether they are verl's returned routes
    (``OUT/replay_<layout>.rank<r>.json``). bshd under TP/SP or CP: each rank's router sees its
    share of the ``[S, B]`` tokens, compared call by call on the tokens the update replays (the
    record and the update see the same micro-batches; padding routes natively), and ``tokens``
    counts those per layer: over the ranks, every real token once."""
    from megatron.core import parallel_state as mpu

    from tests.integrations import replay_checks as rc
    from tests.integrations import verl_loop as loop

    _clear_attention_variables()
    for name, fields in REPLAY_LAYOUTS.items():
        worker = rc.replay_worker(path, "R2", **fields)
        batch = loop.rollout_batch()
        samples = rc.samples_of(batch)
        with rc.routes_used(worker) as recording:
            recorded = rc.record_routes(worker, batch)
        held = [recorded]
        dist.broadcast_object_list(held, src=_last_holder(recorded is not None))
        rc.perturb_routers(worker)
        with rc.routes_used(worker) as seen, rc.replay_masks(worker) as masks:
            rc.update_with_routes(worker, batch, routes=held[0])
        numbers = _global_router_layers(worker)
        want = rc.recorded_routes(held[0])
        replayed, returned, tokens = [], [], []
        for local, number in enumerate(numbers):
            if fields.get("thd", True):
                before = rc.routes_by_sample(recording, local, samples)[0]
                after = rc.routes_by_sample(seen, local, samples)[0]
                replayed.append(bool(torch.equal(before, after)))
                returned.append(bool(torch.equal(before, want[number])))
            else:  # the real tokens (padding routes natively), call by call
                returned = None  # checked in one process: test_router_replay.py
                before, after = rc.layer_maps(recording, local), rc.layer_maps(seen, local)
                keep = masks[local]
                replayed.append(
                    len(before) == len(after) == len(keep) > 0
                    and all(torch.equal(b[k], a[k]) for b, a, k in zip(before, after, keep))
                )
                tokens.append(sum(int(k.sum()) for k in keep))
        record = {"pp": mpu.get_pipeline_model_parallel_world_size(),
                  "ep": mpu.get_expert_model_parallel_world_size(),
                  "tp": mpu.get_tensor_model_parallel_world_size(),
                  "cp": mpu.get_context_parallel_world_size(),
                  "dp": mpu.get_data_parallel_world_size(), "layers": numbers,
                  "replayed": replayed, "returned": returned, "tokens": tokens,
                  "real": sum(int(t.numel()) for t in samples)}  # fmt: skip
        (out / f"replay_{name}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
        del worker
        gc.collect()
        mpu.destroy_model_parallel()


def _last_holder(holds: bool) -> int:
    """The highest rank that ``holds`` (verl's output: the last pipeline stage)."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, holds)
    return max(rank for rank, flag in enumerate(flags) if flag)


def _global_router_layers(worker) -> list[int]:
    """The global layer number (from 0) of each of this rank's routers, in order (every layer of
    the tiny Qwen3-MoE is an MoE layer)."""
    model = worker.engine.module[0]
    while not hasattr(model, "decoder"):
        model = model.module
    return [layer.layer_number - 1 for layer in model.decoder.layers]


def _clear_attention_variables() -> None:
    """Unset TE's ``NVTE_*_ATTN``: Megatron's LanguageModule writes them for its config's
    attention backend into the process environment and asserts that a later model agrees; the
    earlier runs of this shared launch may have built models with another backend."""
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)


def main(argv: list[str]) -> int:
    out, qwen3, qwen3_moe, deepseek_v3, *runs = argv
    from mcore_npu.training import cpu_support

    cpu_support.apply()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        for run in runs:
            if run == "deepseek_tp2":
                deepseek_tp2(deepseek_v3, Path(out))
                continue
            if run == REPLAY:
                replay_layouts(qwen3_moe, Path(out))
                continue
            if run.startswith(QWEN3_5_TP2):
                qwen3_5_tp2(run[len(QWEN3_5_TP2) :], Path(out))
                continue
            if run.startswith(QWEN3_VL):
                qwen3_vl_layouts(run[len(QWEN3_VL) :], Path(out))
                continue
            if run.startswith(QWEN3_5_HUB_CP2):
                qwen3_5_hub_cp2(run[len(QWEN3_5_HUB_CP2) :], Path(out))
                continue
            run_layout(run, {"qwen3": qwen3, "qwen3_moe": qwen3_moe}, Path(out))
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
