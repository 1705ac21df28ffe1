"""The 37 Ascend recipes' optimizer, offload, bridge and batching keys, verbatim, through verl.

Per row of ``recipe_settings.yaml`` (``../shared/reference/recipe_settings.md``, tables 1a/1b;
rows 32-37 published after it): the recipe's Hydra overrides as it writes them go through
verl's own path, one CPU process:

1. Hydra composes verl 0.9.1's ``ppo_megatron_trainer`` with them (after the few keys the
   launcher and verl's trainer supply: model path, sizes, ``total_training_steps``; :data:`SCAFFOLD`).
2. verl's ``ActorRolloutRefWorker.init_model`` translates the actor (or ref) section into the
   ``TrainingWorkerConfig`` (``verl/workers/engine_workers.py``: ``omega_conf_to_dataclass``, the
   batching fields, ``use_remove_padding`` from the model); the worker class it would build is
   replaced on this one instance by a catcher, so verl's translation runs unchanged.
3. ``verl_loop.new_worker`` builds it with the plugin's engine (``worker.reset()``: model and
   optimizer) and ``train_sft`` runs 2 ``train_batch`` steps: finite loss, finite non-zero grad
   norm, and the keys are in effect (offloaded buffers, the plugin's Adam, bshd, the checkpoint's
   weights). The reference model's keys: one ``infer_batch`` per distinct reference setting.

Rows whose keys (last value per key) and stand-in are the same run once (the id lists the rows).
Keys verl itself refuses never reach the plugin (``grad_offload``: Hydra's error, asserted);
``use_mbridge=False`` is refused by the plugin's engine in one line before verl's raw assert.
Each ``dist_checkpointing_path`` a role loads (and each shell-variable path) is replaced by a
Megatron distributed checkpoint of the stand-in written in TE names (as in ``test_engine_io``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("verl")

from tests.integrations import verl_loop as loop
from tests.integrations.conftest import engine_model

pytestmark = pytest.mark.usefixtures("cpu_runtime", "own_attention_variables")

ROWS = yaml.safe_load((Path(__file__).parent / "recipe_settings.yaml").read_text())["rows"]
FIXTURE = {"qwen2": "tiny_hf_model", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
           "deepseek_v3": "tiny_deepseek_v3_model", "mimo": "mimo",
           "qwen3_5_hub": "qwen3_5_hub", "qwen3_5_dense_hub": "qwen3_5_dense_hub",
           "nemotron_h": "nemotron_h", "qwen3_vl": "qwen3_vl",
           "qwen3_vl_moe": "qwen3_vl_moe", "glm_moe_dsa": "glm_moe_dsa"}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_5_dense_hub(tmp_path_factory) -> str:
    """A tiny dense Qwen3.5 in the hub form, the form of Qwen3.5-4B (row 33):
    ``Qwen3_5ForConditionalGeneration``, the text model of ``qwen3_5_models.TEXT`` (3 Gated
    DeltaNet + 1 attention layers) with an MLP of 96, its 2-block vision tower and
    ``vision_config``; weights bf16-exact, the word-level tokenizer."""
    import transformers

    from tests.integrations import qwen3_5_models as q
    from tests.integrations.conftest import _save_word_level_tokenizer

    config = transformers.Qwen3_5Config(text_config=dict(**q.TEXT, intermediate_size=96),
                                        vision_config=q.VISION, **q.IMAGE_IDS)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    q.draw(model)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    path = tmp_path_factory.mktemp("tiny_qwen3_5_dense_hub")
    model.save_pretrained(path, safe_serialization=True)
    _save_word_level_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def glm_moe_dsa(tmp_path_factory) -> str:
    """A tiny GLM-5 (row 25): transformers' ``GlmMoeDsaForCausalLM`` of
    ``tests/dsa_hf/dsa_models.py`` (hidden 64, vocab 128, 3 layers: the first dense, MoE after;
    MLA with the DSA indexer, ``index_topk`` 5, fewer than the tokens of every census sequence;
    the engine builds it through the plugin's DSA bridge); weights bf16-exact, the word-level
    tokenizer."""
    from tests.dsa_hf import dsa_models
    from tests.integrations.conftest import save_bf16_exact

    torch.manual_seed(0)
    _, model_class = dsa_models.classes("glm_moe_dsa")
    model = model_class(dsa_models.tiny_config("glm_moe_dsa"))
    dsa_models.draw(model, dsa_models.SEEDS["glm_moe_dsa"])
    assert min(loop.PROMPT_LENGTHS) + min(loop.RESPONSE_LENGTHS) > dsa_models.TOPK
    return save_bf16_exact(model, tmp_path_factory.mktemp("tiny_glm_moe_dsa"))


A, AM, RM = (
    "actor_rollout_ref.actor.",
    "actor_rollout_ref.actor.megatron.",
    "actor_rollout_ref.ref.",
)
# keys verl 0.9.1's config does not have: Hydra refuses the override (asserted below)
HYDRA_REFUSES = {AM + "grad_offload", A + "grad_offload"}
# keys the plugin's engine refuses in one line (verl's own engine asserts on them)
PLUGIN_REFUSES = {AM + "use_mbridge": "False", RM + "megatron.use_mbridge": "False"}
# what the launcher and verl's trainer supply (RayPPOTrainer writes total_training_steps from the
# data); written first, so a recipe's own key wins
SCAFFOLD = ["trainer.n_gpus_per_node=1", "trainer.nnodes=1", "data.train_batch_size=8",
            A + "ppo_mini_batch_size=8", A + "optim.total_training_steps=100",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            RM + "log_prob_micro_batch_size_per_gpu=2"]  # fmt: skip


def _split(key: str) -> tuple[str, str]:
    """``"+a.b=v"`` -> ``("a.b", "v")``."""
    path, value = key.lstrip("+").split("=", 1)
    return path, value


TC = "override_transformer_config."
# the recipe's parallel layout repeated inside override_transformer_config: every size is 1 here
# (one CPU process), as verl's own megatron.*_size are, and MindSpeed's per-stage layer list
# (one entry per pipeline stage) is left out; the recipes' values are checked at their own sizes
# by tests/transformer/test_recipe_keys.py
ONE_PROCESS = {"context_parallel_size": "1", "tensor_model_parallel_size": "1",
               "pipeline_num_transformer_layers": None}  # fmt: skip


def row_keys(row: dict) -> list[str]:
    """Every key of a census row as Hydra gets it: ``keys``, ``model_keys`` and
    ``transformer_keys`` (the parallel sizes in the latter scaled to one process)."""
    keys = [*row["keys"], *row.get("model_keys", ()), *row.get("transformer_keys", ())]
    scaled = []
    for key in keys:
        path, _ = _split(key)
        name = path.rsplit(".", 1)[-1]
        if TC in path and name in ONE_PROCESS:
            if ONE_PROCESS[name] is None:
                continue
            key = f"{key.split('=', 1)[0]}={ONE_PROCESS[name]}"
        scaled.append(key)
    return scaled


def _runnable(keys: list[str]) -> list[str]:
    """The keys that reach the plugin: without those verl or the plugin refuses."""
    kept = []
    for key in keys:
        path, value = _split(key)
        if path in HYDRA_REFUSES or PLUGIN_REFUSES.get(path) == value:
            continue
        kept.append(key)
    return kept


def _effective(keys: list[str]) -> dict[str, str]:
    """Each key's last value (Hydra applies the overrides in order)."""
    return dict(_split(key) for key in keys)


def _on(effective: dict, key: str, default: bool = False) -> bool:
    """A boolean key's value as Hydra reads it (``True`` / ``true``), ``default`` when unset."""
    return effective[key].lower() == "true" if key in effective else default


def _cases(section) -> dict[str, tuple[str, list[str]]]:
    """``id -> (family, keys)``: rows with the same stand-in and the same ``section(effective)``
    run once, under the first row's keys."""
    groups: dict = {}
    for row in ROWS:
        keys = _runnable(row_keys(row))
        signature = (row["family"], tuple(sorted(section(_effective(keys)).items())))
        groups.setdefault(signature, ([], keys))[0].append(row["row"])
    return {"rows_" + "_".join(rows): (sig[0], keys) for sig, (rows, keys) in groups.items()}


def _actor_section(effective: dict) -> dict:
    return effective


REF_FOLLOWS = ("param_offload", "use_mbridge", "vanilla_mbridge")  # megatron_ref.yaml's oc.select
REF_DEFAULTS = {"param_offload": "False", "use_dist_checkpointing": "False", "use_mbridge": "True",
                "vanilla_mbridge": "False"}  # fmt: skip


def _ref_section(effective: dict) -> dict:
    """What the reference model is built from, resolved as verl resolves it: its own
    ``ref.megatron.*`` value, else the actor's where ``megatron_ref.yaml`` follows it
    (``oc.select``), else verl's default; and ``model.use_remove_padding``."""
    section = {}
    for field, default in REF_DEFAULTS.items():
        followed = effective.get(AM + field, default) if field in REF_FOLLOWS else default
        section[field] = effective.get(RM + "megatron." + field, followed)
    section["model"] = effective.get("actor_rollout_ref.model.use_remove_padding", "True")
    section.update({path: value for path, value in effective.items() if TC in path})
    return section


ACTOR_CASES = _cases(_actor_section)
REF_CASES = _cases(_ref_section)


# ---------------------------------------------------------------------------------------------
# verl's path: Hydra compose, then ActorRolloutRefWorker's translation
# ---------------------------------------------------------------------------------------------


def _compose(overrides: list[str]):
    """verl's ``ppo_megatron_trainer`` composed with ``overrides`` (Hydra, as ``main_ppo``)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_megatron_trainer", overrides=overrides)


class _Caught(Exception):
    """Stops ``init_model`` where it would build the worker."""


def _training_config(config, role: str):
    """The ``TrainingWorkerConfig`` verl's ``ActorRolloutRefWorker.init_model`` builds for
    ``role`` ("actor" or "ref") from the composed ``config``: its own code, with the worker
    class it would instantiate replaced on this instance by a catcher."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    caught = {}

    def catch(config):
        caught["config"] = config
        raise _Caught

    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role=role)
    setattr(worker, f"{role}_worker_cls", catch)
    with pytest.raises(_Caught):
        worker.init_model()
    return caught["config"]


