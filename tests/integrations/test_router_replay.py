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
  elsewhere: the check can fail. In thd (verl's forward) and bshd (the engine's own: right-padded
  rows the router takes as ``[S, B]``), and with full recompute (verl's ``REPLAY_BACKWARD``: the
  recomputed forward replays too).
- **R3**: routes given in the batch (a rollout's) are the ones ``compute_log_prob`` and the update
  use, for every token verl replays (all but each sequence's last); loss and grad norm finite,
  the grad norm non-zero; thd and bshd.
- What replay cannot run with (MTP in bshd, ``pad_to_length``) is refused in one line before any
  model.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from tests.integrations import verl_loop as loop
from tests.integrations.replay_checks import (
    perturb_routers,
    record_routes,
    recorded_routes,
    replay_worker,
    routers,
    routes_by_sample,
    routes_used,
    samples_of,
    update_with_routes,
)

pytestmark = pytest.mark.usefixtures("cpu_runtime", "own_attention_variables")

TOP_K = 2  # the tiny Qwen3-MoE's


FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 1}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "keys", "thd"),
    [("qwen3_moe", {}, True), ("qwen3_moe", FULL_RECOMPUTE, True), ("deepseek_v3", {}, True),
     ("qwen3_moe", {}, False), ("deepseek_v3", FULL_RECOMPUTE, False)],
    ids=["thd", "thd_full_recompute", "dense_and_moe_layers", "bshd",
         "bshd_dense_and_moe_full_recompute"],
)  # fmt: skip
def test_r2_replays_the_recorded_experts_after_the_router_moves(family, keys, thd, request):
    """``deepseek_v3``: the tiny DeepSeek-V3 (a dense first layer, then MoE; grouped sigmoid
    routing). bshd: the engine's own forward, right-padded rows the router sees as ``[S, B]``."""
    path = request.getfixturevalue({"qwen3_moe": "qwen3_moe",
                                    "deepseek_v3": "tiny_deepseek_v3_model"}[family])  # fmt: skip
    batch = loop.rollout_batch()
    worker = replay_worker(path, "R2", thd=thd, keys=keys)
    with routes_used(worker) as recording:
        recorded = record_routes(worker, batch)
    samples = samples_of(batch)
    calls = 2 if keys else 1  # full recompute runs every router's forward again
    want = recorded_routes(recorded)
    for layer, w in enumerate(want):  # the routes verl returns are the ones the routers chose
        assert torch.equal(routes_by_sample(recording, layer, samples)[0], w), layer
    perturb_routers(worker)
    with routes_used(worker) as seen:
        metrics = update_with_routes(worker, batch, routes=recorded)
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"])).all()
    for layer, w in enumerate(want):
        for part in routes_by_sample(seen, layer, samples, calls):
            assert torch.equal(part, w), f"layer {layer}: a token left its recorded experts"

    control = replay_worker(path, "disabled", thd=thd, keys=keys)  # the same start, no replay
    perturb_routers(control)
    with routes_used(control) as seen:
        update_with_routes(control, batch)
    moved = [float((routes_by_sample(seen, n, samples, calls)[0] != w).any(-1).float().mean())
             for n, w in enumerate(want)]  # fmt: skip
    print(f"R2 ({family}, {'thd' if thd else 'bshd'}{', full recompute' if keys else ''}): tokens routed "
          f"elsewhere without replay, per layer {moved}")  # fmt: skip
    assert max(moved) > 0


@pytest.mark.parametrize("thd", [True, False], ids=["thd", "bshd"])
def test_r3_uses_the_rollouts_experts_in_log_probs_and_update(qwen3_moe, thd):
    from verl.utils import tensordict_utils as tu

    batch = loop.rollout_batch()
    worker = replay_worker(qwen3_moe, "R3", thd=thd)
    layers, experts = len(routers(worker)), worker.engine.tf_config.num_moe_experts
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
    with routes_used(worker) as seen:
        log_probs = tu.get(worker.infer_batch(data), "log_probs")
    _check_replayed(seen, want, samples_of(batch))
    assert torch.isfinite(torch.cat(list(log_probs.unbind()))).all()

    with routes_used(worker) as seen:
        metrics = update_with_routes(worker, batch, routes=routes)
    _check_replayed(seen, want, samples_of(batch))
    loss, norm = (float(torch.tensor(metrics[k]).float().mean())
                  for k in ("actor/pg_loss", "grad_norm"))  # fmt: skip
    print(f"R3 ({'thd' if thd else 'bshd'}): pg_loss {loss:.4f}, grad norm {norm:.4f}")
    assert torch.isfinite(torch.tensor([loss, norm])).all() and norm > 0


def _check_replayed(seen, want: list[torch.Tensor], samples) -> None:
    """Every token but each sequence's last (which verl leaves native) took the given experts."""
    keep = torch.cat([torch.arange(s.numel()) < s.numel() - 1 for s in samples])
    for layer, w in enumerate(want):
        got = routes_by_sample(seen, layer, samples)[0]
        assert torch.equal(got[keep], w), f"layer {layer}: a token left the rollout's experts"


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"remove_padding": False, "mtp": True}, "mtp.enable"),
     ({"pad_to_length": True}, "pad_to_length")],
    ids=["bshd_mtp", "pad_to_length"],
)  # fmt: skip
def test_what_replay_cannot_run_with_is_refused_before_the_model(qwen3_moe, fields, named):
    """bshd with MTP (verl's MTP forward lays the routes out as thd) and ``pad_to_length`` (verl
    raises mid-step) stop in one line naming the setting, no model built."""
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.config.model import MtpConfig

    fields = dict(fields)
    if fields.pop("mtp", False):
        fields["model"] = {"mtp": MtpConfig(enable=True)}

    config = loop.worker_config(qwen3_moe, router_replay=EngineRouterReplayConfig(mode="R2"),
                                **fields)  # fmt: skip
    with pytest.raises(ValueError, match=named) as info:
        loop.new_worker(config, loop.ppo_loss_fn())
    assert "\n" not in str(info.value) and "router_replay.mode: R2" in str(info.value)


def test_a_stage_without_moe_layers_records_empty_routes_for_every_row():
    """bshd R2 record on a pipeline stage without routers (DeepSeek-V3's dense first layers):
    a ``[j, 0, k]`` int16 route per row, on the host, as verl's own record returns there."""
    from types import SimpleNamespace

    from mcore_npu.integrations.verl.bshd import RightPadded
    from mcore_npu.integrations.verl.replay import _recorded

    ids = torch.nested.as_nested_tensor([torch.arange(3), torch.arange(2)], layout=torch.jagged)
    config = SimpleNamespace(moe_router_topk=TOP_K, sequence_parallel=False)
    routes = _recorded(config, [], RightPadded(ids))
    assert [tuple(r.shape) for r in routes.unbind()] == [(3, 0, TOP_K), (2, 0, TOP_K)]
    assert routes.dtype == torch.int16 and routes.device.type == "cpu"
