"""Router replay checks shared by tests/integrations/test_router_replay.py (one process) and
verl_loop_ranks.py (torchrun): a worker with ``router_replay.mode``, the routes its routers take
(forward hooks: ``[T, E]`` routing maps per call), verl's R2 record and a replayed update."""

from __future__ import annotations

import contextlib

import torch

from tests.integrations import verl_loop as loop


def replay_worker(path, mode: str, *, thd: bool = True, keys: dict | None = None, **engine):
    """A worker whose engine replays with ``mode`` (``"disabled"``: none); ``keys``: the
    transformer overrides; ``engine``: more engine fields (parallel sizes)."""
    from verl.workers.config.engine import EngineRouterReplayConfig

    config = loop.worker_config(
        path,
        remove_padding=thd,
        router_replay=EngineRouterReplayConfig(mode=mode),
        override_transformer_config=dict(keys or {}),
        **engine,
    )
    return loop.new_worker(config, loop.ppo_loss_fn())


def routers(worker) -> list:
    """The MoE routers, in layer order."""
    model = worker.engine.module[0]
    return [m for name, m in model.named_modules() if name.endswith("mlp.router")]


@contextlib.contextmanager
def routes_used(worker):
    """Yield a list that collects, per router call, ``(layer, [T, E] bool routing map)``, and
    per model call ``(-1, input_ids)``."""
    seen, handles = [], []
    for layer, router in enumerate(routers(worker)):

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


@contextlib.contextmanager
def replay_masks(worker):
    """Yield a dict: per router (layer order), the replay mask of each of its calls
    (``[T]`` bool, **True = replayed**; None where the call replayed nothing)."""
    masks, handles = {}, []
    for layer, router in enumerate(routers(worker)):

        def hook(module, args, output, layer=layer):
            mask = module.router_replay.target_replay_mask
            masks.setdefault(layer, []).append(None if mask is None else mask.clone().bool())

        handles.append(router.register_forward_hook(hook))
    try:
        yield masks
    finally:
        for handle in handles:
            handle.remove()


def layer_maps(seen, layer: int) -> list[torch.Tensor]:
    """The ``[T, E]`` routing maps of ``layer``, one per router call, in call order."""
    return [routing for n, routing in seen if n == layer]


def recorded_routes(routes) -> list[torch.Tensor]:
    """``[T, k]`` per layer of a jagged ``[B, j, L, k]`` route tensor, sorted per token."""
    flat = torch.cat(list(routes.unbind())).long()
    return [flat[:, n].sort(dim=-1).values for n in range(flat.shape[1])]


def routes_by_sample(seen, layer: int, samples: list[torch.Tensor], calls: int = 1):
    """``[calls, T, k]``: ``layer``'s sorted expert ids of every real token, samples in order.

    Each model call is one micro-batch: packed ``[1, T]`` (or jagged) ids (thd, rows in order) or
    right-padded ``[B, S]`` rows whose tokens the router sees as ``[S, B]`` (bshd); a row is
    matched to its sample by its ids. ``calls`` router calls per micro-batch (2 under full
    recompute: the forward, then the recomputed one)."""
    inputs = [ids for n, ids in seen if n == -1]
    maps = layer_maps(seen, layer)
    assert len(maps) == calls * len(inputs), (len(maps), len(inputs))
    out = []
    for c in range(calls):
        found = {}
        for g, ids in enumerate(inputs):
            routing = maps[g * calls + c]
            if ids.is_nested:  # a later pipeline stage is handed verl's jagged ids: packed
                ids = torch.cat(list(ids.unbind()))[None]
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


def perturb_routers(worker, seed: int = 7) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in routers(worker):
            noise = torch.randn(router.weight.shape, generator=generator)
            router.weight.add_(noise.to(router.weight.dtype))


def record_routes(worker, batch):
    """verl's ``compute_log_prob`` with replay on (R2 records): the jagged routes."""
    from verl.utils import tensordict_utils as tu

    data = loop.to_engine_layout(batch, calculate_entropy=True, compute_loss=False,
                                 enable_routing_replay=True)  # fmt: skip
    output = worker.infer_batch(data)  # None on the ranks without outputs
    return None if output is None else tu.get(output, "routed_experts")


def update_with_routes(worker, batch, routes=None):
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
    output = worker.train_mini_batch(data)  # None on the ranks without outputs
    return None if output is None else tu.get(output, "metrics")


def _with_advantages(batch):
    batch = batch.clone()
    batch["advantages"] = loop.grpo_advantages(batch)
    batch["old_log_probs"] = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    return batch


def samples_of(batch) -> list[torch.Tensor]:
    """Each sample's tokens (prompt and response, no padding)."""
    keep = batch["attention_mask"].bool()
    return [ids[k] for ids, k in zip(batch["input_ids"], keep, strict=True)]
