"""Router replay (verl's R2 and R3) through verl 0.9.1's ``TrainingWorker`` and the plugin's engine
on the CPU: verl's own replay code (``router_replay_patch``, ``router_replay_utils``) drives the
plugin's ``NPUTopKRouter``.

verl moves the routes with ``.to(get_device_name())``; on a machine without an accelerator the CPU
runtime's platform answers ``"cuda"`` (verl's process-group string ``cpu:gloo,{device}:gloo``
refuses ``"cpu"`` twice) and its function mode lands ``Tensor.to("cuda")`` on the CPU, as it
lands ``device="cuda"`` (``mcore_npu.cpu.shims.CudaFactoriesOnCpu``).

- **R2**: ``compute_log_prob`` records each token's experts; the router weights are then
  perturbed; the update (``train_mini_batch``) routes every token of every MoE layer to the
  recorded experts. The control, the same perturbation without replay, routes some tokens
  elsewhere: the check can fail. In thd, and with full recompute (verl's ``REPLAY_BACKWARD``:
  the recomputed forward replays too).
- **R3**: routes given in the batch (a rollout's) are the ones ``compute_log_prob`` and the update
  use, for every token verl replays (all but each sequence's last); loss and grad norm finite,
  the grad norm non-zero.
- What replay cannot run with (bshd, ``pad_to_length``) is refused in one line before any model.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("verl")

from tests.integrations import verl_loop as loop

pytestmark = pytest.mark.usefixtures("cpu_runtime", "own_attention_variables")

TOP_K = 2  # the tiny Qwen3-MoE's


def _worker(path, mode: str, *, thd: bool = True, keys: dict | None = None):
    from verl.workers.config.engine import EngineRouterReplayConfig

    config = loop.worker_config(
        path,
        remove_padding=thd,
        router_replay=EngineRouterReplayConfig(mode=mode),
        override_transformer_config=dict(keys or {}),
    )
    return loop.new_worker(config, loop.ppo_loss_fn())


def _routers(worker) -> list:
    """The MoE routers, in layer order."""
    model = worker.engine.module[0]
    return [m for name, m in model.named_modules() if name.endswith("mlp.router")]


@contextlib.contextmanager
def _routes_used(worker):
    """Yield a list that collects, per router call, ``(layer, [T, E] bool routing map)``, and
    per model call ``(-1, input_ids)``."""
    seen, handles = [], []
    for layer, router in enumerate(_routers(worker)):

        def hook(module, args, output, layer=layer):
            seen.append((layer, output[1].detach().clone()))  # [T, E]: each token's experts

        handles.append(router.register_forward_hook(hook))

    def model_input(module, args, kwargs):
        seen.append((-1, kwargs.get("input_ids", args[0] if args else None).detach().clone()))

    model = worker.engine.module[0]
    while not hasattr(model, "decoder"):
        model = model.module
    handles.append(model.register_forward_pre_hook(model_input, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _maps(seen, layer: int) -> list[torch.Tensor]:
    """The ``[T, E]`` routing maps of ``layer``, one per router call, in call order."""
    return [routing for n, routing in seen if n == layer]


def _recorded(routes) -> list[torch.Tensor]:
    """``[T, k]`` per layer of a jagged ``[B, j, L, k]`` route tensor, sorted per token."""
    flat = torch.cat(list(routes.unbind())).long()
    return [flat[:, n].sort(dim=-1).values for n in range(flat.shape[1])]


def _routes_by_sample(seen, layer: int, samples: list[torch.Tensor], calls: int = 1):
    """``[calls, T, k]``: ``layer``'s sorted expert ids of every real token, samples in order.

    Each model call is one micro-batch: packed ``[1, T]`` ids (thd, rows in sample order) or
    right-padded ``[B, S]`` rows whose tokens the router sees as ``[S, B]`` (bshd); a row is
    matched to its sample by its ids. ``calls`` router calls per micro-batch (2 under full
    recompute: the forward, then the recomputed one)."""
    inputs = [ids for n, ids in seen if n == -1]
    maps = _maps(seen, layer)
    assert len(maps) == calls * len(inputs), (len(maps), len(inputs))
    out = []
    for c in range(calls):
        found = {}
        for g, ids in enumerate(inputs):
            routing = maps[g * calls + c]
            rows = [ids.flatten()] if ids.shape[0] == 1 else list(ids)
            for b, row in enumerate(rows):
                offset = 0
                while offset < row.numel() and len(found) < len(samples):
                    k = _sample_at(row[offset:], samples, found)
                    if k is None:
                        break
                    n = samples[k].numel()
                    at = (torch.arange(offset, offset + n) if len(rows) == 1
                          else torch.arange(n) * len(rows) + b)  # fmt: skip
                    found[k] = routing[at]
                    offset += n
        assert sorted(found) == list(range(len(samples))), sorted(found)
        routing = torch.cat([found[k] for k in range(len(samples))])
        out.append(routing.nonzero()[:, 1].view(routing.shape[0], -1).sort(dim=-1).values)
    return torch.stack(out)


def _sample_at(ids: torch.Tensor, samples, found) -> int | None:
    """The sample (not yet found) whose tokens start ``ids``."""
    for k, sample in enumerate(samples):
        n = sample.numel()
        if k not in found and ids.numel() >= n and torch.equal(ids[:n], sample):
            return k
    return None


def _perturb(worker, seed: int = 7) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in _routers(worker):
            noise = torch.randn(router.weight.shape, generator=generator)
            router.weight.add_(noise.to(router.weight.dtype))


def _record(worker, batch):
    """verl's ``compute_log_prob`` with replay on (R2 records): the jagged routes."""
    from verl.utils import tensordict_utils as tu

    data = loop.to_engine_layout(batch, calculate_entropy=True, compute_loss=False,
                                 enable_routing_replay=True)  # fmt: skip
    return tu.get(worker.infer_batch(data), "routed_experts")


