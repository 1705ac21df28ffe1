"""DSA's core attention: the indexer's top-k, then absorbed MLA over those keys only.

Inputs are the absorbed form the NPU kernel takes (``attention_mode=2``): per-head query latents
``[.., n, kv_lora_rank]`` and one latent key/value head ``[.., 1, kv_lora_rank]``, with the RoPE
parts apart (``[.., n, rope]``, ``[.., 1, rope]``). Layouts: sbhd ``[s, b, ..]`` goes to the
operators as BSND, thd ``[t, ..]`` as TND with the packed sequences' ends, so no key is chosen
across a sequence boundary. See docs/dsa.md."""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from mcore_npu.masks import SeqLengthsMemo
from mcore_npu.ops import dsa
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer import context_parallel
from mcore_npu.transformer.context_parallel import chunks
from mcore_npu.transformer.context_parallel.all_gather import (
    GatherSequence,
    GatherTokens,
    thd_layout,
)
from mcore_npu.transformer.dsa.indexer import DSAIndexer
from mcore_npu.transformer.dsa.settings import check_cp_comm_type, dsa_settings, loss_scaler
from mcore_npu.transformer.dsa.share import TopKShare


class NPUSparseAttention(MegatronModule):
    """The ``core_attention`` of :class:`NPUDSASelfAttention`; owns the ``indexer``.

    Args:
        config, layer_number, softmax_scale: as Megatron's core attention gets them from MLA.
        kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"`` for the three DSA operators, unless
            ``lightning_indexer_kernel`` / ``sparse_attention_kernel`` / ``indexer_loss_kernel``
            name one (None: ``kernel``).
        dsa_indexer_rope_interleaved, dsa_indexer_k_norm_epsilon, dsa_indexer_topk_freq,
            dsa_indexer_skip_topk_offset: the spec keywords (:func:`dsa_settings`).
        topk_share: the spec's :class:`TopKShare`, where layers share their top-k; a layer
            that reuses an earlier one's has no indexer.
    """

    def __init__(
        self,
        config,
        layer_number,
        *,
        softmax_scale: float,
        kernel: str = "auto",
        seq_lengths_memo: SeqLengthsMemo | None = None,
        dsa_indexer_rope_interleaved: bool | None = None,
        dsa_indexer_k_norm_epsilon: float | None = None,
        dsa_indexer_topk_freq: int | None = None,
        dsa_indexer_skip_topk_offset: int | None = None,
        topk_share: TopKShare | None = None,
        lightning_indexer_kernel: str | None = None,
        sparse_attention_kernel: str | None = None,
        indexer_loss_kernel: str | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **_megatron_keywords,
    ):
        super().__init__(config=config)
        chosen = (lightning_indexer_kernel, sparse_attention_kernel, indexer_loss_kernel)
        self.kernels = dict(zip(("indexer", "attention", "loss"), (k or kernel for k in chosen)))
        for what, value in self.kernels.items():
            check_kernel(value, what=f"{what} kernel")
        self.settings = dsa_settings(
            config,
            dsa_indexer_rope_interleaved,
            dsa_indexer_k_norm_epsilon,
            dsa_indexer_topk_freq,
            dsa_indexer_skip_topk_offset,
        )
        if self.settings.trains_indexer and not self.settings.sparse_loss:
            self.kernels["loss"] = _dense_loss_kernel(self.kernels["loss"])
        self.layer_number = layer_number
        self.cp_group = None
        if config.context_parallel_size > 1:
            check_cp_comm_type(context_parallel.layer_comm_type(config, layer_number, cp_comm_type))
            self.cp_group = context_parallel.context_parallel_group(pg_collection)
        self.head_group = _tensor_parallel_group(pg_collection, config)
        self.softmax_scale = softmax_scale
        self.seq_lengths_memo = seq_lengths_memo or SeqLengthsMemo()
        # itself: it runs its indexer; so does every MTP layer (numbered past the decoder's)
        mtp = layer_number > config.num_layers
        self.source = layer_number if mtp else self.settings.source_layer(layer_number)
        self.topk_share = None
        if self.settings.shares_topk:
            self.topk_share = topk_share if topk_share is not None else TopKShare()
        self.indexer = DSAIndexer(config, self.settings) if self.source == layer_number else None

    def forward(
        self, query, key, query_rope, key_rope, *, hidden, q_latent, rotate, packed_seq_params=None
    ):
        """Output latents ``[.., n, kv_lora_rank]`` in query's layout. ``hidden`` / ``q_latent``
        (this rank's tokens, detached) feed the indexer; ``rotate`` is MLA's RoPE step. Under CP
        the keys are gathered and each local query chunk attends to its prefix."""
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        weight, reused, index = None, None, (None, None, None)
        if self.indexer is None:  # this layer attends to the keys layer `source` chose
            reused = self.topk_share.calls(self.source, self.layer_number)
        else:
            trains = self.settings.trains_indexer and self.training and torch.is_grad_enabled()
            with torch.set_grad_enabled(trains):
                index = self.indexer(hidden, q_latent, rotate)
            weight = self._loss_weight(query.shape[:-2].numel()) if trains else None
            if self.topk_share is not None:
                self.topk_share.start(self.layer_number)
        queries, keys = (query, query_rope, index[0], index[2]), (key, key_rope, index[1])
        if self.cp_group is None:
            ends = self._ends(packed_seq_params) if thd else None
            return self._attend(queries, keys, _layout(thd, ends, ends), weight, reused)
        if thd:
            return self._attend_thd_cp(queries, keys, packed_seq_params, weight, reused)
        return self._attend_sbhd_cp(queries, keys, weight, reused)

    def _attend_sbhd_cp(self, queries, keys, weight, reused):
        """Each local chunk (``r``, ``2·CP-1-r``) against its prefix of the gathered keys."""
        group = self.cp_group
        keys = [_maybe(GatherSequence.apply, t, group) for t in keys]  # natural order
        chunk = queries[0].shape[0] // 2
        outs = []
        for half, chunk_id in enumerate(chunks.chunk_ids(group.rank(), group.size())):
            rows = slice(half * chunk, (half + 1) * chunk)
            prefix = [_part(t, slice(0, (chunk_id + 1) * chunk)) for t in keys]
            local = [_part(t, rows) for t in queries]
            outs.append(self._attend(local, prefix, _layout(), weight, reused))
        return torch.cat(outs)

    def _attend_thd_cp(self, queries, keys, params, weight, reused):
        """One TND call: each local chunk of a sequence against that sequence's prefix, laid out
        by one index into the gathered tokens (built once per batch layout)."""
        group, memo = self.cp_group, self.seq_lengths_memo
        local = memo.context_parallel_ends(_cu(params), group.size())
        index, q_ends, kv_ends = thd_layout(
            local, group.size(), group.rank(), True, None, queries[0].device, memo
        )
        keys = [_part(_maybe(GatherTokens.apply, t, group), index) for t in keys]
        return self._attend(queries, keys, _layout(True, q_ends, kv_ends), weight, reused)

    def _attend(self, queries, keys, layout, weight, reused=None):
        """Top-k selection and sparse attention of one call (sbhd as BSND, thd as TND);
        ``weight``: the indexer loss's (:meth:`_loss_weight`), None when it is not trained;
        ``reused``: the source layer's choices, call by call, on a layer without an indexer."""
        query, query_rope, index_q, weights = (_maybe(_to, t, layout) for t in queries)
        key, key_rope, index_k = (_maybe(_to, t, layout) for t in keys)
        if reused is not None:
            chosen = next(reused)
        else:
            chosen = self.select(index_q.detach(), index_k.detach(), weights.detach(), layout)
            if self.topk_share is not None:
                self.topk_share.put(self.layer_number, chosen)
        lengths = dict(
            actual_seq_lengths_query=layout["q_ends"], actual_seq_lengths_kv=layout["kv_ends"]
        )
        out, *stats = dsa.sparse_flash_attention(
            query,
            key,
            key,
            chosen,
            self.softmax_scale,
            query_rope=query_rope,
            key_rope=key_rope,
            layout_query=layout["name"],
            layout_kv=layout["name"],
            return_softmax_lse=weight is not None,
            kernel=self.kernels["attention"],
            **lengths,
        )
        if weight is not None:
            main = ((query, key), {"query_rope": query_rope, "key_rope": key_rope}, chosen, stats)
            loss = _IndexerLoss.apply(index_q, index_k, weights, main, layout, self)
            out = loss_scaler().apply(out, loss * weight)
        return _to(out, layout)

    def _loss_weight(self, rows: int) -> float:
        """The summed KL's weight: the coefficient over the query rows (their mean; under CP,
        this rank's ``rows`` times CP, as the main loss counts every rank's tokens, so the
        gradient averaged over CP ranks is one process's), or the coefficient alone with
        ``calculate_per_token_loss``."""
        coeff = self.settings.loss_coeff
        if self.config.calculate_per_token_loss:
            return coeff
        cp = 1 if self.cp_group is None else self.cp_group.size()
        return coeff / max(rows * cp, 1)

    def select(self, index_q, index_k, weights, layout, count=None):
        """int32 top-k key positions ``[.., 1, k]`` (-1 where fewer keys are visible)."""
        chosen, _ = dsa.lightning_indexer(
            index_q,
            index_k,
            weights,
            sparse_count=count or self.settings.topk,
            actual_seq_lengths_query=layout["q_ends"],
            actual_seq_lengths_key=layout["kv_ends"],
            layout_query=layout["name"],
            layout_key=layout["name"],
            kernel=self.kernels["indexer"],
        )
        return chosen

    def _ends(self, params) -> list[int]:
        """The packed sequences' ends, host ints without the leading 0."""
        return list(self.seq_lengths_memo.actual_seq_lengths(_cu(params)))


