"""What verl 0.9.1's router replay (``router_replay.mode``: R2, R3) cannot run with, refused in one
line before any model is built (verl itself stops mid-step, or not at all).

- bshd (``use_remove_padding=False``): verl's replay lays the routes out as ``[B, S]`` rows while
  Megatron's router sees its tokens as ``[S, B]``; measured on the tiny Qwen3-MoE, the update
  gave real tokens no experts (docs/router_replay.md);
- ``pad_to_length``: verl raises in the forward ("not supported with router replay");
- ``moe_router_fusion`` with ``dynamic_context_parallel``: verl raises in the forward.
"""

from __future__ import annotations


def refuse_replay_settings(engine_config) -> None:
    """Raise ``ValueError`` naming the setting router replay cannot run with (see above)."""
    mode = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    if mode == "disabled":
        return
    overrides = dict(engine_config.override_transformer_config or {})
    if not engine_config.use_remove_padding:
        raise ValueError(
            f"router_replay.mode: {mode} with use_remove_padding=False (bshd); verl 0.9.1 replays "
            "routes in [B, S] order while Megatron's router takes [S, B]: set "
            "use_remove_padding=True (thd), as the replay recipes do"
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
