"""Log-probs of vocab-parallel logits whose one reduction is batch-invariant.

Batch-invariant (true on-policy) mode's log-probs: :func:`vocab_parallel_log_probs`, the
``log_softmax`` of logits split over the TP group's vocabulary, at the labels; its max is exact
whatever the order, its one sum goes through ``mcore_npu.ops.batch_invariant_sum``, the ranks'
parts are all-reduced. See docs/true_on_policy.md.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from mcore_npu.ops.batch_invariant_rows import batch_invariant_sum

__all__ = ["vocab_parallel_log_probs"]


def vocab_parallel_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, *, group=None, kernel: str = "auto"
) -> torch.Tensor:
    """``log_softmax(logits)[label]`` over a vocabulary split across ``group`` (TP; None = one
    rank): logits ``[*, V/tp]`` (this rank's vocabulary slice, in rank order), labels ``[*]``
    (global token ids) -> ``[*]`` float32, differentiable.

    ``max`` is exact whatever the order; the one sum, of ``exp(logit - max)`` over this rank's
    slice, goes through ``batch_invariant_sum``; the ranks' parts are all-reduced
    (``HCCL_DETERMINISTIC=strict`` fixes their order on an NPU).
    """
    x = logits.float()
    top = x.detach().amax(-1, keepdim=True)
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = x - top
    total = batch_invariant_sum(shifted.exp(), -1, kernel=kernel)
    width = x.shape[-1]
    first = width * (group.rank() if group is not None else 0)
    mine = (labels >= first) & (labels < first + width)
    local = torch.where(mine, labels - first, torch.zeros_like(labels))
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
    if group is not None and group.size() > 1:
        total = reduce_from_tensor_model_parallel_region(total, group=group)
        picked = reduce_from_tensor_model_parallel_region(picked, group=group)
    return picked - total.log()
