"""The YAML schema: loading, overrides, bases and every refusal (before any process starts)."""

from __future__ import annotations

import pytest

from mcore_npu.training.config import ConfigError, load_config
from tests.launch import ROOT

CONFIGS = ROOT / "configs"

BAD = [
    # (override or YAML text, key named in the message)
    (["model.num_layers=abc"], "model.num_layers"),
    (["model.num_layers=-2"], "model.num_layers"),
    (["model.hidden_size=130"], "model.num_attention_heads"),
    (["model.num_query_groups=3"], "model.num_query_groups"),
    (["parallel.tensor=3"], "parallel.tensor"),
    (
        [
            "parallel.tensor=2",
            "model.num_query_groups=1",
            "model.num_attention_heads=3",
            "model.hidden_size=96",
        ],
        "parallel.tensor",
    ),
    (["parallel.pipeline=3"], "parallel.tensor"),  # world size 2 is not divisible by 3
    (["attention.backend=npu"], "attention.backend"),
    (["attention.kernel=cuda"], "attention.kernel"),
    (["model.param_layout=megatron"], "model.param_layout"),
    (["attention.backend=local", "attention.kernel=reference"], "attention.kernel"),
    (["parallel.context=2", "parallel.cp_comm_type=ring"], "parallel.cp_comm_type"),
    (["parallel.context=2", "parallel.cp_comm_type=a2a+p2p"], "parallel.cp_comm_type"),
    (["parallel.context=2", "attention.backend=local"], "parallel.context"),
    (["parallel.context=2", "train.seq_length=126"], "train.seq_length"),
    (
        ["parallel.context=2", "data.pack_sequences=true", "model.window_size=[4,0]"],
        "model.window_size",
    ),  # p2p: no sliding windows on packed batches
    (
        [
            "parallel.context=2",
            "parallel.cp_comm_type=all_gather",
            "data.pack_sequences=true",
            "train.seq_length=126",
        ],
        "train.seq_length",
    ),  # fmt: skip
    (["parallel.context=2", "model.attention_dropout=0.1"], "model.attention_dropout"),
    (["parallel.context=2", "model.cp_comm_type=a2a+p2p"], "model.cp_comm_type"),  # parallel.*
    (
        ["parallel.context=2", "model.hierarchical_context_parallel_sizes=[2,1]"],
        "model.hierarchical_context_parallel_sizes",
    ),  # a2a+p2p is not built
    (
        ["parallel.context=2", "parallel.cp_comm_type=a2a", "model.num_query_groups=1"],
        "model.num_query_groups",
    ),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (
        ["parallel.tensor=2", "parallel.sequence_parallel=true", "attention.backend=local"],
        "parallel.sequence_parallel",
    ),
    (["train.global_batch_size=6"], "train.global_batch_size"),
    (["train.seq_length=512"], "train.seq_length"),
    (["train.dtype=fp8"], "train.dtype"),
    (["train.lr=-1"], "train.lr"),
    (["train.resume=true"], "train.resume"),
    (["train.init_from=/nonexistent/checkpoint"], "train.init_from"),
    (["model.vocab_size=100"], "model.vocab_size"),
    (["model.vocab_size=265", "parallel.tensor=2"], "model.vocab_size"),
    (["model.num_layer=3"], "model.num_layer"),
    (["model.apply_query_key_layer_scaling=3"], "model.apply_query_key_layer_scaling"),
    (["model.init_method=foo"], "model.init_method"),
    (["trian.steps=3"], "trian"),
    (["train.stesp=3"], "train.stesp"),
    (["model.attention_dropout=1.5"], "model.attention_dropout"),
    (["model.window_size=[3]"], "model.window_size"),
    (["data.path=/nonexistent.txt"], "data.path"),
    (["train.steps=-1"], "train.steps"),
    (["model.activation=tanh"], "model.activation"),
    (["data.pack_sequences=true", "attention.backend=local"], "data.pack_sequences"),
    (
        ["parallel.tensor=2", "parallel.sequence_parallel=true", "attention.backend=auto"],
        "parallel.sequence_parallel",
    ),  # auto resolves to local on this CPU machine
    (["attention.backend=te"], "attention.backend"),  # transformer-engine is not installed here
    (["model.tensor_model_parallel_size=2"], "model.tensor_model_parallel_size"),
    (["model.bf16=true"], "model.bf16"),
    (["model.extra.num_layers=7"], "model.extra.num_layers"),
    (["train.timeout_s=-5"], "train.timeout_s"),
]


