"""Checkpoints across parameter layouts: real dist_checkpointing, real Megatron models (one gloo
process, CPU); the training runs go through the trainer in a child process."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.training import checkpointing
from mcore_npu.transformer.param_layout import other_names
from tests.launch import assert_ok, max_abs_diff, train
from tests.transformer.megatron_models import gpt, tiny_config

pytestmark = pytest.mark.cpu_only
MOE = dict(num_moe_experts=2, moe_router_topk=2, moe_ffn_hidden_size=64, moe_layer_freq=[0, 1],
           moe_token_dispatcher_type="allgather", normalization="LayerNorm")  # fmt: skip


def _model(layout, seed, **config):
    """``layout`` "local" | "te" | "te-grouped" (moe_grouped_gemm: TEGroupedMLP's names)."""
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    if layout == "te-grouped":
        layout, config = "te", {**config, "moe_grouped_gemm": True}
    config = tiny_config(**config)
    spec = get_gpt_decoder_block_npu_spec(config, kernel="reference", param_layout=layout,
                                          normalization=config.normalization)  # fmt: skip
    return gpt(config, spec, seed=seed)


@pytest.mark.usefixtures("megatron_runtime")
@pytest.mark.parametrize(
    "saved, loaded",
    [("local", "te"), ("te", "local"), ("local", "te-grouped"), ("te-grouped", "te")],
)
def test_every_tensor_crosses_layouts_dense_and_moe(tmp_path, saved, loaded):
    """Grouped experts write SequentialMLP's keys (TEGroupedMLP's promise), their per-expert
    ``_extra_state{e}`` objects included, and load them back with ``strict=True``."""
    source, target = _model(saved, 1, **MOE), _model(loaded, 2, **MOE)
    path = checkpointing.save({"model": source.sharded_state_dict()}, tmp_path, 1)
    state = checkpointing.match_layout(target.sharded_state_dict(), path)
    target.load_state_dict(checkpointing.load({"model": state}, path)["model"])
    sources = dict(source.named_parameters())
    for name, param in target.named_parameters():  # each target tensor equals its source's
        if name not in sources:  # a fused norm, or a grouped expert's weight
            name = next(n for n in [*other_names(name), _other_expert_name(name)] if n in sources)
        torch.testing.assert_close(param, sources[name], rtol=0, atol=0, msg=name)


def _other_expert_name(name: str) -> str:
    """``...experts.linear_fc1.weight3`` <-> ``...experts.local_experts.3.linear_fc1.weight``."""
    head, sep, tail = name.partition(".experts.")
    if not sep:
        return name
    if tail.startswith("local_experts."):
        _, e, which, _ = tail.split(".")
        return f"{head}.experts.{which}.weight{e}"
    which, _, e = tail.partition(".weight")
    return f"{head}.experts.local_experts.{e}.{which}.weight"


@pytest.mark.usefixtures("megatron_runtime")
def test_unmatched_checkpoint_tensor_is_named(tmp_path):
    source, target = _model("local", 1), _model("te", 2, qk_layernorm=False)
    path = checkpointing.save({"model": source.sharded_state_dict()}, tmp_path, 1)
    with pytest.raises(ValueError, match="no model tensor takes") as err:
        checkpointing.match_layout(target.sharded_state_dict(), path)
    assert "decoder.layers.self_attention.q_layernorm.weight" in str(err.value)
    with pytest.raises(ValueError, match="model tensors with no checkpoint tensor: none"):
        checkpointing.match_layout(target.sharded_state_dict(), path)


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """6 steps in each layout, saving at steps 3 and 6; ``latest`` then points back to step 3."""
    tmp = tmp_path_factory.mktemp("layouts")
    runs = {}
    for layout in ("local", "te"):
        overrides = [
            "train.steps=6",
            "attention.backend=npu_fusion",
            "train.save_interval=3",
            f"model.param_layout={layout}",
            f"train.checkpoint_dir={tmp / layout}",
        ]
        runs[layout] = assert_ok(train(overrides, metrics=tmp / f"{layout}.jsonl"))
        (tmp / layout / checkpointing.LATEST).write_text(checkpointing.step_dir("", 3).name)
    return tmp, runs


@pytest.mark.parametrize("saved, loaded", [("local", "te"), ("te", "local")])
def test_training_resumes_across_layouts(straight_runs, saved, loaded):
    tmp, runs = straight_runs
    overrides = [
        "train.steps=6",
        "attention.backend=npu_fusion",
        "train.resume=true",
        f"model.param_layout={loaded}",
        f"train.checkpoint_dir={tmp / saved}",
    ]
    resumed = assert_ok(train(overrides, metrics=tmp / f"{saved}-{loaded}.jsonl"))
    assert len(resumed.losses) == 3  # steps 4..6, with the saved optimizer state
    assert max_abs_diff(resumed.losses, runs[saved].losses[3:]) <= 1e-5
