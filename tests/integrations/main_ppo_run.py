"""verl's own trainer (``python -m verl.trainer.main_ppo``) on the CPU, as a user runs it: the
assets (a tiny Qwen3 with a ChatML tokenizer, parquet data in verl's format, a rule reward file),
the command line of verl's Qwen3-0.6B Ascend quick start, and the run's JSONL metrics.

The command line is verl's ``tests/special_npu/quick_start/run_qwen3_0_6b_megatron_vllm_ascend.sh``
(verl-project/verl @ 1dda039b9c63) with ``model_engine=megatron``, ``trainer.device=npu`` and the
``use_flash_attn`` override of ``run_qwen3_06b_grpo_mindspeed.sh``. Only these are changed:
the rollout name (``hf_cpu``), rollout / actor pipeline sizes that fit 2 ranks, batch sizes and
lengths, step counts, and the Ray sizes (NPU resources, CPUs, no dashboard, one agent-loop
worker, one reward worker, one TransferQueue storage unit).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.launch import HANG_TIMEOUT_S

VOCAB = 128
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\n", "system", "user", "assistant"]
WORDS = [f"w{i}" for i in range(len(SPECIAL), VOCAB)]
EVEN = [w for w in WORDS if int(w[1:]) % 2 == 0]  # the reward: the share of these words
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS_SCALE = 2.5
SWITCH = {"VERL_USE_EXTERNAL_MODULES": "mcore_npu.integrations.verl.cpu_runtime"}

REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's words that are among the ground truth's words."""
    words, wanted = solution_str.split(), set(ground_truth.split())
    return sum(word in wanted for word in words) / max(len(words), 1)
