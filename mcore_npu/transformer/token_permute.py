"""Fused MoE token permute without Transformer Engine: ``NPUMoELayer`` and its token dispatchers.

Megatron's ``MoELayer`` builds its dispatcher from ``config.moe_token_dispatcher_type`` and its
dispatchers call ``moe_utils.permute`` / ``unpermute``, which with ``moe_permute_fusion=True``
need Transformer Engine (and the config check refuses the flag without it). Here the intent
lives in the spec (``moe_permute_kernel``), never in ``config``:

- ``NPUMoELayer`` is Megatron's ``MoELayer`` whose alltoall / allgather dispatcher is replaced,
  right after Megatron built it, by the subclass below with the same arguments. The flex
  dispatcher stays Megatron's (its permute lives inside DeepEP / HybridEP).
- ``NPUAllGatherTokenDispatcher`` / ``NPUAlltoAllTokenDispatcher`` are Megatron 0.16.1's
  dispatchers with the two permutation steps (``permute`` of the tokens to the experts,
  ``unpermute`` back) through ``mcore_npu.ops.moe_token_(un)permute_with_routing_map``.
  The rest (communication, sorting chunks by local expert, shared-expert overlap) is
  Megatron's own code path. ``routing_map`` is [T, E] bool, True = token routed to expert.

Where ``auto`` finds a torch_npu without the ``_with_routing_map`` operators the registry's
policy holds: the reference permute, with one warning per process. Nothing is patched;
``config`` is read only.

megatron-core 0.15 has no ``MoESubmodules.router`` slot: its ``MoELayer`` builds ``TopKRouter``
itself, whose gating raises ``NameError`` without Transformer Engine (see ``router.py``). There
``NPURouterMoELayer`` (and ``NPUMoELayer``, derived from it) put an ``NPUTopKRouter`` with the
same weights in its place (``_npu_router``); the spec uses it where the permute is ``"off"``.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from mcore_npu.ops import moe_token_permute_with_routing_map, moe_token_unpermute_with_routing_map
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer import megatron_features
from mcore_npu.transformer.router import NPUTopKRouter


class _FusedPermute:
    """The permute / unpermute steps through ``mcore_npu.ops`` on ``self.permute_kernel``."""

    permute_kernel: str = "auto"

    def _permute(self, tokens, routing_map, *, probs=None, num_out_tokens=None,
                 drop_and_pad=False):  # fmt: skip
        """tokens [T, H], routing_map [T, E] (True = routed) -> (permuted, probs, indices)."""
        return moe_token_permute_with_routing_map(
            tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
            drop_and_pad=drop_and_pad, kernel=self.permute_kernel,
        )  # fmt: skip

    def _unpermute(self, permuted, sorted_indices, restore_shape, *, routing_map=None,
                   drop_and_pad=False):  # fmt: skip
        """permuted [N, H] -> [T, H] (restore_shape), rows summed per token."""
        return moe_token_unpermute_with_routing_map(
            permuted, sorted_indices, torch.Size(restore_shape), routing_map=routing_map,
            drop_and_pad=drop_and_pad, kernel=self.permute_kernel,
        )  # fmt: skip


class NPUAllGatherTokenDispatcher(_FusedPermute, MoEAllGatherTokenDispatcher):
    """Megatron's allgather dispatcher; its permute / unpermute go through the fused operators.

    Extra keyword: ``permute_kernel`` (``"auto"`` | ``"torch_npu"`` | ``"reference"``).
    """

    def __init__(self, *args, permute_kernel: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.permute_kernel = permute_kernel

    def dispatch_postprocess(self, hidden_states, probs):
        """Megatron 0.16.1's step: select the local experts' columns, permute the gathered
        tokens [T*EP, H] to them, pick their probs; returns (tokens, counts [E_local], probs)."""
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()  # [T*EP, E_local]
        self.local_probs = probs[:, first:last].contiguous()
        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()
        permuted, _, self.reversed_local_input_permutation_mapping = self._permute(
            hidden_states, self.local_map, num_out_tokens=tokens_per_expert.sum()
        )
        self.local_probs = self.local_probs.T.contiguous().masked_select(
            self.local_map.T.contiguous()
        )
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        """The experts' rows [N, H] back to the gathered tokens' order [T*EP, H]."""
        return self._unpermute(hidden_states, self.reversed_local_input_permutation_mapping,
                               self.hidden_shape_before_permute, routing_map=self.local_map)  # fmt: skip


class NPUAlltoAllTokenDispatcher(_FusedPermute, MoEAlltoAllTokenDispatcher):
    """Megatron's alltoall dispatcher; permutation 1 (tokens -> all-to-all input) and its
    inverse go through the fused operators. Extra keyword: ``permute_kernel``."""

    def __init__(self, *args, permute_kernel: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.permute_kernel = permute_kernel

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Megatron 0.16.1's step: communication metadata, then tokens [S, B, H] -> permuted
        [N, H] (grouped by expert) with their probs [N]."""
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        if probs.dim() != 2 or routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            raise ValueError(
                f"routing_map: expected [T, E] bool with probs [T, E], got routing_map "
                f"{list(routing_map.shape)} {routing_map.dtype}, probs {list(probs.shape)}; "
                "pass the router's outputs unchanged"
            )
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        if getattr(self.config, "moe_router_padding_for_quantization", False):  # 0.16+
            pad_multiple = moe_utils.get_align_size_for_quantization(self.config)
            self.routing_map = moe_utils.pad_routing_map(self.routing_map, pad_multiple)
        self.tokens_per_expert = self.preprocess(self.routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_1", self.tokens_per_expert
        )
        self.hidden_shape_before_permute = hidden_states.shape
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping = self._permute(
            hidden_states, self.routing_map, probs=probs, num_out_tokens=self.num_out_tokens,
            drop_and_pad=self.drop_and_pad,
        )  # fmt: skip
        return permuted, permuted_probs

    def combine_postprocess(self, permutated_local_input_tokens):
        """Megatron 0.16.1's step: shared experts' output, then the rows [N, H] back to the
        tokens [S, B, H]."""
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        output = self._unpermute(
            permutated_local_input_tokens, self.reversed_local_input_permutation_mapping,
            self.hidden_shape_before_permute, routing_map=self.routing_map,
            drop_and_pad=self.drop_and_pad,
        ).view(self.hidden_shape)  # fmt: skip
        if self.shared_experts is not None:
            output += self.shared_experts.get_output()
        return output


