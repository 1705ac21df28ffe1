"""verl's training loop with the plugin's engine, as verl's own trainers drive it (no Ray).

Shared by the in-process tests (``test_loop.py``) and the torchrun script
(``verl_loop_ranks.py``): tiny Hugging Face checkpoints, verl's ``TrainingWorkerConfig``, a
``TrainingWorker`` whose engine verl's registry picks for ``("npu", "huawei")``, and batches built
the way verl's SFT trainer (``verl/trainer/sft_trainer.py``) and PPO trainer
(``verl/trainer/ppo/ray_trainer.py``: ``left_right_2_no_padding``, ``compute_log_prob``,
``update_actor`` / ``update_critic``) build theirs. Every batch is a function of a seed only, so
every rank of a torchrun run draws the same global batch and takes its data-parallel share, as
verl's dispatch would hand it (``make_nd_compute_dataproto_dispatch_fn``).

Precision: verl's ``McoreEngineConfig`` accepts only ``bfloat16`` / ``float16``
(``verl/workers/config/engine.py:218``), so these runs are bf16 models with fp32 main parameters
and fp32 gradient buffers: Megatron's mixed-precision distributed optimizer, as on an NPU. The
one exception is a test oracle: ``worker_config(..., dtype="float32")`` (:func:`force_fp32`)
writes float32 past verl's validation, for the parallel-equality checks only.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

VOCAB = 128
PROMPT = 3  # the first PROMPT tokens of every SFT sample carry no loss (loss_mask 0)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False, hidden_act="silu")  # fmt: skip


# per family: the schedule of the SFT runs compared across layouts (conftest's one-process runs,
# verl_loop_ranks.py's torchrun layouts): the same settings, the same seeded batch
FAMILY_SETTINGS = {"qwen3": {"total_steps": 30, "lr": 2e-3}, "qwen3_moe": {"total_steps": 10}}


def hf_config(family: str, vocab: int = VOCAB):
    """The tiny Qwen3 (``"qwen3"``) or Qwen3-MoE (``"qwen3_moe"``: 4 experts, top-2) config."""
    import transformers

    shape = {**SHAPE, "vocab_size": vocab}
    if family == "qwen3":
        return transformers.Qwen3Config(**shape, intermediate_size=128)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**shape, intermediate_size=96, moe_intermediate_size=32,
                                           num_experts=4, num_experts_per_tok=2,
                                           norm_topk_prob=True)  # fmt: skip
    raise ValueError(f"family: {family!r}; use 'qwen3' or 'qwen3_moe'")


def save_checkpoint(family: str, path, vocab: int = VOCAB) -> str:
    """Random fp32 weights (seed 0) and a word-level tokenizer (``t0`` = pad, 128 words) in
    ``path``; ``vocab``: the model's vocabulary (the samples use ids below 128)."""
    import transformers

    from tests.integrations.conftest import _save_word_level_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, vocab))
    model.save_pretrained(path, safe_serialization=True)
    _save_word_level_tokenizer(path)
    return str(path)


# MiMo (``model_type: mimo``): Qwen2 plus multi-token-prediction layers. transformers has no
# MiMo class; MiMo's checkpoints ship their config class as remote code, so this one does too
# (written here, read with trust_remote_code from the checkpoint's own folder, no network).
MIMO_CONFIG_CODE = """from transformers import Qwen2Config


class TinyMiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)
"""
MIMO_MTP_PARTS = {"token_layernorm": "norm", "hidden_layernorm": "norm", "final_layernorm": "norm",
                  "input_proj": "proj"}  # fmt: skip