'''


def save_chatml_tokenizer(path) -> None:
    """A word-level ChatML tokenizer: the specials of :data:`SPECIAL` (``"\\n"`` one token,
    ``<|im_end|>`` the end of a turn and of the sequence), then the words ``w7 .. w127``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIAL[:3]])
    tokenizer.add_tokens([AddedToken("\n", normalized=False)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )  # fmt: skip
    fast.chat_template = CHATML
    fast.save_pretrained(path)


def save_model(path, family: str = "qwen3") -> str:
    """The tiny Qwen3 (``family``: ``"qwen3_moe"``, Qwen3-MoE: 4 experts, top-2) (hidden 64,
    2 layers, vocab 128; random fp32 weights, seed 0) and the ChatML tokenizer in ``path``."""
    import torch
    import transformers

    from tests.integrations import verl_loop

    config = verl_loop.hf_config(family)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = 2, 0, None
    # std 0.25 instead of 0.02: peaked next-token distributions (not near-uniform), so that
    # weights that differ show in the probabilities the sync check compares
    config.initializer_range = 0.25
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # the end-of-turn row of the LM head EOS_SCALE x as long: <|im_end|> is sampled at about one
    # token in six, so responses end at different lengths (with all of them max_response_length
    # long, GRPO's token-mean loss is 0 by symmetry: each group's advantages sum to 0)
    with torch.no_grad():
        model.lm_head.weight[config.eos_token_id] *= EOS_SCALE
    model.generation_config = transformers.GenerationConfig(eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path, safe_serialization=True)
    save_chatml_tokenizer(path)
    return str(path)


def save_data(path, rows: int = 16, seed: int = 0) -> tuple[str, str]:
    """``(train.parquet, test.parquet)`` in verl's format: 3-word user prompts, a rule reward
    whose ground truth is the words of :data:`EVEN`."""
    import random

    import pandas as pd

    rng = random.Random(seed)
    records = []
    for index in range(rows):
        words = " ".join(rng.choice(WORDS) for _ in range(3))
        records.append({
            "data_source": "tiny_first_word",
            "prompt": [{"role": "user", "content": words}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": " ".join(EVEN)},
            "extra_info": {"index": index, "split": "train"},
        })  # fmt: skip
    train, test = Path(path) / "train.parquet", Path(path) / "test.parquet"
    pd.DataFrame(records).to_parquet(train)
    pd.DataFrame(records[:4]).to_parquet(test)
    return str(train), str(test)


@dataclass
class Assets:
    model: str
    train: str
    test: str
    reward: str
    moe_model: str  # the same, Qwen3-MoE


def save_assets(path) -> Assets:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    train, test = save_data(path)
    reward = path / "reward.py"
    reward.write_text(REWARD_FILE)
    models = {family: path / family for family in ("qwen3", "qwen3_moe")}
    for family, where in models.items():
        where.mkdir(exist_ok=True)
        save_model(where, family)
    return Assets(str(models["qwen3"]), train, test, str(reward), str(models["qwen3_moe"]))


def recipe(assets: Assets, *, steps: int, out: Path) -> list[str]:
    """The quick start's overrides for ``assets``; ``out``: checkpoints and logs."""
    return [
        "model_engine=megatron",
        # DATA
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={assets.train}",
        f"data.val_files={assets.test}",
        "data.train_batch_size=2",  # batch size
        "data.max_prompt_length=16",  # lengths
        "data.max_response_length=8",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
        # MODEL
        f"actor_rollout_ref.model.path={assets.model}",
        # ACTOR
        "actor_rollout_ref.actor.optim.lr=5e-7",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # batch size
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",  # 2 ranks in all
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.use_mbridge=True",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn=True",
        # ROLLOUT
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.enable_chunked_prefill=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=hf_cpu",  # the CPU rollout
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_AND_PIECEWISE",
        "actor_rollout_ref.rollout.n=2",
        # REF
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.strategy=megatron",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.ref.megatron.expert_model_parallel_size=1",
        "actor_rollout_ref.ref.use_torch_compile=False",
        # TRAINER
        "trainer.balance_batch=True",
        "trainer.logger=[console,file]",
        "trainer.project_name=verl_grpo_tiny",
        "trainer.experiment_name=qwen3_tiny_grpo_megatron_hf_cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        "trainer.save_freq=20",  # the quick start's SAVE_FREQ, TEST_FREQ: validation (greedy)
        "trainer.test_freq=20",  # before the first step and after the last
        "trainer.total_epochs=100",
        f"trainer.total_training_steps={steps}",
        "trainer.device=npu",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        # reward
        f"reward.custom_reward_function.path={assets.reward}",
        "reward.custom_reward_function.name=compute_score",
        # Ray sizes
        "ray_kwargs.ray_init.num_cpus=8",
        "+ray_kwargs.ray_init.resources={NPU:2}",
        "+ray_kwargs.ray_init.include_dashboard=False",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


@dataclass
class Result:
    returncode: int
    output: str
    seconds: float
    metrics: list[dict]
    leftovers: list[str]  # processes of this run still alive after it exited (then killed)
    out: Path  # the run's folder (main_ppo's working and Hydra dir)

    def series(self, key: str) -> list[float]:
        """The value of ``key`` at each logged step, in step order."""
        rows = sorted((m for m in self.metrics if key in m["data"]), key=lambda m: m["step"])
        return [m["data"][key] for m in rows]


def succeeded(run: Result) -> None:
    """Assert ``run`` exited 0 and left no process."""
    assert run.returncode == 0, f"main_ppo exit {run.returncode}:\n{run.output[-6000:]}"
    assert run.leftovers == [], f"processes left after the run: {run.leftovers}"


def trained_steps(run: Result) -> list[int]:
    """The steps whose metrics hold an actor update."""
    return sorted({m["step"] for m in run.metrics if "actor/pg_loss" in m["data"]})


MARKER = "MCORE_NPU_MAIN_PPO_RUN"
RAY_STARTED = "Started a local Ray instance"
RAY_START_TIMED_OUT = "The current node timed out during startup"
"""Ray's own error when a raylet misses its hard-coded 30 s to register (a starved machine)."""


class Launch:
    """``python -m verl.trainer.main_ppo overrides`` started in the background, in its own process
    session: several launches run at once (each waits on the CPU, not on a queue). Output (stdout
    and stderr) to ``out/main_ppo.out``, metrics to ``out/metrics.jsonl``, Ray's files under a
    fresh short temp dir. Every process of the run inherits ``MCORE_NPU_MAIN_PPO_RUN=<out>``:
    :meth:`result` lists (and kills) any still alive after the exit."""

    def __init__(self, overrides: list[str], out: Path, env: dict | None = None) -> None:
        import tempfile

        out.mkdir(parents=True, exist_ok=True)
        self.out, self.metrics, self.log = out, out / "metrics.jsonl", out / "main_ppo.out"
        self.ray_dir = tempfile.mkdtemp(prefix="mppo", dir="/tmp")  # socket paths must be short
        environment = {**os.environ, **SWITCH, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                       "RAY_USAGE_STATS_ENABLED": "0", "VERL_FILE_LOGGER_PATH": str(self.metrics),
                       "HYDRA_FULL_ERROR": "1", "RAY_DEDUP_LOGS": "0", MARKER: str(out),
                       # on a busy machine a Ray worker may take minutes to start: a hang
                       # guard, not Ray's 60 s
                       "RAY_worker_register_timeout_seconds": "600", **(env or {})}  # fmt: skip
        self.cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides,
                    f"hydra.run.dir={out}", f"+ray_kwargs.ray_init._temp_dir={self.ray_dir}"]  # fmt: skip
        self.started = time.perf_counter()
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(self.cmd, cwd=out, env=environment, stdout=sink,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self._result: Result | None = None

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the exit (hang guard: ``HANG_TIMEOUT_S``; on a hang the group is killed and
        the test fails), then collect the run. Idempotent."""
        if self._result is None:
            try:
                self.proc.wait(HANG_TIMEOUT_S if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"hung: main_ppo in {self.out}\n{self.tail()}") from None
            finally:
                leftovers = kill_leftovers(str(self.out))
                shutil.rmtree(self.ray_dir, ignore_errors=True)
            seconds = time.perf_counter() - self.started
            lines = self.metrics.read_text().splitlines() if self.metrics.exists() else []
            self._result = Result(self.proc.returncode, self.log.read_text(errors="replace"),
                                  seconds, [json.loads(line) for line in lines], leftovers,
                                  self.out)  # fmt: skip
        return self._result

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Kill the run's process group (and, through :meth:`result`, any Ray process left)."""
        if self.running():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, chars: int | None = 6000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text if chars is None else text[-chars:]

    def wait_for_ray(self, poll: float = 0.5) -> None:
        """Return once this run's Ray instance is up (Ray's line "Started a local Ray instance"
        in the output) or the run has ended; fail on a hang."""
        deadline = time.monotonic() + HANG_TIMEOUT_S
        while self.running() and RAY_STARTED not in self.tail(None):
            assert time.monotonic() < deadline, f"hung: no Ray instance in {self.out}"
            time.sleep(poll)

    def ray_start_timed_out(self) -> bool:
        """Whether the run ended because its Ray instance missed Ray's start-up deadline (no
        step of the run had begun: a relaunch is the same run)."""
        return not self.running() and RAY_START_TIMED_OUT in self.tail(None)

    def yield_cpu(self, nice: int) -> None:
        """Lower this run's CPU priority by ``nice``: its session's scheduling group (Linux
        autogroups, where each session gets an equal share whatever its processes' niceness)
        and each of its processes alive now (the ones Ray starts later inherit it from the
        raylet). Call it once the run's Ray instance is up: Ray gives its raylet 30 s to register,
        which a starved start-up can miss."""
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/autogroup").write_text(str(nice))
        for pid in _marked_pids(str(self.out)):
            with contextlib.suppress(OSError):
                now = os.getpriority(os.PRIO_PROCESS, pid)
                os.setpriority(os.PRIO_PROCESS, pid, min(19, now + nice))


def main_ppo(overrides: list[str], out: Path, env: dict | None = None) -> Result:
    """One :class:`Launch`, waited for."""
    return Launch(overrides, out, env).result()


def kill_leftovers(marker: str, grace: float = 30.0) -> list[str]:
    """Kill every process whose environment has ``MARKER=marker`` and that is still alive
    ``grace`` seconds after the run exited (Ray stops its actors asynchronously after the
    driver's exit); return their command lines."""
    import psutil

    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _marked(marker):
        time.sleep(1.0)
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if process.environ().get(MARKER) != marker:
                continue
            found.append(" ".join(process.info["cmdline"] or [])[:200])
            process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _marked(marker: str) -> bool:
    """Whether a process with ``MARKER=marker`` in its environment is alive."""
    return bool(_marked_pids(marker))


def _marked_pids(marker: str) -> list[int]:
    """The live processes with ``MARKER=marker`` in their environment."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == marker and process.status() != "zombie":
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


if (
    __name__ == "__main__"
):  # a manual run: python -m tests.integrations.main_ppo_run DIR [overrides]
    where = Path(sys.argv[1]).resolve()
    assets = save_assets(where / "assets")
    result = main_ppo([*recipe(assets, steps=3, out=where), *sys.argv[2:]], where / "run")
    print(result.output[-20000:])
    print("exit", result.returncode, f"{result.seconds:.0f}s", len(result.metrics), "metric rows")
    print("leftovers", result.leftovers)