def _tensor_parallel_group(pg_collection, config):
    """The group the main attention's heads are split over (None without TP)."""
    if config.tensor_model_parallel_size == 1:
        return None
    group = getattr(pg_collection, "tp", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _cu(params):
    """The packed offsets the tokens are laid out by: the padded ones where given."""
    padded = params.cu_seqlens_q_padded
    return padded if padded is not None else params.cu_seqlens_q


def _dense_loss_kernel(kernel: str) -> str:
    """The KL loss over every visible key (``dsa_indexer_use_sparse_loss=False``) runs on the
    reference: the fused kernel takes the sparse attention's statistics, over the chosen keys."""
    if kernel == "torch_npu":
        raise ValueError(
            "indexer_loss_kernel: 'torch_npu' with dsa_indexer_use_sparse_loss=False; the fused "
            "indexer loss covers the chosen keys only: set dsa_indexer_use_sparse_loss=True, or "
            "pass indexer_loss_kernel='auto' / 'reference'"
        )
    return "reference"


def _layout(thd: bool = False, q_ends=None, kv_ends=None) -> dict:
    """The operators' layout: BSND, or TND with each segment's query / key ends."""
    if not thd:
        return {"name": "BSND", "q_ends": None, "kv_ends": None}
    return {"name": "TND", "q_ends": list(q_ends), "kv_ends": list(kv_ends)}


def _to(t, layout):
    """sbhd ``[s, b, ..]`` <-> BSND ``[b, s, ..]``; thd stays."""
    return t.transpose(0, 1) if layout["name"] == "BSND" else t


def _maybe(function, t, *args):
    """``function(t, *args)``, None for None (a layer without an indexer has no index tensors)."""
    return None if t is None else function(t, *args)


def _part(t, index):
    """``t[index]`` (a slice or an index tensor on the first dimension), None for None."""
    if t is None:
        return None
    return t[index] if isinstance(index, slice) else t.index_select(0, index)


class _IndexerLoss(torch.autograd.Function):
    """The indexer's KL loss against the main attention; its backward hands the operator's
    gradients of the index query, key and weights to the indexer (nothing else gets one)."""

    @staticmethod
    def forward(ctx, index_q, index_k, weights, main, layout, core):
        args, ropes, chosen, stats = main
        if not core.settings.sparse_loss:  # over every visible key
            chosen = core.select(index_q, index_k, weights, layout, args[1].shape[-3])
            stats = (None, None)
        d_q, d_k, d_w, loss = dsa.sparse_lightning_indexer_grad_kl_loss(
            *(a.detach() for a in args),
            index_q,
            index_k,
            weights,
            chosen,
            *stats,
            core.softmax_scale,
            **{k: v.detach() for k, v in ropes.items()},
            actual_seq_qlen=layout["q_ends"],
            actual_seq_klen=layout["kv_ends"],
            layout=layout["name"],
            head_group=core.head_group,
            kernel=core.kernels["loss"],
        )
        ctx.save_for_backward(d_q, d_k, d_w)
        return loss.reshape(())

    @staticmethod
    def backward(ctx, grad):
        d_q, d_k, d_w = ctx.saved_tensors
        return d_q * grad, d_k * grad, d_w * grad, None, None, None