def _with_paths(keys: list[str], model: str, checkpoint) -> list[str]:
    """The recipe's keys with the model path first and every ``dist_checkpointing_path`` that a
    role loads, or that is a shell variable, pointing at ``checkpoint()`` (the stand-in's)."""
    effective = _effective(keys)
    out = [f"actor_rollout_ref.model.path={model}"]
    for key in keys:
        path, value = _split(key)
        if path.endswith(".dist_checkpointing_path"):
            role = path.removesuffix("dist_checkpointing_path")
            if "$" in value or _on(effective, role + "use_dist_checkpointing"):
                key = f"{key.split('=', 1)[0]}={checkpoint()}"
        out.append(key)
    return out


class StandIns:
    """The tiny Hugging Face checkpoint of each family and, written once on first use, its
    Megatron distributed checkpoint: the stand-in's weights plus noise (so a load from it is
    told apart from the Hugging Face files), saved by ``dist_checkpointing.save`` of the GPT
    model's ``sharded_state_dict()`` (TE names, as verl's converter writes them)."""

    def __init__(self, request, tmp_path_factory) -> None:
        self._request, self._tmp, self._written = request, tmp_path_factory, {}

    def hf(self, family: str) -> str:
        return self._request.getfixturevalue(FIXTURE[family])

    def checkpoint(self, family: str) -> tuple[str, torch.Tensor]:
        """``(folder, the first layer's QKV weight it holds)``."""
        if family not in self._written:
            folder = self._tmp.mktemp(f"{family}_dist")
            self._written[family] = _write_dist_checkpoint(self.hf(family), folder)
        return self._written[family]