@pytest.mark.parametrize("overrides, key", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "gpt_tiny.yaml", overrides, world_size=2)
    assert info.value.key == key or str(info.value).startswith(f"config {key}"), str(info.value)
    assert str(info.value).startswith(f"config {key}")


def test_at_least_fifteen_distinct_refusals():
    assert len({key for _, key in BAD}) >= 15


def test_suggestions_point_to_the_nearest_name():
    with pytest.raises(ConfigError, match="did you mean 'num_layers'"):
        load_config(None, ["model.num_layer=3"])
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        load_config(None, ["train.stesp=3"])
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        load_config(None, ["trian.steps=3"])


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_packed_sequences_and_windows_validate_under_context_parallelism(comm):
    overrides = ["parallel.context=2", f"parallel.cp_comm_type={comm}", "data.pack_sequences=true"]
    window = ["model.window_size=[16,0]"]
    cfg = load_config(CONFIGS / "gpt_tiny.yaml", overrides, world_size=2)
    assert cfg.parallel.context == 2 and cfg.data.pack_sequences
    if comm == "p2p":  # the ring computes windows on unpacked batches only
        load_config(CONFIGS / "gpt_tiny.yaml", [*overrides[:2], *window], world_size=2)
        with pytest.raises(ConfigError, match="parallel.cp_comm_type='a2a' or 'all_gather'"):
            load_config(CONFIGS / "gpt_tiny.yaml", [*overrides, *window], world_size=2)
    else:
        cfg = load_config(CONFIGS / "gpt_tiny.yaml", [*overrides, *window], world_size=2)
        assert list(cfg.model.window_size) == [16, 0]


def test_overrides_apply_on_top_of_yaml():
    cfg = load_config(CONFIGS / "gpt_tiny.yaml", ["train.steps=7", "attention.backend=local",
                                                   "model.window_size=[16,0]"])  # fmt: skip
    assert cfg.train.steps == 7 and cfg.attention.backend == "local"
    assert list(cfg.model.window_size) == [16, 0]
    assert cfg.model.num_layers == 2  # from the file


def test_transformer_config_fields_pass_through_to_extra():
    cfg = load_config(
        None, ["model.apply_query_key_layer_scaling=true", "model.layernorm_epsilon=1e-6"]
    )
    assert dict(cfg.model.extra) == {
        "apply_query_key_layer_scaling": True,
        "layernorm_epsilon": 1e-6,
    }


