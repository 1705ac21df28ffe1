"""Fused MoE token permute without Transformer Engine: ``NPUMoELayer`` and its token dispatchers.

Megatron's fused permute (``moe_permute_fusion``) needs TE; here the intent lives in the spec
(``moe_permute_kernel``), never in ``config``. ``NPUMoELayer`` is Megatron's ``MoELayer`` whose
alltoall / allgather dispatcher is replaced, right after Megatron built it, by a subclass whose
``permute`` / ``unpermute`` go through ``mcore_npu.ops.moe_token_(un)permute_with_routing_map``
(``routing_map`` [T, E] bool, True = token routed to expert); the rest is Megatron's code. The flex
dispatcher stays Megatron's. On megatron-core 0.15 (no router slot) ``NPURouterMoELayer`` puts an
``NPUTopKRouter`` in place of Megatron's. See docs/moe.md."""

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

    def _permute(self, tokens, routing_map, **options):
        """tokens [T, H], routing_map [T, E] (True = routed) -> (permuted, probs, indices);
        ``options``: ``probs``, ``num_out_tokens``, ``drop_and_pad``."""
        kernel = self.permute_kernel
        return moe_token_permute_with_routing_map(tokens, routing_map, **options, kernel=kernel)

    def _unpermute(self, permuted, sorted_indices, restore_shape, **options):
        """permuted [N, H] -> [T, H] (restore_shape), rows summed per token; ``options``:
        ``routing_map``, ``drop_and_pad``."""
        shape, kernel = torch.Size(restore_shape), self.permute_kernel
        return moe_token_unpermute_with_routing_map(
            permuted, sorted_indices, shape, **options, kernel=kernel
        )


class NPUAllGatherTokenDispatcher(_FusedPermute, MoEAllGatherTokenDispatcher):
    """Megatron's allgather dispatcher, permute / unpermute through the fused operators
    (``permute_kernel``)."""

    def __init__(self, *args, permute_kernel: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.permute_kernel = permute_kernel

    def dispatch_postprocess(self, hidden_states, probs):
        """Megatron's step: the gathered tokens [T*EP, H] permuted to the local experts; returns
        (tokens, counts [E_local], probs)."""
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
        return self._unpermute(
            hidden_states,
            self.reversed_local_input_permutation_mapping,
            self.hidden_shape_before_permute,
            routing_map=self.local_map,
        )


class NPUAlltoAllTokenDispatcher(_FusedPermute, MoEAlltoAllTokenDispatcher):
    """Megatron's alltoall dispatcher, permutation 1 and its inverse through the fused operators
    (``permute_kernel``)."""

    def __init__(self, *args, permute_kernel: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.permute_kernel = permute_kernel

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Megatron's step: communication metadata, then tokens [S, B, H] -> permuted [N, H]
        (grouped by expert) with their probs [N]."""
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
        options = dict(probs=probs, num_out_tokens=self.num_out_tokens)
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping = self._permute(
            hidden_states, self.routing_map, **options, drop_and_pad=self.drop_and_pad
        )
        return permuted, permuted_probs

    def combine_postprocess(self, permutated_local_input_tokens):
        """Megatron's step: shared experts' output, then the rows [N, H] back to the tokens [S, B,
        H]."""
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        rows = (self.reversed_local_input_permutation_mapping, self.hidden_shape_before_permute)
        output = self._unpermute(
            permutated_local_input_tokens,
            *rows,
            routing_map=self.routing_map,
            drop_and_pad=self.drop_and_pad,
        ).view(self.hidden_shape)
        if self.shared_experts is not None:
            output += self.shared_experts.get_output()
        return output


_DISPATCHERS = {
    MoEAllGatherTokenDispatcher: NPUAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher: NPUAlltoAllTokenDispatcher,
}


def _npu_router(router: TopKRouter, config, pg_collection, batch_invariant_kernel=None):
    """An ``NPUTopKRouter`` (``BatchInvariantTopKRouter`` with ``batch_invariant_kernel``) holding
    ``router``'s parameters and buffers (megatron-core 0.15), built under ``fork_rng`` so later
    modules draw what Megatron's layer would."""
    from mcore_npu.transformer.batch_invariant import BatchInvariantTopKRouter

    kwargs = dict(config=config, pg_collection=pg_collection)
    with torch.random.fork_rng(devices=[]):
        if batch_invariant_kernel is None:
            npu = NPUTopKRouter(**kwargs)
        else:
            npu = BatchInvariantTopKRouter(**kwargs, batch_invariant_kernel=batch_invariant_kernel)
    npu.load_state_dict(router.state_dict())
    return npu.to(router.weight.device)


class NPURouterMoELayer(MoELayer):
    """Megatron's ``MoELayer``; on megatron-core 0.15 with :class:`NPUTopKRouter` in place of
    ``TopKRouter`` (batch-invariant mode: ``batch_invariant_kernel``'s router)."""

    takes_batch_invariant_kernel = True  # batch_invariant.route_linears passes it

    def __init__(
        self, config, submodules=None, layer_number=None, pg_collection=None,
        batch_invariant_kernel: str | None = None, **megatron_kwargs,
    ):  # fmt: skip
        if pg_collection is None:
            pg_collection = moe_utils.get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, **megatron_kwargs)
        if type(self.router) is TopKRouter and not megatron_features.has("router_slot"):
            self.router = _npu_router(self.router, config, pg_collection, batch_invariant_kernel)


class NPUMoELayer(NPURouterMoELayer):
    """Megatron's ``MoELayer`` with the fused-permute dispatchers; ``permute_kernel``: ``"auto"`` |
    ``"torch_npu"`` | ``"reference"``."""

    def __init__(
        self,
        config,
        submodules=None,
        layer_number=None,
        pg_collection=None,
        *,
        permute_kernel: str = "auto",
        **megatron_kwargs,
    ):
        check_kernel(permute_kernel, what="permute_kernel")  # 'off': Megatron's MoELayer
        if pg_collection is None:
            pg_collection = moe_utils.get_default_pg_collection()
        # megatron_kwargs: what newer MoELayers take (0.17+: is_mtp_layer; 0.18+: name)
        super().__init__(config, submodules, layer_number, pg_collection, **megatron_kwargs)
        self.permute_kernel = permute_kernel
        fused = _DISPATCHERS.get(type(self.token_dispatcher))
        if fused is None:
            return  # flex (or a future type): Megatron's own
        experts = (self.num_local_experts, self.local_expert_indices)
        self.token_dispatcher = fused(
            *experts, config=self.config, pg_collection=pg_collection, permute_kernel=permute_kernel
        )
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)