def save_mimo_checkpoint(path) -> str:
    """A tiny MiMo (Qwen2 shape of :data:`SHAPE`, one MTP layer) with random fp32 weights
    (seed 0) and the word-level tokenizer, in ``path``.

    The weights are a 3-layer Qwen2's, its third layer renamed ``model.mtp_layers.0.*`` (the
    MTP layer's transformer layer), plus the MTP layer's own ``token_layernorm`` /
    ``hidden_layernorm`` / ``final_layernorm`` (ones) and ``input_proj`` ``[H, 2H]``: the names
    mbridge's MiMo bridge maps (``mbridge/models/mimo.py``, ``_convert_mtp_param``).
    """
    import json

    import transformers
    from safetensors.torch import save_file

    from tests.integrations.conftest import _save_word_level_tokenizer

    shape = dict(SHAPE, intermediate_size=128)
    torch.manual_seed(0)
    qwen2 = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**{**shape, "num_hidden_layers": 3})
    )
    tensors = {}
    for name, tensor in qwen2.state_dict().items():
        tensors[name.replace("model.layers.2.", "model.mtp_layers.0.")] = tensor.contiguous()
    hidden = shape["hidden_size"]
    for part, kind in MIMO_MTP_PARTS.items():
        value = torch.ones(hidden) if kind == "norm" else torch.randn(hidden, 2 * hidden) * 0.02
        tensors[f"model.mtp_layers.0.{part}.weight"] = value
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    config = transformers.Qwen2Config(**shape).to_dict()
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"],
                  num_nextn_predict_layers=1,
                  auto_map={"AutoConfig": "configuration_mimo.TinyMiMoConfig"})  # fmt: skip
    with open(f"{path}/config.json", "w") as out:
        json.dump(config, out, indent=1)
    with open(f"{path}/configuration_mimo.py", "w") as out:
        out.write(MIMO_CONFIG_CODE)
    _save_word_level_tokenizer(path)
    return str(path)


def worker_config(
    model_path: str,
    *,
    model_type: str = "language_model",
    remove_padding: bool = True,
    total_steps: int = 10,
    lr: float = 1e-3,
    micro_batch: int = 2,
    dtype: str = "bfloat16",
    model: dict | None = None,
    **engine,
):
    """verl's ``TrainingWorkerConfig``: Megatron, vanilla mbridge, bf16, the distributed optimizer.

    ``engine``: more ``McoreEngineConfig`` fields (parallel sizes, offload, checkpoint format);
    ``model``: more ``HFModelConfig`` fields (``mtp``, ``trust_remote_code``).
    ``dtype="float32"``: an fp32 model, for the parallel-equality checks only
    (:func:`force_fp32`; verl's config refuses it).
    The learning rate decays linearly over ``total_steps`` (verl's default schedule) and the
    scheduler's state is part of the checkpoint (``use_checkpoint_opt_param_scheduler=True``:
    without it verl does not restore the scheduler at all, see docs/verl.md).
    """
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import (
        HFModelConfig,
        McoreEngineConfig,
        McoreOptimizerConfig,
        TrainingWorkerConfig,
    )

    config = TrainingWorkerConfig(
        model_type=model_type,
        model_config=HFModelConfig(
            path=model_path,
            load_tokenizer=True,
            use_remove_padding=remove_padding,
            **(model or {}),
        ),
        engine_config=McoreEngineConfig(
            strategy="megatron",
            dtype="bfloat16",
            use_mbridge=True,
            vanilla_mbridge=True,
            micro_batch_size_per_gpu=micro_batch,
            infer_micro_batch_size_per_gpu=micro_batch,
            **{"use_dynamic_bsz": False, **engine},
        ),
        optimizer_config=McoreOptimizerConfig(
            lr=lr, total_training_steps=total_steps, use_checkpoint_opt_param_scheduler=True
        ),
        checkpoint_config=CheckpointConfig(),
    )
    if dtype == "float32":
        force_fp32(config.engine_config)
    elif dtype != "bfloat16":
        raise ValueError(f"dtype: {dtype!r}; use 'bfloat16' (verl's) or 'float32' (the oracle)")
    return config