def _update(worker, batch, routes=None):
    """One ``train_mini_batch`` (verl's ``update_actor``) with ``routes`` as ``routed_experts``."""
    from verl.utils import tensordict_utils as tu

    size = batch.batch_size[0]
    meta = dict(global_batch_size=size, mini_batch_size=size, epochs=1, seed=42,
                dataloader_kwargs={"shuffle": False})  # fmt: skip
    if routes is not None:
        meta["enable_routing_replay"] = True
    data = loop.to_engine_layout(_with_advantages(batch), **meta)
    if routes is not None:
        data["routed_experts"] = routes
    return tu.get(worker.train_mini_batch(data), "metrics")


def _with_advantages(batch):
    batch = batch.clone()
    batch["advantages"] = loop.grpo_advantages(batch)
    batch["old_log_probs"] = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    return batch


FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 1}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "keys"),
    [("qwen3_moe", {}), ("qwen3_moe", FULL_RECOMPUTE), ("deepseek_v3", {})],
    ids=["thd", "thd_full_recompute", "dense_and_moe_layers"],
)
def test_r2_replays_the_recorded_experts_after_the_router_moves(family, keys, request):
    """``deepseek_v3``: the tiny DeepSeek-V3 (a dense first layer, then MoE; grouped sigmoid
    routing)."""
    path = request.getfixturevalue({"qwen3_moe": "qwen3_moe",
                                    "deepseek_v3": "tiny_deepseek_v3_model"}[family])  # fmt: skip
    batch, thd = loop.rollout_batch(), True
    worker = _worker(path, "R2", thd=thd, keys=keys)
    with _routes_used(worker) as recording:
        recorded = _record(worker, batch)
    samples = _samples(batch)
    calls = 2 if keys else 1  # full recompute runs every router's forward again
    want = _recorded(recorded)
    for layer, w in enumerate(want):  # the routes verl returns are the ones the routers chose
        assert torch.equal(_routes_by_sample(recording, layer, samples)[0], w), layer
    _perturb(worker)
    with _routes_used(worker) as seen:
        metrics = _update(worker, batch, routes=recorded)
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"])).all()
    for layer, w in enumerate(want):
        for part in _routes_by_sample(seen, layer, samples, calls):
            assert torch.equal(part, w), f"layer {layer}: a token left its recorded experts"

    control = _worker(path, "disabled", thd=thd, keys=keys)  # the same start, no replay
    _perturb(control)
    with _routes_used(control) as seen:
        _update(control, batch)
    moved = [float((_routes_by_sample(seen, n, samples, calls)[0] != w).any(-1).float().mean())
             for n, w in enumerate(want)]  # fmt: skip
    print(f"R2 ({family}, thd{', full recompute' if keys else ''}): tokens routed "
          f"elsewhere without replay, per layer {moved}")  # fmt: skip
    assert max(moved) > 0