@pytest.fixture(scope="module")
def stand_in(request, tmp_path_factory) -> StandIns:
    return StandIns(request, tmp_path_factory)


def _qkv(engine) -> torch.Tensor:
    """The first attention layer's QKV weight (a hybrid's first layer may be Mamba or MLP)."""
    for layer in engine_model(engine).decoder.layers:
        attention = getattr(layer, "self_attention", None)
        qkv = getattr(attention, "linear_qkv", None) or getattr(attention, "linear_q_up_proj", None)
        if qkv is not None:
            return qkv.weight.detach().clone()
    raise AssertionError("no attention layer with a QKV weight")


def _write_dist_checkpoint(hf_path: str, folder) -> tuple[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    config = loop.worker_config(hf_path, forward_only=True)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    gpt = engine_model(worker.engine)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in gpt.parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.01
            param.add_(noise.to(param.dtype))
    dist_checkpointing.save(gpt.sharded_state_dict(), str(folder))
    return str(folder), _qkv(worker.engine)


def _row_config(family: str, keys: list[str], stand_in: StandIns, role: str):
    """verl's ``TrainingWorkerConfig`` for ``role`` of a row on ``family``'s stand-in."""
    paths = _with_paths(keys, stand_in.hf(family), lambda: stand_in.checkpoint(family)[0])
    return _training_config(_compose(SCAFFOLD + paths), role)


# ---------------------------------------------------------------------------------------------
# every row: the actor builds and trains 2 steps; the reference model infers once
# ---------------------------------------------------------------------------------------------


def _offloaded(engine) -> bool:
    """verl's param offload leaves the DDP parameter buffers without storage between calls."""
    chunk = engine.module[0]
    buffers = [*chunk.buffers, *chunk.expert_parallel_buffers]
    return all(b.param_data.untyped_storage().size() == 0 for b in buffers)


def _assert_checkpoint_loaded(engine, effective: dict, want) -> None:
    """Before the first step: the weights are the dist checkpoint's (``want()``), not the
    Hugging Face files' (an offloaded model is loaded for the look and offloaded again)."""
    from verl.utils.device import get_device_name

    if not _on(effective, AM + "use_dist_checkpointing"):
        return
    offload = _on(effective, AM + "param_offload")
    if offload:
        engine.to(get_device_name(), model=True, optimizer=False, grad=False)
    assert torch.equal(_qkv(engine), want()[1])
    if offload:
        engine.to("cpu", model=True, optimizer=False, grad=False)


# the NPU DSA core attention's operators -> the recipe switch that chooses each one's kernel
DSA_SWITCHES = {"indexer": "use_fused_lightning_indexer",
                "attention": "use_fused_sparse_flash_attention",
                "loss": "use_fused_lightning_indexer_kl_loss"}  # fmt: skip


def _assert_attention_in_effect(engine, effective: dict) -> None:
    """DSA rows (GLM-5): every attention layer's core attention is the NPU DSA one, its operators'
    kernels as the fused switches chose (true: "auto", false: "reference"); other rows: every
    core attention is ``NPUFusionAttention``, in batch-invariant mode as the keys say."""
    from mcore_npu.transformer.attention import NPUFusionAttention
    from mcore_npu.transformer.dsa import NPUSparseAttention

    modules = list(engine_model(engine).modules())
    if effective.get(AM + TC + "experimental_attention_variant", "").strip("'\"") == "dsa":
        sparse = [m for m in modules if isinstance(m, NPUSparseAttention)]
        want = {op: "auto" if _on(effective, AM + TC + key) else "reference"
                for op, key in DSA_SWITCHES.items() if AM + TC + key in effective}  # fmt: skip
        assert sparse and all(want.items() <= m.kernels.items() for m in sparse), want
        assert not any(isinstance(m, NPUFusionAttention) for m in modules)
        return
    invariant = _on(effective, AM + TC + "use_flash_attn_npu_batch_invariant")
    attentions = [m for m in modules if isinstance(m, NPUFusionAttention)]
    assert attentions and all(a.batch_invariant is invariant for a in attentions)


def _assert_actor_keys_in_effect(engine, effective: dict) -> None:
    """After the steps: verl's offload, the plugin's Adam where the optimizer keys ask for it,
    the layout, the batching, the DDP gradient dtype and batch-invariant mode, as the keys say."""
    from mcore_npu.optimizer import plugin_adams

    config = engine.engine_config
    _assert_attention_in_effect(engine, effective)
    assert _offloaded(engine) == _on(effective, AM + "param_offload")
    ooc = A + "optim.override_optimizer_config."
    adams = plugin_adams(engine.optimizer)
    if _on(effective, AM + TC + "swap_optimizer"):  # MindSpeed's swap: the whole state on host
        assert adams and all(a.settings.cpu_offload for a in adams)
        assert all(a.settings.offload_fraction == 1.0 for a in adams)
    elif _on(effective, ooc + "optimizer_cpu_offload"):
        fraction = float(effective.get(ooc + "optimizer_offload_fraction", "0"))
        assert adams  # one per distributed optimizer (an MoE has dense and expert ones)
        assert all(
            a.settings.cpu_offload and a.settings.offload_fraction == fraction for a in adams
        )
    elif not (_on(effective, ooc + "use_precision_aware_optimizer")
              or _on(effective, A + "optim.use_precision_aware_optimizer")):  # fmt: skip
        assert not adams  # Megatron's own optimizer, unchanged
    assert config.use_remove_padding == _on(
        effective, "actor_rollout_ref.model.use_remove_padding", True
    )
    assert config.use_dynamic_bsz == _on(effective, A + "use_dynamic_bsz")
    if config.use_dynamic_bsz and A + "ppo_max_token_len_per_gpu" in effective:
        assert config.max_token_len_per_gpu == int(effective[A + "ppo_max_token_len_per_gpu"])
    if not _on(effective, AM + "override_ddp_config.grad_reduce_in_fp32", True):
        assert {b.grad_dtype for b in engine.module[0].buffers} == {torch.bfloat16}


@pytest.mark.parametrize("case", ACTOR_CASES)
def test_recipe_keys_train_through_training_worker(case, stand_in):
    """The row's keys, through verl's compose and translation, build the model and optimizer
    with the plugin's engine and train 2 steps: finite loss, finite non-zero grad norm, with the
    keys in effect."""
    family, keys = ACTOR_CASES[case]
    effective = _effective(keys)
    config = _row_config(family, keys, stand_in, "actor")
    worker = loop.new_worker(config, loop.sft_loss_fn())
    _assert_checkpoint_loaded(worker.engine, effective, lambda: stand_in.checkpoint(family))
    metrics = loop.train_sft(worker, 2)
    losses, norms = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
    print(f"{case} ({family}): losses {losses}, grad norms {norms}")
    assert all(math.isfinite(x) for x in losses + norms) and all(n > 0 for n in norms), metrics
    _assert_actor_keys_in_effect(worker.engine, effective)
    if _on(effective, "actor_rollout_ref.model.mtp.enable"):  # row 31: verl reports the MTP loss
        assert all(math.isfinite(m["mtp_losses/mtp_1_loss"]) for m in metrics), metrics


@pytest.mark.parametrize("case", REF_CASES)
def test_reference_keys_build_and_infer(case, stand_in):
    """The reference model of the row (its own ``ref.megatron.*`` keys and the actor's it
    follows), translated by verl: built forward-only with the plugin's engine, one
    ``infer_batch`` gives finite log-probs; a loaded dist checkpoint's weights are in it."""
    family, keys = REF_CASES[case]
    config = _row_config(family, keys, stand_in, "ref")
    assert config.engine_config.forward_only
    worker = loop.new_worker(config, loop.sft_loss_fn())
    log_probs = loop.old_log_probs(worker, loop.rollout_batch(0))
    assert log_probs.shape == (8, max(loop.RESPONSE_LENGTHS))
    assert torch.isfinite(log_probs).all()
    if _on(_effective(keys), RM + "megatron.use_dist_checkpointing"):
        assert torch.equal(_qkv(worker.engine), stand_in.checkpoint(family)[1])


# ---------------------------------------------------------------------------------------------
# what never reaches the plugin, and what it refuses
# ---------------------------------------------------------------------------------------------

HYDRA_CASES = {}
for _row in ROWS:
    for _key in _row["keys"]:
        if _split(_key)[0] in HYDRA_REFUSES:
            HYDRA_CASES.setdefault(_key, []).append(_row["row"])


@pytest.mark.parametrize("key", HYDRA_CASES, ids=lambda k: _split(k)[0].split(".", 1)[1])
def test_verl_refuses_keys_it_does_not_have(key):
    """``grad_offload`` (24 rows as ``actor.megatron.grad_offload``, row 25 as
    ``actor.grad_offload``) is no field of verl 0.9.1's configs: Hydra refuses the override
    before any worker exists, so the row as written stops there; the plugin never sees it."""
    from hydra.errors import ConfigCompositionException

    path = _split(key)[0]
    with pytest.raises(ConfigCompositionException, match=f"Could not override '{path}'"):
        _compose(SCAFFOLD + [key])
    print(f"{key}: refused by Hydra, rows {HYDRA_CASES[key]}")


MBRIDGE_OFF = [row for row in ROWS if not _on(_effective(row["keys"]), AM + "use_mbridge", True)]


@pytest.mark.parametrize("row", MBRIDGE_OFF, ids=lambda row: f"row_{row['row']}")
def test_use_mbridge_false_is_refused_in_one_line(row, stand_in):
    """``use_mbridge=False`` (rows 4'a, 21): verl's engine asserts ``use_mbridge must be True``;
    the plugin's engine refuses it first, in one line naming the key, the value and the fix,
    before any model is built."""
    keys = [k for k in row_keys(row) if _split(k)[0] not in HYDRA_REFUSES]
    config = _row_config(row["family"], keys, stand_in, "actor")
    with pytest.raises(
        ValueError, match=r"use_mbridge=False.*set megatron.use_mbridge=True"
    ) as info:
        loop.new_worker(config, loop.sft_loss_fn())
    assert "\n" not in str(info.value)


def test_verls_own_engine_asserts_on_use_mbridge_false(qwen3):
    """The control: verl's ``MegatronEngineWithLMHead`` with ``use_mbridge=False`` stops with a
    raw ``AssertionError``."""
    import dataclasses

    from verl.workers.engine.megatron import MegatronEngineWithLMHead

    config = loop.worker_config(qwen3)
    engine_config = dataclasses.replace(config.engine_config, use_mbridge=False)
    with pytest.raises(AssertionError, match="use_mbridge must be True"):
        MegatronEngineWithLMHead(config.model_config, engine_config, config.optimizer_config,
                                 config.checkpoint_config)  # fmt: skip


def test_every_row_of_the_census_is_here():
    """Rows 1..31 of ``recipe_settings.md`` (and the variants 4'a, 4'b, 13', 17', 27', 28'),
    each with a source script and a stand-in this module has; each trains (actor and reference
    cases cover every row)."""
    ids = [row["row"] for row in ROWS]
    assert set(ids) >= {str(n) for n in range(1, 32)} and len(ids) == len(set(ids))
    assert all(row["source"] and row["family"] in FIXTURE for row in ROWS)
    assert {r for case in ACTOR_CASES for r in case.split("_")[1:]} == set(ids)
    assert {r for case in REF_CASES for r in case.split("_")[1:]} == set(ids)
    as_written = [n for n in map(str, range(1, 32)) if n in ids]
    with_a_switch = [n for n in map(str, range(1, 32)) if n in ids or f"{n}'" in ids]
    print(
        f"census: {len(as_written)} of 31 recipes train 2 steps with their scripts' defaults, "
        f"{len(with_a_switch)} with a switch of their own"
    )


def test_the_recipes_published_after_the_census_are_here():
    """Rows 32..37: the verl Megatron recipes of verl-ascend-recipe published after the census
    (Qwen3-VL and Qwen2.5 on-policy distillation, Qwen3.5-4B SAPO, Qwen2.5 CISPO, GDPO, GMPO),
    each from verl-project/verl-ascend-recipe at a commit; each trains 2 steps, none is refused.
    (Its MindSpeed-engine recipes, ``model_engine=mindspeed``, and its FSDP ones are not rows.)"""
    newer = [row for row in ROWS if row["row"].isdigit() and int(row["row"]) > 31]
    assert [row["row"] for row in newer] == [str(n) for n in range(32, 38)]
    assert all(row["source"].startswith("verl-project/verl-ascend-recipe @") for row in newer)
    trained = {r for case in ACTOR_CASES for r in case.split("_")[1:]}
    assert {row["row"] for row in newer} <= trained
    print(f"census, published after it: {len(newer)} recipes, all train 2 steps")