def force_fp32(engine_config) -> None:
    """Set an already validated ``McoreEngineConfig`` to ``dtype="float32"``: a test oracle, not
    a verl setting.

    verl 0.9.1's config refuses float32 (``McoreEngineConfig.__post_init__``: ``assert self.dtype
    in ["bfloat16", "float16"]``, ``verl/workers/config/engine.py:218``) and freezes the field
    (``BaseConfig.__setattr__``), so the value is written past both, after the validation. The
    engine then builds everything in fp32 from that one field (``_build_tf_config``:
    ``param_dtype``, ``tf_config.bf16 = fp16 = False``; ``_build_optimizer``: Megatron's
    optimizer with ``bf16 = fp16 = False``, i.e. the distributed optimizer over fp32
    parameters with no separate main copy). The parallel-equality checks run this way so that
    TP's split matmuls and EP's grouped expert matmuls can be compared with one process at
    1e-5; in bf16 they round differently (see ``test_loop_parallel.py``).
    """
    object.__setattr__(engine_config, "dtype", "float32")


def _keep_fp32(engine) -> None:
    """The oracle of :func:`force_fp32` on the engine's own copy of the config too.

    The plugin's engine replaces its ``engine_config`` by the recipe's copy at the start of
    ``_build_tf_config`` (``dataclasses.replace``, which runs verl's validation again and so
    would refuse float32; ``mcore_npu.integrations.verl.recipe.apply_recipe``). An instance-level
    wrapper of this one engine's ``_apply_recipe`` calls it on a bf16 config, then writes float32
    back into the caller's config and into the copy, before verl's ``_build_tf_config`` reads the
    dtype (so the caller's config stays fp32 for a later worker).
    """
    apply = engine._apply_recipe

    def apply_then_fp32():
        given = engine.engine_config
        object.__setattr__(given, "dtype", "bfloat16")
        try:
            apply()
        finally:
            force_fp32(given)
        force_fp32(engine.engine_config)

    engine._apply_recipe = apply_then_fp32


@contextmanager
def npu_engine():
    """verl's registry looks up ``("npu", "huawei")`` (as on an Ascend machine) in this block."""
    saved = {key: os.environ.get(key) for key in ("VERL_ENGINE_DEVICE", "VERL_ENGINE_VENDOR")}
    os.environ.update(VERL_ENGINE_DEVICE="npu", VERL_ENGINE_VENDOR="huawei")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def new_worker(config, loss_fn, *, seed: int = 1):
    """A ``TrainingWorker`` with the plugin's engine, initialised (``reset()``: model, optimizer,
    scheduler, checkpoint manager) and given ``loss_fn``, as verl's trainers set one up.

    On a CPU the Megatron RNG tracker is seeded here (verl's ``set_random_seed`` seeds it only
    where a device exists; the value head's initial weights come from it).
    """
    from megatron.core import parallel_state as mpu
    from verl.workers.engine_workers import TrainingWorker

    from mcore_npu.allocator import device
    from mcore_npu.training import cpu_support

    with npu_engine():
        worker = TrainingWorker(config)
    if config.engine_config.dtype == "float32":
        _keep_fp32(worker.engine)
    if device.current_accelerator() == "cpu":
        cpu_support.seed_cpu_streams(
            seed,
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            ep_rank=mpu.get_expert_model_parallel_rank(),
        )
    worker.reset()
    worker.set_loss_fn(loss_fn)
    return worker


