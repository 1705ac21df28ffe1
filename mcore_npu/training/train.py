"""``mcore-npu train``: train a GPT with Megatron-Core from a YAML config.

``mcore-npu train --config configs/gpt_tiny.yaml train.steps=20``, or under ``torchrun ... -m
mcore_npu.train``. Megatron's schedule, DDP, optimizer and ``dist_checkpointing``; every step is
seeded from ``(train.seed, step)``, so a resumed run reproduces the uninterrupted losses.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from mcore_npu._warnings import hide_known_harmless_warnings
from mcore_npu.allocator.workers import ExpandableSegmentsMixin
from mcore_npu.optimizer import get_megatron_optimizer, parse_dtype
from mcore_npu.training import checkpointing, run_folder, runtime
from mcore_npu.training.checkpointing import CheckpointError
from mcore_npu.training.config import ConfigError, load_config, optimizer_keys, to_yaml
from mcore_npu.training.data import ByteDataset, MicroBatch, load_corpus
from mcore_npu.training.metrics import RunReporter, peak_memory_bytes
from mcore_npu.training.optimizer_resume import exact_adam_resume
from mcore_npu.training.signals import StopRequest


@dataclass(frozen=True)
class StepResult:
    step: int  # 1-based: the number of optimizer steps done
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float


@dataclass(frozen=True)
class Summary:
    steps: int
    first_loss: float | None
    final_loss: float | None
    tokens_per_s: float
    peak_memory_bytes: int
    backend: str
    kernel: str | None
    expandable_segments: bool
    interrupted_by: int | None = None  # the signal that stopped the run early, if any

    @property
    def exit_code(self) -> int:
        return 0 if self.interrupted_by is None else 128 + self.interrupted_by

    def line(self) -> str:
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.4f}"
        kernel = f" kernel={self.kernel}" if self.kernel else ""
        state = "done"
        if self.interrupted_by is not None:
            name = signal.Signals(self.interrupted_by).name
            state = f"interrupted at step {self.steps} by {name}:"
        return (
            f"mcore-npu train: {state} steps={self.steps} final_loss={loss} "
            f"tokens_per_s={self.tokens_per_s:.0f} peak_memory={self.peak_memory_bytes / 2**20:.0f}MiB "
            f"backend={self.backend}{kernel} "
            f"expandable_segments={'on' if self.expandable_segments else 'off'}"
        )


class Trainer(ExpandableSegmentsMixin):
    """A Megatron-Core GPT training run from a validated config; the mixin sets expandable
    segments (``memory.expandable_segments``) after the device choice, before any allocation."""

    def __init__(self, cfg) -> None:
        # bad data and unusable output paths: refused before any device or process-group work
        tokens = load_corpus(cfg.data.path, cfg.train.seq_length)
        self.lock = _prepare_run_folder(cfg)
        runtime.select_device()  # the NPU allocator setter acts on the current device
        super().__init__(
            expandable_segments=cfg.memory.expandable_segments,
            expandable_segments_strict=cfg.memory.strict,
        )
        self.cfg = cfg
        par = cfg.parallel
        layout = runtime.ParallelLayout(
            par.tensor, par.pipeline, par.context, par.expert, par.expert_tensor
        )
        self.runtime = runtime.initialize(
            layout, seed=cfg.train.seed, timeout_s=cfg.train.timeout_s
        )
        from mcore_npu.training.model import attention_choice, build_model, transformer_config

        self.backend, self.kernel = attention_choice(cfg, self.runtime.device)
        self.config = transformer_config(cfg)
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every tensor-parallel rank
        self.model = self._data_parallel(build_model(cfg, self.config))
        self._memos = _seq_lengths_memos(self.model)
        self.optimizer = self._optimizer()
        self.scheduler = self._scheduler()
        self._connect_schedule()
        self.dataset = ByteDataset(tokens, cfg.train.seq_length, cfg.train.seed)
        self.step = 0
        if cfg.train.checkpoint_dir:
            run_folder.check_free_space(cfg.train.checkpoint_dir, self._checkpoint_bytes())
        self._saved_step: int | None = None
        self._restore()

    def close(self) -> None:
        """Release the run folder's lock."""
        if self.lock is not None:
            self.lock.release()

    def _data_parallel(self, module):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        opt = self.cfg.optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=parse_dtype("main_grads_dtype", opt.main_grads_dtype)
            == torch.float32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=opt.use_distributed_optimizer,
        )
        return DistributedDataParallel(self.config, ddp_config, module)

    def _optimizer(self):
        """Megatron's optimizer, over the plugin's Adam where the ``optimizer`` keys need it."""
        t = self.cfg.train
        keys = dict(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            clip_grad=t.grad_clip,
            bf16=self.config.bf16,
            fp16=self.config.fp16,
            params_dtype=self.config.params_dtype,
            **optimizer_keys(self.cfg),
        )
        return get_megatron_optimizer(keys, [self.model])

    def _scheduler(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        t = self.cfg.train
        total = max(1, t.steps)
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=t.lr,
            min_lr=t.min_lr,
            lr_warmup_steps=min(t.warmup_steps, total - 1),
            lr_decay_steps=total,
            lr_decay_style=t.lr_schedule,
            start_wd=t.weight_decay,
            end_wd=t.weight_decay,
            wd_incr_steps=total,
            wd_incr_style="constant",
            # on resume, the config's schedule wins over the one saved in the checkpoint
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )

    def _connect_schedule(self) -> None:
        """Megatron's schedule reads these hooks from the model config."""
        from megatron.core.distributed import finalize_model_grads

        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        if self.config.fp16:
            self.config.grad_scale_func = self.optimizer.scale_loss

    def _model_state(self):
        return self.model.module.sharded_state_dict()

    def _checkpoint_bytes(self) -> int:
        """One checkpoint's bytes (all ranks): model, Adam's fp32 moments, fp32 main weights."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

        numel = nbytes = 0
        for value in nested_values(self._model_state()):
            if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
                numel += value.data.numel()
                nbytes += value.data.numel() * value.data.element_size()
        fp32_copies = 2 + (self.cfg.train.dtype != "fp32")
        total = torch.tensor([nbytes + 4 * fp32_copies * numel], device=self.runtime.device)
        dist.all_reduce(total)  # int64: exact
        return int(total.item())

    def _restore(self) -> None:
        t = self.cfg.train
        if t.resume:
            say = run_folder.say_on_rank0(dist.get_rank())
            found = run_folder.resume_point(
                t.checkpoint_dir, partial(self._load, with_optimizer=True), say
            )
            self._saved_step = self.step if found is not None else None
        elif t.init_from:
            named, _ = checkpointing.read_latest(t.init_from)
            folders = checkpointing.step_dirs(t.init_from)
            self._load(named or (folders[0] if folders else t.init_from), with_optimizer=False)

    def _load(self, path, *, with_optimizer: bool) -> None:
        """Load ``path`` on every rank, or raise ``CheckpointError`` on every rank."""
        failure, loaded = None, None
        try:
            model_state = checkpointing.match_layout(self._model_state(), path)
            template = {"model": model_state}
            with exact_adam_resume(self.optimizer):
                if with_optimizer:
                    optimizer_state = self.optimizer.sharded_state_dict(
                        model_state, is_loading=True, metadata=OPTIMIZER_CHECKPOINT
                    )
                    template["optimizer"] = optimizer_state
                loaded = checkpointing.load(template, path)
        except CheckpointError as err:
            failure = str(err)
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f), None)
        if failure is not None:
            raise CheckpointError(failure)
        self.model.module.load_state_dict(loaded["model"])
        if with_optimizer:
            with exact_adam_resume(self.optimizer):
                self.optimizer.load_state_dict(loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["scheduler"])
            self.step = int(loaded["step"])

    def _checkpoint_state(self) -> dict:
        """Model and optimizer as sharded tensors; scheduler, step and config as common state."""
        model_state = self._model_state()
        return {
            "model": model_state,
            "optimizer": self.optimizer.sharded_state_dict(
                model_state, metadata=OPTIMIZER_CHECKPOINT
            ),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "config": to_yaml(self.cfg),
        }

    def save(self):
        """Save model, optimizer, scheduler and step as ``step_<N>`` in ``train.checkpoint_dir``."""
        path = checkpointing.save(
            self._checkpoint_state(), self.cfg.train.checkpoint_dir, self.step
        )
        self._saved_step = self.step
        return path

    def train_step(self) -> StepResult:
        """One optimizer step over ``train.global_batch_size`` samples."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t, started = self.cfg.train, time.perf_counter()
        runtime.seed_streams(t.seed + self.step)  # a resumed run draws the same dropout masks
        micro_batches = self.dataset.micro_batches(
            self.step,
            global_batch=t.global_batch_size,
            micro_batch=t.micro_batch_size,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            packed=self.cfg.data.pack_sequences,
        )
        batches = [b.to(self.runtime.device) for b in micro_batches]
        batches = [_on_this_cp_rank(b) for b in batches]
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iter(batches),
            model=[self.model],
            num_microbatches=len(batches),
            seq_length=batches[0].tokens.shape[1],
            micro_batch_size=batches[0].tokens.shape[0],
            forward_only=False,
        )
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        self.step += 1
        return StepResult(
            step=self.step,
            loss=self._global_mean_loss(losses),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=self.optimizer.param_groups[0]["lr"],
            tokens=t.global_batch_size * t.seq_length,
            seconds=time.perf_counter() - started,
        )

    def _forward_step(self, data_iterator, model):
        batch: MicroBatch = next(data_iterator)
        if batch.seq_ends is not None:  # host offsets known: no attention layer syncs for them
            for memo in self._memos:
                memo.remember(batch.cu_seqlens, batch.seq_ends)
        mtp = {"loss_mask": batch.loss_mask} if self.config.mtp_num_layers else {}
        output = model(
            batch.tokens,
            batch.position_ids,
            None,  # no dense mask: causal attention comes from the layer's mask type
            labels=batch.labels,
            packed_seq_params=_packed_seq_params(batch),
            **mtp,  # the MTP losses skip the tokens the main loss skips
        )
        return output, partial(_masked_mean_loss, batch.loss_mask, self.cfg.parallel.context)

    def _global_mean_loss(self, losses) -> float:
        """Mean loss of the step, known on every rank (last pipeline stage, all data ranks)."""
        from megatron.core import parallel_state

        values = [entry["lm loss"] for entry in losses] if losses else []
        local = torch.stack(values).mean() if values else torch.zeros(())
        local = local.float().to(self.runtime.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(local, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
        return local.item() / parallel_state.get_data_parallel_world_size()

    def train(self, stop: StopRequest | None = None) -> Summary:
        """Run ``train.steps`` steps (from the restored step), saving as configured; ``stop``
        (SIGTERM/SIGINT) ends the run after the current step, the same one on every rank."""
        t, stop = self.cfg.train, stop or StopRequest()
        reporter = RunReporter(
            enabled=self.runtime.is_logging_rank,
            total_steps=t.steps,
            first_step=self.step,
            metrics_file=t.metrics_file,
            progress=t.progress,
            keep_through_step=self.step,
        )
        results: list[StepResult] = []
        stopped_by = None
        try:
            while self.step < t.steps and not (results and _due(self.step, t.exit_interval)):
                stopped_by = self._agreed_stop(stop)
                if stopped_by:
                    break
                result = self.train_step()
                results.append(result)
                if result.step % t.log_interval == 0 or result.step == t.steps:
                    reporter.step(self._record(result))
                if t.checkpoint_dir and _due(result.step, t.save_interval):
                    self.save()
            if t.checkpoint_dir and self._saved_step != self.step:
                self.save()  # the final (exit-interval, interrupted) state, unless just saved
            stopped_by = stopped_by or self._agreed_stop(stop)
        finally:
            reporter.close()
        return self._summary(results, stopped_by)

    def _agreed_stop(self, stop: StopRequest) -> int | None:
        """The signal any rank received (one all-reduce), so all ranks stop after one step."""
        flag = torch.tensor([stop.signum or 0], dtype=torch.int64, device=self.runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None

    def _record(self, result: StepResult) -> dict:
        return {
            "step": result.step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": result.tokens / result.seconds,
            "step_time_s": result.seconds,
            "memory_bytes": peak_memory_bytes(self.runtime.device),
        }

    def _summary(self, results: list[StepResult], stopped_by: int | None = None) -> Summary:
        seconds = sum(r.seconds for r in results)
        return Summary(
            steps=self.step,
            first_loss=results[0].loss if results else None,
            final_loss=results[-1].loss if results else None,
            tokens_per_s=sum(r.tokens for r in results) / seconds if seconds else 0.0,
            peak_memory_bytes=peak_memory_bytes(self.runtime.device),
            backend=self.backend,
            kernel=self.kernel,
            expandable_segments=self.expandable_segments_enabled,
            interrupted_by=stopped_by,
        )


OPTIMIZER_CHECKPOINT = {"distrib_optim_sharding_type": "fully_reshardable"}
"""The distributed optimizer's checkpoint format that any parallel layout can load."""


def _prepare_run_folder(cfg) -> run_folder.FolderLock | None:
    """Before any process group: write-test the output paths; rank 0 locks and claims the folder."""
    t = cfg.train
    run_folder.preflight_paths(t.checkpoint_dir, t.metrics_file)
    if not t.checkpoint_dir or runtime.LaunchEnv.from_environ().rank != 0:
        return None
    lock = run_folder.FolderLock(t.checkpoint_dir)
    try:
        run_folder.claim(t.checkpoint_dir, resume=t.resume, overwrite=t.overwrite)
    except BaseException:
        lock.release()
        raise
    return lock


def _due(step: int, interval: int) -> bool:
    return bool(interval) and step % interval == 0


def _packed_seq_params(batch: MicroBatch):
    if batch.cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    # the GLOBAL offsets (real = padded: every row is full); under CP each layer derives its own
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens,
        cu_seqlens_kv=batch.cu_seqlens,
        cu_seqlens_q_padded=batch.cu_seqlens,
        cu_seqlens_kv_padded=batch.cu_seqlens,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
    )


def _seq_lengths_memos(model) -> list:
    """The distinct ``SeqLengthsMemo`` objects of the model's NPU attention layers."""
    from mcore_npu.transformer.attention import NPUFusionAttention

    memos = {}
    for module in model.modules():
        if isinstance(module, NPUFusionAttention):
            memos[id(module.seq_lengths_memo)] = module.seq_lengths_memo
    return list(memos.values())


_SPLIT = ("tokens", "labels", "loss_mask", "position_ids")


def _on_this_cp_rank(batch: MicroBatch) -> MicroBatch:
    """This CP rank's chunks (r and 2*CP-1-r) of a ``[b, s]`` batch, or of every sequence of a
    packed ``[1, T]`` one (keeping the global cu_seqlens); the batch itself at CP = 1."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from mcore_npu.transformer import megatron_features
    from mcore_npu.transformer.context_parallel import get_thd_batch_on_this_cp_rank

    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    tensors = {name: getattr(batch, name) for name in _SPLIT}
    if batch.cu_seqlens is None:
        flag = {"is_hybrid_cp": False} if megatron_features.has("cp_batch_hybrid_flag") else {}
        return MicroBatch(**get_batch_on_this_cp_rank(tensors, **flag))
    local, _ = get_thd_batch_on_this_cp_rank(
        tensors, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen
    )
    offsets = dict(
        cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen, seq_ends=batch.seq_ends
    )
    return MicroBatch(**local, **offsets)


def _masked_mean_loss(loss_mask: torch.Tensor, cp_size: int, per_token_loss: torch.Tensor):
    """Megatron loss function: mean over unmasked tokens of ``per_token_loss`` ``[b, s]``. Under
    CP the sum and count are summed over the CP group; the gradient flows through the local sum
    and the factor CP is Megatron's schedule's (docs/gdn_cp.md)."""
    mask = loss_mask.reshape(-1).float()
    local_sum = (per_token_loss.float().reshape(-1) * mask).sum()
    if cp_size == 1:
        loss = local_sum / mask.sum().clamp(min=1)
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides ``loss`` in place
    from megatron.core import parallel_state

    totals = torch.stack([local_sum.detach(), mask.sum()])
    dist.all_reduce(totals, group=parallel_state.get_context_parallel_group())
    count = totals[1].clamp(min=1)
    loss = local_sum / count
    return loss, {"lm loss": (totals[0] / count).detach().clone()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (default: the built-in defaults)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. train.steps=20"
    )


def run(args: argparse.Namespace, trainer_class: type[Trainer] = Trainer) -> int:
    """Train; exit 0, 2 (bad config or run folder), 128 + signal (stopped), or 1 (other errors)."""
    hide_known_harmless_warnings()
    rank = runtime.LaunchEnv.from_environ().rank
    trainer = None
    try:
        with StopRequest() as stop:
            trainer = trainer_class(load_config(args.config, args.overrides))
            summary = trainer.train(stop)
        if rank == 0:
            print(summary.line(), flush=True)
        return summary.exit_code
    except ConfigError as err:
        print(f"mcore-npu train: error: {err}", file=sys.stderr, flush=True)
        return 2
    except CheckpointError as err:
        print(f"mcore-npu train: failed on rank {rank}: {err}", file=sys.stderr, flush=True)
        return 1
    except Exception as err:  # one line with the cause, after the traceback for debugging
        traceback.print_exc()
        message = f"mcore-npu train: failed on rank {rank}: {type(err).__name__}: {err}"
        print(message, file=sys.stderr, flush=True)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        runtime.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_npu.train", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