def test_base_files_are_merged(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  num_layers: 4\ntrain:\n  steps: 3\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.model.num_layers == 4 and cfg.train.steps == 9


def test_unsafe_yaml_is_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("train: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("name", ["gpt_tiny.yaml", "gpt_tiny_tp2.yaml", "gpt_tiny_pp2.yaml"])
def test_shipped_configs_validate(name):
    world = 1 if name == "gpt_tiny.yaml" else 2
    cfg = load_config(CONFIGS / name, world_size=world)
    assert cfg.attention.backend == "npu_fusion" and cfg.memory.expandable_segments


def test_ascend_example_validates_for_its_cluster():
    cfg = load_config(CONFIGS / "ascend_llama_8b_32k.yaml", world_size=16)
    assert cfg.train.dtype == "bf16" and cfg.data.pack_sequences
    assert cfg.train.seq_length == 32768 and cfg.memory.expandable_segments


def test_ascend_128k_variant_validates_with_context_parallelism():
    """The 128k variant: the 32k config's model and TP x PP, CP=4 ring (32k tokens per rank)."""
    from mcore_npu.training.model import transformer_config

    base = load_config(CONFIGS / "ascend_llama_8b_32k.yaml", world_size=16)
    cfg = load_config(CONFIGS / "ascend_llama_8b_128k.yaml", world_size=64)
    assert cfg.train.seq_length == 131072 == cfg.model.max_sequence_length
    assert (cfg.parallel.context, cfg.parallel.cp_comm_type) == (4, "p2p")
    assert cfg.train.seq_length // cfg.parallel.context == base.train.seq_length
    assert (cfg.parallel.tensor, cfg.parallel.pipeline) == (
        base.parallel.tensor,
        base.parallel.pipeline,
    )
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups"):
        assert getattr(cfg.model, key) == getattr(base.model, key), key
    assert cfg.train.dtype == "bf16" and cfg.memory.expandable_segments
    config = transformer_config(cfg)
    assert config.context_parallel_size == 4 and config.cp_comm_type == "p2p"
    with pytest.raises(ConfigError, match="model.num_query_groups"):  # 1 KV group per TP rank
        load_config(CONFIGS / "ascend_llama_8b_128k.yaml", ["parallel.cp_comm_type=a2a"],
                    world_size=64)  # fmt: skip


# ---------------------------------------------------------------- MoE, expert parallel, fused ops

MOE_BAD = [
    (["parallel.expert=2"], "parallel.expert"),  # gpt_tiny has no experts
    (["model.num_moe_experts=3", "parallel.expert=2"], "parallel.expert"),
    (["model.num_moe_experts=4", "parallel.expert=4"], "parallel.expert"),  # dp is 2
    (["parallel.expert=0"], "parallel.expert"),
    (["model.expert_model_parallel_size=2"], "model.expert_model_parallel_size"),
    (["fused.rms_norm=npu"], "fused.rms_norm"),
    (["fused.swiglu=fast"], "fused.swiglu"),
    (["fused.grouped_matmul=cuda"], "fused.grouped_matmul"),
    (["attention.backend=local", "fused.swiglu=reference"], "fused.swiglu"),
    (["fused.rmsnorm=off"], "fused.rmsnorm"),
]


@pytest.mark.parametrize("overrides, key", MOE_BAD, ids=[" ".join(o) for o, _ in MOE_BAD])
def test_bad_moe_or_fused_config_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "gpt_tiny.yaml", overrides, world_size=2)
    assert str(info.value).startswith(f"config {key}"), str(info.value)


def test_tiny_moe_config_validates_for_one_and_two_expert_ranks():
    from mcore_npu.training.model import transformer_config

    cfg = load_config(CONFIGS / "gpt_tiny_moe.yaml", ["parallel.expert=2"], world_size=2)
    assert cfg.model.extra.num_moe_experts == 4 and cfg.model.extra.moe_router_topk == 2
    assert cfg.parallel.expert == 2 and cfg.fused.grouped_matmul is None
    config = transformer_config(cfg)
    assert config.expert_model_parallel_size == 2 and config.num_moe_experts == 4


def test_fused_off_survives_yamls_boolean_reading(tmp_path):
    (tmp_path / "off.yaml").write_text("fused:\n  grouped_matmul: off\n  swiglu: 'off'\n")
    cfg = load_config(tmp_path / "off.yaml", ["fused.rms_norm=off"])
    assert cfg.fused.grouped_matmul == cfg.fused.swiglu == cfg.fused.rms_norm == "off"


def test_qwen3_moe_example_validates_for_its_cluster():
    from mcore_npu.training.model import transformer_config

    cfg = load_config(CONFIGS / "ascend_qwen3_moe_30b_a3b.yaml", world_size=16)
    assert cfg.fused.rms_norm == cfg.fused.swiglu == cfg.fused.grouped_matmul == "torch_npu"
    assert cfg.parallel.expert == 8 and cfg.train.dtype == "bf16"
    config = transformer_config(cfg)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (
        128, 8, 768)  # fmt: skip
    assert config.kv_channels == 128 and config.qk_layernorm
    with pytest.raises(ConfigError, match="parallel.expert"):
        load_config(CONFIGS / "ascend_qwen3_moe_30b_a3b.yaml", world_size=8)  # dp 4 < 8 experts
