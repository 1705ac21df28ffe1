"""Batch-invariant mode at TP=2 (with and without sequence parallelism) against one process.

Runs inside the CP=2 torchrun launch of ``cp_attention.py`` (:func:`cases`), on its two gloo
ranks, each layout with its own Megatron parallel state. The model is the tiny GPT of
tests/transformer/megatron_models.py from the NPU spec in the TE layout with
``batch_invariant=True`` (reference kernels), its output layer made batch-invariant, its
log-probs through ``vocab_parallel_log_probs`` over the TP group (vocab-parallel logits).

Per case: the largest log-prob and gradient differences from one process (TP splits the
matmuls' reductions, so close, not equal); without SP, whether each sequence's log-probs alone
have the bits of its row in a right-padded batch (at TP=2, every rank's).
"""

from __future__ import annotations

import torch

from mcore_npu.transformer.batch_invariant import make_batch_invariant
from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec
from mcore_npu.transformer.vocab_parallel import vocab_parallel_log_probs
from tests.distributed.mla_parallel import _relayout, _shard, _worst, load_shards
from tests.transformer.megatron_models import VOCAB, gpt, tiny_config

QK_NORMS = ("q_layernorm.weight", "k_layernorm.weight")  # per head: each rank sees its heads
LENGTHS = (24, 10, 16)  # the rows of the padded batch: every length even (SP splits by 2)


def _model(**config):
    built = tiny_config(**config)
    spec = get_gpt_decoder_block_npu_spec(built, kernel="reference", batch_invariant=True)
    model = gpt(built, spec, seed=5)
    make_batch_invariant(model.output_layer, "reference")
    return model


def _batch():
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=gen)
    return ids, torch.arange(ids.shape[1]).expand_as(ids)


def _log_probs(model, ids, pos, group):
    """``[B, S - 1]`` log p(token t+1) of the model's vocab-parallel logits."""
    logits = model(ids, pos, None)
    return vocab_parallel_log_probs(logits[:, :-1], ids[:, 1:], group=group)


def _one_process():
    model = _model()
    ids, pos = _batch()
    log_probs = _log_probs(model, ids, pos, None)
    log_probs.sum().backward()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return state, log_probs.detach(), grads


def _tp_case(sp: bool, reference) -> dict:
    from megatron.core import parallel_state

    state, want, want_grads = reference
    group = parallel_state.get_tensor_model_parallel_group()
    size, rank = group.size(), group.rank()
    model = _model(tensor_model_parallel_size=size, sequence_parallel=sp)
    shards = load_shards(model, state, size, rank)
    ids, pos = _batch()
    log_probs = _log_probs(model, ids, pos, group)
    log_probs.sum().backward()
    for name, p in model.named_parameters():  # as Megatron's finalize_model_grads: SP-tagged
        if getattr(p, "sequence_parallel", False) or name.endswith(QK_NORMS):  # and qk norms
            torch.distributed.all_reduce(p.grad, group=group)
    grads = max((p.grad - _shard(want_grads[n], shards.get(n), n, size, rank)).abs().max().item()
                for n, p in model.named_parameters())  # fmt: skip
    errors = _worst([(log_probs.detach() - want).abs().max().item(), grads], group)
    result = {"case": "batch_invariant", "tp": size, "sp": sp, "sharded": len(shards),
              "log_probs": errors[0], "grads": errors[1]}  # fmt: skip
    if not sp:
        result["alone_equal_padded"] = _alone_equal_padded(model, ids, pos, group, log_probs)
    return result


def _alone_equal_padded(model, ids, pos, group, padded) -> bool:
    """Each row's log-probs alone have the bits of its row in the padded batch, on every rank."""
    with torch.no_grad():
        same = all(
            torch.equal(_log_probs(model, ids[r : r + 1, :n], pos[r : r + 1, :n], group)[0],
                        padded[r, : n - 1].detach())
            for r, n in enumerate(LENGTHS)
        )  # fmt: skip
    flag = torch.tensor([0.0 if same else 1.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return flag.item() == 0.0


def cases() -> list[dict]:
    """Both TP cases on the two ranks; leaves Megatron's parallel state as it found it."""
    from megatron.core import parallel_state

    from mcore_npu.training import runtime

    before = runtime.ParallelLayout(
        tensor=parallel_state.get_tensor_model_parallel_world_size(),
        context=parallel_state.get_context_parallel_world_size(),
    )
    _relayout(runtime.ParallelLayout())
    reference = _one_process()
    _relayout(runtime.ParallelLayout(tensor=2))
    results = [_tp_case(sp, reference) for sp in (False, True)]
    _relayout(before)
    return results


if __name__ == "__main__":
    from mcore_npu.training import runtime

    rt = runtime.initialize(runtime.ParallelLayout(), seed=0)
    found = cases()
    if rt.launch.rank == 0:
        for result in found:
            print(result, flush=True)
    runtime.shutdown()