def own_trainer(path: str, *overrides: str):
    """The plugin's own trainer (``mcore_npu.training.train.Trainer``) for the tiny Qwen3 at
    ``path``: the same architecture from the trainer's YAML keys, bf16 (what verl forces), TE
    names; ``overrides``: more ``key=value`` settings (e.g. ``train.init_from=...``)."""
    import transformers

    from mcore_npu.training.config import load_config
    from mcore_npu.training.train import Trainer

    hf = transformers.AutoConfig.from_pretrained(path)
    settings = [
        "model.num_layers=2", f"model.hidden_size={hf.hidden_size}",
        f"model.num_attention_heads={hf.num_attention_heads}",
        f"model.num_query_groups={hf.num_key_value_heads}",
        f"model.ffn_hidden_size={hf.intermediate_size}", f"model.vocab_size={hf.vocab_size}",
        "model.normalization=RMSNorm", "model.qk_layernorm=true", "model.activation=swiglu",
        "model.add_bias_linear=false", "model.share_embeddings_and_output_weights=false",
        f"model.rotary_base={int(hf.rope_parameters['rope_theta'])}",
        f"model.extra.layernorm_epsilon={hf.rms_norm_eps}", "model.param_layout=te",
        "model.max_sequence_length=64", "train.seq_length=32", "train.dtype=bf16",
        "attention.backend=npu_fusion", "train.progress=false",
    ]  # fmt: skip
    return Trainer(load_config(None, [*settings, *overrides]))


# ---------------------------------------------------------------------------------------------
# SFT: verl's sft_loss on packed (nested) samples, as verl/trainer/sft_trainer.py feeds them
# ---------------------------------------------------------------------------------------------

SFT_LENGTHS = (14, 9, 12, 7, 11, 8, 13, 6)


def sft_loss_fn():
    from verl.workers.utils.losses import sft_loss

    return partial(sft_loss, config=None)


def sft_samples(seed: int, lengths=SFT_LENGTHS) -> list[torch.Tensor]:
    """Token ids ``[n]`` per sample (seeded): a random prompt, then an arithmetic response
    (``t, t+k, t+2k, ...`` mod VOCAB), which a model can learn."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        prompt = torch.randint(0, VOCAB, (PROMPT,), generator=generator)
        start, step = (int(v) for v in torch.randint(1, VOCAB, (2,), generator=generator))
        response = (start + step * torch.arange(n - PROMPT)) % VOCAB
        samples.append(torch.cat([prompt, response]))
    return samples


def sft_batch(seed: int, *, dp_rank: int = 0, dp_size: int = 1, lengths=SFT_LENGTHS):
    """This data-parallel rank's share of the seeded global SFT batch, as a TensorDict with the
    meta data the SFT trainer attaches (``global_token_num`` of the whole global batch)."""
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu

    samples = sft_samples(seed, lengths)
    share = len(samples) // dp_size
    mine = samples[dp_rank * share : (dp_rank + 1) * share]
    masks = [torch.cat([torch.zeros(PROMPT), torch.ones(len(s) - PROMPT)]).long() for s in mine]
    data = tu.get_tensordict(
        {
            "input_ids": tu.nested_tensor_from_tensor_list(mine),
            "loss_mask": tu.nested_tensor_from_tensor_list(masks),
        },
        {
            "temperature": 1.0,
            "global_batch_size": len(samples),
            "pad_mode": "no_padding",
            "pad_token_id": 0,
        },
    )
    tu.assign_non_tensor(
        data, update_lr_scheduler=True, global_token_num=NonTensorData([len(s) for s in samples])
    )
    return data


def train_sft(worker, steps: int, *, seed: int = 0, dp_rank: int = 0, dp_size: int = 1):
    """``steps`` calls of ``worker.train_batch`` on the same seeded batch; the metrics of each
    (None on ranks without outputs)."""
    from verl.utils import tensordict_utils as tu

    metrics = []
    for _ in range(steps):
        output = worker.train_batch(sft_batch(seed, dp_rank=dp_rank, dp_size=dp_size))
        metrics.append(None if output is None else tu.get(output, "metrics"))
    return metrics


# ---------------------------------------------------------------------------------------------
# PPO / GRPO: a rollout batch, left-right padded as the rollout returns it
# ---------------------------------------------------------------------------------------------

PROMPT_LENGTHS = (4, 3, 5, 4, 3, 5, 4, 3)
RESPONSE_LENGTHS = (6, 8, 5, 7, 8, 4, 6, 7)
GROUP = 4  # GRPO: rollout.n responses per prompt (the uid groups)


def rollout_batch(seed: int = 0):
    """A rollout's output, in verl's padded layout: left-padded ``prompts`` ``[B, P]``,
    right-padded ``responses`` ``[B, R]``, ``input_ids`` / ``attention_mask`` / ``position_ids``
    ``[B, P + R]`` (mask 1 = real token), ``response_mask`` ``[B, R]`` and a scalar reward per
    response (``token_level_rewards`` on its last token), uids in groups of :data:`GROUP`."""
    from tensordict import TensorDict

    generator = torch.Generator().manual_seed(seed)
    batch, p_max, r_max = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompts = torch.zeros(batch, p_max, dtype=torch.long)
    responses = torch.zeros(batch, r_max, dtype=torch.long)
    attention = torch.zeros(batch, p_max + r_max, dtype=torch.long)
    rewards = torch.zeros(batch, r_max)
    for row, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)):
        prompts[row, p_max - p :] = torch.randint(1, VOCAB, (p,), generator=generator)
        responses[row, :r] = torch.randint(1, VOCAB, (r,), generator=generator)
        attention[row, p_max - p : p_max + r] = 1
        rewards[row, r - 1] = float(torch.rand((), generator=generator) > 0.5)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": position_ids,
            "response_mask": attention[:, p_max:],
            "token_level_rewards": rewards,
        },
        batch_size=[batch],
    )


def actor_config(**fields):
    """verl's ``McoreActorConfig`` for the PPO loss: vanilla (clipped) policy loss, token-mean."""
    from verl.workers.config.actor import McoreActorConfig

    return McoreActorConfig(ppo_micro_batch_size_per_gpu=2, rollout_n=GROUP, **fields)


