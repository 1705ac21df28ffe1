"""``mcore-npu train`` with the plugin's precision-aware Adam and CPU offload: real megatron-core,
its ``DistributedOptimizer``, real ``dist_checkpointing``, CPU processes (gloo).

The reference of every comparison is Megatron's own distributed Adam (``get_megatron_optimizer``
over torch's ``AdamW``, no offload) on the same config, measured in the same launch. Three
launches for the whole module (:func:`runs`): the straight runs and the first halves of the
resumed ones (saved at step :data:`SAVE_AT`); the second halves, in a fresh process; DP=2 and TP=2
under torchrun.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import layout_runs, max_abs_diff, read_metrics, reported

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS, SAVE_AT = 5, 3
DIST = ["optimizer.use_distributed_optimizer=true", "train.progress=false"]
PA = ["optimizer.use_precision_aware_optimizer=true"]


def _offload(fraction: float, overlap: bool) -> list[str]:
    return ["optimizer.optimizer_cpu_offload=true",
            f"optimizer.optimizer_offload_fraction={fraction}",
            f"optimizer.overlap_cpu_optimizer_d2h_h2d={str(overlap).lower()}"]  # fmt: skip


# variant -> overrides; each must give Megatron's distributed Adam's losses and parameters
VARIANTS = {
    "precision_aware_fp32": PA,
    "offload_1": _offload(1.0, overlap=False),
    "offload_0.9_overlap": _offload(0.9, overlap=True),
    "offload_0.4": _offload(0.4, overlap=False),
    "offload_0.4_overlap": _offload(0.4, overlap=True),
    "both_0.9_overlap": PA + _offload(0.9, overlap=True),
    "both_0.4": PA + _offload(0.4, overlap=False),
}
MODELS = {"gpt": "gpt_tiny.yaml", "moe": "gpt_tiny_moe.yaml"}
BF16_STEPS = 20
BF16 = {  # a bf16 model: Megatron's fp32 main weights, then the plugin's fp32 master (remainders)
    "megatron": [],
    "precision_aware": PA,
    "bf16_moments": [*PA, "optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16"],
    "bf16_moments_grads": [*PA, "optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16",
                           "optimizer.main_grads_dtype=bf16"],
}  # fmt: skip
PARALLEL = {"dp2": [], "tp2": ["parallel.tensor=2"]}


def _run(name: str, overrides: list[str], folder, steps: int = STEPS) -> list:
    return [name, [*DIST, *overrides, f"train.steps={steps}",
                   f"train.metrics_file={folder / (name + '.jsonl')}"]]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{model: {"straight": stdout, "resumed": stdout}}, "parallel": stdout, "folder": path}."""
    folder = tmp_path_factory.mktemp("adam_runs")
    out: dict = {"folder": folder}
    for model, config in MODELS.items():
        straight, first, second = [], [], []
        for variant, overrides in {"megatron": [], **VARIANTS}.items():
            name = f"{model}-{variant}"
            straight.append(_run(name, overrides, folder))
            ckpt = [f"train.checkpoint_dir={folder / ('ckpt-' + name)}"]
            first.append(
                _run(
                    f"{name}-resumed", [*overrides, *ckpt, f"train.exit_interval={SAVE_AT}"], folder
                )
            )
            second.append(_run(f"{name}-resumed", [*overrides, *ckpt, "train.resume=true"],
                               folder))  # fmt: skip
        if model == "gpt":
            straight += [_run(f"bf16-{name}", [*extra, "train.dtype=bf16"], folder, BF16_STEPS)
                         for name, extra in BF16.items()]  # fmt: skip
        out[model] = {"straight": layout_runs(config, straight + first),
                      "resumed": layout_runs(config, second)}  # fmt: skip
    both = VARIANTS["both_0.4"]
    parallel = [_run(f"gpt-{name}", [*both, *extra], folder) for name, extra in PARALLEL.items()]
    out["parallel"] = layout_runs(MODELS["gpt"], parallel, nproc=2)
    return out


def _losses(folder, name: str) -> list[float]:
    return [row["loss"] for row in read_metrics(folder / f"{name}.jsonl")]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_equals_megatrons_distributed_adam(runs, model, variant):
    folder, stdout = runs["folder"], runs[model]["straight"]
    reference = _losses(folder, f"{model}-megatron")
    losses = _losses(folder, f"{model}-{variant}")
    assert len(reference) == len(losses) == STEPS
    assert max_abs_diff(reference, losses) <= 1e-6, (reference, losses)
    assert reported(stdout, f"{model}-{variant}", "params") == reported(
        stdout, f"{model}-megatron", "params"
    )
    state = json.loads(reported(stdout, f"{model}-{variant}", "optimizer state"))
    offloaded = "optimizer_cpu_offload=true" in " ".join(VARIANTS[variant])
    assert state and (state["host"] > 0) == offloaded, state  # the plugin's Adam ran
    assert json.loads(reported(stdout, f"{model}-megatron", "optimizer state")) == {}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", ["megatron", *VARIANTS])
def test_resume_in_a_fresh_process_is_exact(runs, model, variant):
    folder = runs["folder"]
    straight = _losses(folder, f"{model}-{variant}")
    resumed = _losses(folder, f"{model}-{variant}-resumed")  # steps 1-3, then 4-5 (new process)
    assert len(resumed) == STEPS
    assert resumed == straight
    params = reported(runs[model]["resumed"], f"{model}-{variant}-resumed", "params")
    assert params == reported(runs[model]["straight"], f"{model}-{variant}", "params")


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_layouts_equal_one_process(runs, layout):
    folder = runs["folder"]
    one = _losses(folder, "gpt-both_0.4")
    many = _losses(folder, f"gpt-{layout}")
    assert len(many) == STEPS
    assert max_abs_diff(one, many) <= 1e-5, (one, many)
    expected = {"dp2": {"tp": 1, "dp": 2}, "tp2": {"tp": 2, "dp": 1}}[layout]
    sizes = json.loads(reported(runs["parallel"], f"gpt-{layout}", "layout"))
    assert {k: sizes[k] for k in expected} == expected


@pytest.mark.parametrize("variant", [name for name in BF16 if name != "megatron"])
def test_bf16_model_trains_like_the_fp32_state_run(runs, variant):
    """Each step's loss within 2 % of the run with fp32 Adam state (Megatron's, for the
    precision-aware run; the precision-aware fp32-moment run for the bf16 moments)."""
    folder = runs["folder"]
    base = "megatron" if variant == "precision_aware" else "precision_aware"
    reference, losses = _losses(folder, f"bf16-{base}"), _losses(folder, f"bf16-{variant}")
    assert len(reference) == len(losses) == BF16_STEPS
    assert all(abs(a - b) <= 0.02 * abs(a) for a, b in zip(reference, losses, strict=True))
    assert losses[-1] < 0.8 * losses[0]  # it learns
    state = json.loads(reported(runs["gpt"]["straight"], f"bf16-{variant}", "optimizer state"))
    numel_bytes = {"precision_aware": 10, "bf16_moments": 6, "bf16_moments_grads": 6}[variant]
    assert state["device"] % numel_bytes == 0 and state["host"] == 0
