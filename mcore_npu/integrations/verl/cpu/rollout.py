"""The CPU rollout ``hf_cpu``: verl's rollout contract met with ``transformers`` on the CPU.

- :class:`HfCpuRollout`, the adapter in each actor worker: drains the actor's weight generator on
  **every** rank (a collective) while the replica's first rank sends the tensors to the server;
- :class:`HfCpuReplica`: one server actor per replica, named ``hf_cpu_server_<replica>_0``;
- :class:`HfCpuServer`: a ``transformers`` causal LM in fp32 with **random** weights, replaced by
  each sync's (it refuses to generate before the first), sampling through :func:`.sampler.sample`;
  with ``enable_rollout_routing_replay`` it returns each token's experts (:mod:`.routes`), as vLLM.

Not vLLM or SGLang: no batching, no paged KV cache, no NPU IPC, no HCCL. Diagnostics:
``MCORE_NPU_HF_CPU_DUMP_DIR`` (the weights after each sync; with routing replay, each response's
token ids and routes) and ``MCORE_NPU_HF_CPU_SKIP_SYNC=1`` (ignore every sync). See
docs/verl_main_ppo.md.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
from pathlib import Path

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from . import routes, sampler

logger = logging.getLogger(__name__)

NAME = "hf_cpu"
DUMP_DIR = "MCORE_NPU_HF_CPU_DUMP_DIR"
SKIP_SYNC = "MCORE_NPU_HF_CPU_SKIP_SYNC"


def server_name(replica_rank: int) -> str:
    """The Ray actor name of a replica's server."""
    return f"{NAME}_server_{replica_rank}_0"


def rollout_world_size(config) -> int:
    """Actor ranks per replica: rollout TP x DP x PP."""
    return (
        config.tensor_model_parallel_size
        * config.data_parallel_size
        * config.pipeline_model_parallel_size
    )


class HfCpuRollout(BaseRollout):
    """The adapter in each actor worker (see the module doc)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank, world = int(os.environ.get("RANK", "0")), rollout_world_size(self.config)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.has_server = rank % world == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if self.has_server:
            await self._server_handle().wake_up.remote(tags=tags)

    async def release(self):
        if self.has_server:
            await self._server_handle().sleep.remote()

    async def update_weights(
        self, weights, global_steps=None, wire_format="named_tensors", **kwargs
    ):
        """Drain ``weights`` (``(hf_name, tensor)`` pairs) on every rank; the replica's first
        rank sends them to its server."""
        if wire_format != "named_tensors":
            raise ValueError(
                f"rollout.name={NAME}: wire_format={wire_format!r} is not supported; it takes "
                "full tensors ('named_tensors'). Use rollout.checkpoint_engine.backend=naive."
            )
        collected = {}
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                if self.has_server:
                    collected[name] = tensor.detach().to("cpu", copy=True)
        else:
            for name, tensor in weights:
                if self.has_server:
                    collected[name] = tensor.detach().to("cpu", copy=True)
        if self.has_server:
            await self._server_handle().update_weights.remote(collected, global_steps)


class HfCpuReplica(RolloutReplica):
    """One :class:`HfCpuServer` actor per replica."""

    async def launch_servers(self):
        name = server_name(self.replica_rank)
        server = (
            ray.remote(HfCpuServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(self.config, self.model_config, self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name

    def rollout_worker_use_gpu(self) -> bool:
        return False


class HfCpuServer:
    """The server actor: a ``transformers`` model on the synced weights (see the module doc)."""

    def __init__(self, config, model_config, replica_rank: int):
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank = replica_rank
        self.model = _random_model(
            self.model_config.hf_config, seed=self.config.seed + replica_rank
        )
        self.eos_ids = _eos_ids(self.model_config)
        self.synced = False
        self.skip_sync = os.environ.get(SKIP_SYNC, "0") == "1"
        self.global_steps = None
        self.requests = collections.Counter()

    def ready(self) -> bool:
        return True

    async def update_weights(self, weights: dict, global_steps=None):
        """Load the actor's exported weights (HF names) into the model; all must be known."""
        self.global_steps = global_steps
        if self.skip_sync:
            logger.warning("%s=1: weight sync %s ignored (control run)", SKIP_SYNC, global_steps)
            return
        load_exported(self.model, weights)
        self.synced = True
        dump_dir = os.environ.get(DUMP_DIR)
        if dump_dir:
            from safetensors.torch import save_file

            Path(dump_dir).mkdir(parents=True, exist_ok=True)
            state = {k: v.contiguous() for k, v in self.model.state_dict().items()}
            save_file(
                state, f"{dump_dir}/replica{self.replica_rank}_step{global_steps}.safetensors"
            )

    async def generate(
        self, request_id, prompt_ids, sampling_params, image_data=None, video_data=None, **kwargs
    ) -> TokenOutput:
        """One response to ``prompt_ids``: sampled tokens, their log-probs at the temperature."""
        if not (self.synced or self.skip_sync):
            raise RuntimeError(
                f"rollout.name={NAME}: generate() before the first weight sync; the server "
                "samples only from the weights the actor sends"
            )
        if image_data is not None or video_data is not None:
            raise ValueError(f"rollout.name={NAME}: text only; got image or video data")
        prompt_ids = [int(t) for t in prompt_ids]
        budget = self.config.prompt_length + self.config.response_length - len(prompt_ids)
        settings = sampler.Sampling.from_request(
            sampling_params, max_tokens=min(self.config.response_length, budget)
        )
        key = (self.global_steps, tuple(prompt_ids), settings)
        self.requests[key] += 1  # the n-th identical request draws the n-th stream
        seed = sampler.request_seed(
            self.config.seed, self.replica_rank, *key[:2], self.requests[key]
        )
        generator = torch.Generator().manual_seed(seed)
        replay = bool(getattr(self.config, "enable_rollout_routing_replay", False))
        with routes.recording(self.model) if replay else contextlib.nullcontext() as recorded:
            tokens, log_probs, stop = sampler.sample(
                self.model, prompt_ids, settings, self.eos_ids, generator
            )
        wants_log_probs = bool(sampling_params.get("logprobs", False))
        routed = recorded.stacked() if replay else None  # [P + R - 1, L, k], as vLLM
        if routed is not None and os.environ.get(DUMP_DIR):
            _dump_routes(os.environ[DUMP_DIR], request_id, prompt_ids + tokens, routed)
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if wants_log_probs else None,
            routed_experts=routed,
            stop_reason=stop,
            extra_fields={"global_steps": self.global_steps},
        )

    # lifecycle calls verl makes on every server; nothing to free on a CPU
    async def wake_up(self, tags=None):
        pass

    async def sleep(self):
        pass

    async def clear_kv_cache(self):
        pass  # the KV cache lives only inside one generate() call

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def abort_all_requests(self, reject_request: bool = False, **kwargs) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        pass

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass


def _dump_routes(dump_dir: str, request_id, ids: list[int], routed: torch.Tensor) -> None:
    """Save one response's token ids (prompt then response, ``[P + R]``) and routes
    (``[P + R - 1, L, k]``) as ``routes_<request id>.pt`` in ``dump_dir``."""
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    torch.save({"ids": torch.tensor(ids), "routes": routed}, f"{dump_dir}/routes_{request_id}.pt")


def _random_model(hf_config, seed: int):
    """The causal LM of ``hf_config``: fp32, SDPA attention, seeded random weights, eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, torch_dtype=torch.float32, attn_implementation="sdpa"
    )  # verl's model config asks for flash-attention 2, a CUDA package
    return model.eval()


def _eos_ids(model_config) -> set[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    found: set[int] = set()
    for source in (model_config.generation_config, model_config.hf_config, model_config.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        found.update(value if isinstance(value, list | tuple) else [value])
    return {int(v) for v in found}


def load_exported(model, weights: dict) -> None:
    """Copy ``weights`` (HF name -> tensor) into ``model``: every name must be one of the model's,
    and every model weight must be given (a tied ``lm_head.weight`` follows the embedding)."""
    state = model.state_dict()
    weights = fuse_experts(weights, state)
    unknown = sorted(set(weights) - set(state))
    if unknown:
        raise ValueError(f"rollout.name={NAME}: weights the model does not have: {unknown[:5]}")
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = sorted(n for n in set(state) - set(weights) if not (tied and n == "lm_head.weight"))
    if missing:
        raise ValueError(f"rollout.name={NAME}: the sync did not send {missing[:5]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            state[name].copy_(tensor.to(state[name].dtype))


EXPERT = re.compile(r"(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+_proj)\.weight")


def fuse_experts(weights: dict, state: dict) -> dict:
    """``weights`` with per-expert tensors (``…experts.{e}.gate_proj / up_proj / down_proj.weight``,
    the names the actor exports, as vLLM loads them) stacked into the fused tensors of
    transformers 5's MoE blocks where ``state`` has them: ``…experts.gate_up_proj`` ``[E, 2I, H]``
    (gate rows, then up) and ``…experts.down_proj`` ``[E, H, I]``."""
    fused, parts = {}, collections.defaultdict(dict)
    for name, tensor in weights.items():
        match = EXPERT.fullmatch(name)
        if match and f"{match['experts']}.gate_up_proj" in state:
            parts[match["experts"], match["proj"]][int(match["e"])] = tensor
        else:
            fused[name] = tensor
    experts_blocks = {experts for experts, _ in parts}
    for experts in experts_blocks:
        stacked = {proj: torch.stack([by_e[e] for e in sorted(by_e)])
                   for (block, proj), by_e in parts.items() if block == experts}  # fmt: skip
        fused[f"{experts}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], 1)
        fused[f"{experts}.down_proj"] = stacked["down_proj"]
    return fused


def _load_replica():
    return HfCpuReplica


def register() -> None:
    """Register ``hf_cpu`` in verl's adapter registry and replica registry (idempotent)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HfCpuRollout"
    RolloutReplicaRegistry.register(NAME, _load_replica)


def _register_if_active() -> None:
    """The end of this module's import: register when the switch ran while it was half built."""
    from . import platform

    if platform.active():
        register()


_register_if_active()