def test_r3_uses_the_rollouts_experts_in_log_probs_and_update(qwen3_moe):
    from verl.utils import tensordict_utils as tu

    batch = loop.rollout_batch()
    worker = _worker(qwen3_moe, "R3")
    layers, experts = len(_routers(worker)), worker.engine.tf_config.num_moe_experts
    generator = torch.Generator().manual_seed(3)
    lengths = batch["attention_mask"].sum(-1).tolist()
    given = [torch.stack([torch.randperm(experts, generator=generator)[:TOP_K]
                          for _ in range(n * layers)]).view(n, layers, TOP_K)
             for n in lengths]  # fmt: skip
    routes = torch.nested.as_nested_tensor([g.to(torch.int16) for g in given], layout=torch.jagged)
    want = [torch.cat([g[:-1, n] for g in given]).sort(dim=-1).values for n in range(layers)]

    data = loop.to_engine_layout(batch, calculate_entropy=True, compute_loss=False,
                                 enable_routing_replay=True)  # fmt: skip
    data["routed_experts"] = routes
    with _routes_used(worker) as seen:
        log_probs = tu.get(worker.infer_batch(data), "log_probs")
    _check_replayed(seen, want, _samples(batch))
    assert torch.isfinite(torch.cat(list(log_probs.unbind()))).all()

    with _routes_used(worker) as seen:
        metrics = _update(worker, batch, routes=routes)
    _check_replayed(seen, want, _samples(batch))
    loss, norm = (float(torch.tensor(metrics[k]).float().mean())
                  for k in ("actor/pg_loss", "grad_norm"))  # fmt: skip
    print(f"R3: pg_loss {loss:.4f}, grad norm {norm:.4f}")
    assert torch.isfinite(torch.tensor([loss, norm])).all() and norm > 0


def _check_replayed(seen, want: list[torch.Tensor], samples) -> None:
    """Every token but each sequence's last (which verl leaves native) took the given experts."""
    keep = torch.cat([torch.arange(s.numel()) < s.numel() - 1 for s in samples])
    for layer, w in enumerate(want):
        got = _routes_by_sample(seen, layer, samples)[0]
        assert torch.equal(got[keep], w), f"layer {layer}: a token left the rollout's experts"


def _samples(batch) -> list[torch.Tensor]:
    """Each sample's tokens (prompt and response, no padding)."""
    keep = batch["attention_mask"].bool()
    return [ids[k] for ids, k in zip(batch["input_ids"], keep, strict=True)]


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"remove_padding": False}, "use_remove_padding=False"),
     ({"pad_to_length": True}, "pad_to_length")],
    ids=["bshd", "pad_to_length"],
)  # fmt: skip
def test_what_replay_cannot_run_with_is_refused_before_the_model(qwen3_moe, fields, named):
    """bshd (verl 0.9.1 lays the routes out as [B, S], Megatron's router takes [S, B]) and
    ``pad_to_length`` (verl raises mid-step) stop in one line naming the setting, no model built."""
    from verl.workers.config.engine import EngineRouterReplayConfig

    config = loop.worker_config(qwen3_moe, router_replay=EngineRouterReplayConfig(mode="R2"),
                                **fields)  # fmt: skip
    with pytest.raises(ValueError, match=named) as info:
        loop.new_worker(config, loop.ppo_loss_fn())
    assert "\n" not in str(info.value) and "router_replay.mode: R2" in str(info.value)
