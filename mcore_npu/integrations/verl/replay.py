"""verl 0.9.1's router replay (``router_replay.mode``: R2, R3) with the plugin's engine.

thd runs verl's own forward and replay utilities. bshd runs the engine's own forward
(:mod:`.forward`), whose router sees this CP rank's right-padded ``[B, S/CP]`` rows as
``[S/CP · B]`` tokens, sequence first (split over TP under SP), where verl's utilities lay routes
out as packed thd tokens: :func:`bshd_replay` moves verl's jagged ``[B, j, L, k]`` routes to and
from that order through verl's own replay state. Replay masks: **True = replay the given
experts**; padding keeps the router's own choice. Refused in one line before any model
(:func:`refuse_replay_settings`): what verl raises on mid-step, and bshd with a forward only verl
prepares. docs/router_replay.md.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from verl.utils import tensordict_utils as tu
from verl.utils.megatron.router_replay_patch import RouterReplayAction
from verl.utils.megatron.router_replay_utils import (
    align_r3_router_replay_data,
    build_r3_replay_mask,
    is_moe_layer,
    iter_model_routers,
    set_model_router_replay_action,
)
from verl.utils.megatron_utils import unwrap_model

from mcore_npu.integrations.verl.bshd import RightPadded

__all__ = ["bshd_replay", "refuse_replay_settings"]


def refuse_replay_settings(engine_config, *, mtp: bool = False) -> None:
    """Raise ``ValueError`` naming the setting router replay cannot run with (``mtp``: the
    model config's ``mtp.enable``)."""
    mode = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    if mode == "disabled":
        return
    overrides = dict(engine_config.override_transformer_config or {})
    if mtp and not engine_config.use_remove_padding:
        raise ValueError(
            f"mtp.enable: True with router_replay.mode: {mode} in bshd (use_remove_padding=False); "
            "verl's MTP forward lays routes out as thd: set use_remove_padding=True"
        )
    if getattr(engine_config, "pad_to_length", False):
        raise ValueError(
            f"pad_to_length: True with router_replay.mode: {mode}; verl does not replay routes "
            "into padded buckets: set pad_to_length=False"
        )
    if getattr(engine_config, "dynamic_context_parallel", False) and overrides.get(
        "moe_router_fusion"
    ):
        raise ValueError(
            f"override_transformer_config.moe_router_fusion: True with router_replay.mode: {mode} "
            "under dynamic_context_parallel; verl replays through the unfused router only: set "
            "moe_router_fusion=False"
        )


@contextlib.contextmanager
def bshd_replay(engine, model, batch, padded: RightPadded):
    """Around one bshd forward of ``model``: verl's replay actions, the targets of a replayed
    micro-batch (``routed_experts``, R3 aligned and masked as verl does), and the routes of an R2
    record appended to ``engine.mini_layer_topk_idx_list``. A no-op without replay."""
    if not engine.enable_routing_replay:
        yield
        return
    unwrapped = unwrap_model(model)
    routers = sorted(iter_model_routers(unwrapped), key=lambda item: item[0])
    actions = {router.router_replay_action for _, router in routers}
    if RouterReplayAction.REPLAY_BACKWARD in actions:  # a new micro-batch after a backward
        set_model_router_replay_action(unwrapped, RouterReplayAction.REPLAY_FORWARD)
    replaying = bool(routers) and routers[0][1].router_replay_action == (
        RouterReplayAction.REPLAY_FORWARD
    )
    if replaying:
        _set_targets(engine, routers, batch, padded)
    yield
    if tu.get_non_tensor_data(batch, key="record_r2_routes", default=False):
        engine.mini_layer_topk_idx_list.append(_recorded(engine.tf_config, routers, padded))
    if replaying:  # the recomputed forward in the backward pops its own targets
        set_model_router_replay_action(unwrapped, RouterReplayAction.REPLAY_BACKWARD)


def _set_targets(engine, routers, batch, padded: RightPadded) -> None:
    routes, input_ids = batch.get("routed_experts", None), batch["input_ids"]
    if routes is None:
        raise RuntimeError(
            "router_replay REPLAY: micro_batch has no routed_experts; R2's compute_log_prob "
            "records them before the actor update"
        )
    keep = padded.keep
    if engine.engine_config.router_replay.mode == "R3":
        routes = align_r3_router_replay_data(routes, input_ids)
        r3_mask = build_r3_replay_mask(input_ids, batch["response_mask"]).to(torch.uint8)
        keep = keep & padded.pad(r3_mask).bool()
    config = engine.tf_config
    with torch.no_grad():
        targets = _router_order(padded.local(padded.pad(routes)), config)  # [T, L, k]
        mask = _router_order(padded.local(keep), config)  # [T]
    by_layer = targets.shape[1] == config.num_layers  # R3 (or all MoE): every layer's routes
    moe_before = partial(_moe_layers_before, config)  # R2's routes: MoE layers only
    indices = {number: number - 1 if by_layer else moe_before(number) for number, _ in routers}
    missing = [number for number, index in indices.items() if index >= targets.shape[1]]
    if missing:
        raise RuntimeError(
            f"router_replay REPLAY data does not cover every forwarded MoE layer: layers "
            f"{missing} (1-based), routes for {targets.shape[1]} layers"
        )
    for number, router in routers:
        router.set_target_indices(targets[:, indices[number]].long(), replay_mask=mask)


def _moe_layers_before(config, number: int) -> int:
    """MoE layers before layer ``number`` (1-based): its index in R2's routes, as verl counts."""
    return sum(1 for i in range(number - 1) if is_moe_layer(config, i))


def _router_order(rows: torch.Tensor, config) -> torch.Tensor:
    """``[B, S, ...]`` -> ``[S·B / TP, ...]``: the router's tokens, sequence first, this TP rank's
    share under SP."""
    tokens = rows.transpose(0, 1).reshape(-1, *rows.shape[2:])
    return scatter_to_sequence_parallel_region(tokens) if config.sequence_parallel else tokens


def _recorded(config, routers, padded: RightPadded) -> torch.Tensor:
    """Jagged ``[B, j, L, k]`` int16 on the host: the recorded experts of this stage's MoE
    layers for every real token, as verl's ``merge_router_topk_indices`` returns them."""
    if not routers:  # a pipeline stage without MoE layers: no routes, every row its length
        k = config.moe_router_topk
        empty = torch.empty(padded.batch, padded.seq, 0, k, dtype=torch.int16)
        return padded.unpad(empty.to(padded.keep.device)).cpu()
    tokens = torch.stack([r.recorded_topk_idx.to(torch.int16) for _, r in routers], dim=1)
    tokens = tokens.contiguous().view(torch.uint8)  # [T, L, 2k]: collectives take bytes
    if config.sequence_parallel:
        tokens = gather_from_sequence_parallel_region(tokens, tensor_parallel_output_grad=False)
    local = tokens.view(-1, padded.batch, *tokens.shape[1:]).transpose(0, 1)  # [B, S/CP, ..]
    rows = padded.gather(local.contiguous()).view(torch.int16)
    return padded.unpad(rows).cpu()