def ppo_loss_fn(config=None):
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=config or actor_config())


def value_loss_fn(**fields):
    from verl.workers.config.critic import McoreCriticConfig
    from verl.workers.utils.losses import value_loss

    config = McoreCriticConfig(ppo_micro_batch_size_per_gpu=2, **fields)
    return partial(value_loss, config=config)


def to_engine_layout(batch, **meta):
    """``left_right_2_no_padding`` (verl's own step) on a copy, with ``meta`` attached."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(data, temperature=1.0, **meta)
    return data


def old_log_probs(worker, batch) -> torch.Tensor:
    """``[B, R]`` fp32: the actor's log-probs of the responses, as the PPO trainer computes
    ``old_log_probs`` (``compute_log_prob`` = ``infer_batch``, then ``no_padding_2_padding``)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    data = to_engine_layout(batch, calculate_entropy=True, compute_loss=False)
    output = worker.infer_batch(data)
    return no_padding_2_padding(tu.get(output, "log_probs"), data).float()


def grpo_advantages(batch) -> torch.Tensor:
    """``[B, R]``: verl's GRPO outcome advantage (group-normalised reward) per response token."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    uids = np.array([row // GROUP for row in range(batch.batch_size[0])], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(
        batch["token_level_rewards"], batch["response_mask"], uids
    )
    return advantages


def update(worker, batch, **meta):
    """One ``train_mini_batch`` (verl's ``update_actor`` / ``update_critic``): the whole batch as
    one mini-batch, one epoch, no shuffle. Returns the metrics (None without outputs)."""
    from verl.utils import tensordict_utils as tu

    size = batch.batch_size[0]
    data = to_engine_layout(batch, global_batch_size=size, mini_batch_size=size, epochs=1,
                            seed=42, dataloader_kwargs={"shuffle": False}, **meta)  # fmt: skip
    output = worker.train_mini_batch(data)
    return None if output is None else tu.get(output, "metrics")


def forward_loss(worker, batch, **meta) -> float:
    """verl's ``infer_batch`` loss (the worker's loss function, no update) on ``batch``."""
    from verl.utils import tensordict_utils as tu

    size = batch.batch_size[0]
    data = to_engine_layout(batch, global_batch_size=size, compute_loss=True, **meta)
    return tu.get(worker.infer_batch(data), "metrics")["loss"]