_DISPATCHERS = {
    MoEAllGatherTokenDispatcher: NPUAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher: NPUAlltoAllTokenDispatcher,
}


def _npu_router(router: TopKRouter, config, pg_collection) -> NPUTopKRouter:
    """An ``NPUTopKRouter`` holding ``router``'s parameters and buffers (megatron-core 0.15, where
    ``MoELayer`` builds ``TopKRouter`` itself); built under ``fork_rng`` so that the random
    streams of the modules built after it are those of Megatron's layer."""
    with torch.random.fork_rng(devices=[]):
        npu = NPUTopKRouter(config=config, pg_collection=pg_collection)
    npu.load_state_dict(router.state_dict())
    return npu.to(router.weight.device)


class NPURouterMoELayer(MoELayer):
    """Megatron's ``MoELayer``; on megatron-core 0.15 (no ``MoESubmodules.router`` slot) with
    :class:`NPUTopKRouter` in place of the ``TopKRouter`` Megatron builds (``_npu_router``)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 **megatron_kwargs):  # fmt: skip
        if pg_collection is None:
            pg_collection = moe_utils.get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, **megatron_kwargs)
        if type(self.router) is TopKRouter and not megatron_features.has("router_slot"):
            self.router = _npu_router(self.router, config, pg_collection)


class NPUMoELayer(NPURouterMoELayer):
    """Megatron's ``MoELayer`` with the fused-permute dispatchers (see the module docstring).

    Args:
        config, submodules, layer_number, pg_collection: as ``MoELayer``.
        permute_kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"`` for the permute
            operators of the alltoall and allgather dispatchers.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                 permute_kernel: str = "auto", **megatron_kwargs):  # fmt: skip
        check_kernel(permute_kernel, what="permute_kernel")  # 'off': Megatron's MoELayer
        if pg_collection is None:
            pg_collection = moe_utils.get_default_pg_collection()
        # megatron_kwargs: what newer MoELayers take (0.17+: is_mtp_layer; 0.18+: name)
        super().__init__(config, submodules, layer_number, pg_collection, **megatron_kwargs)
        self.permute_kernel = permute_kernel
        fused = _DISPATCHERS.get(type(self.token_dispatcher))
        if fused is None:
            return  # flex (or a future type): Megatron's own
        self.token_dispatcher = fused(self.num_local_experts, self.local_expert_indices,
                                      config=self.config, pg_collection=pg_collection,
                                      permute_kernel=permute_kernel)  # fmt: skip
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)
