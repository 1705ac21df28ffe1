"""A multi-latent-attention GPT under CP=2 (p2p, all_gather; a2a once) and TP=2 against one
process.

Runs inside the CP=2 torchrun launch of ``cp_attention.py`` (:func:`cases`; alone:
``torchrun --nproc-per-node 2 tests/distributed/mla_parallel.py``). Each layout gets its own
Megatron parallel state on the same two gloo ranks: first none (both ranks compute the
one-process answer themselves, no collective involved), then CP=2, then TP=2. The model is
tests/transformer/mla_models.py's tiny DeepSeek-V3-shaped one (q_lora_rank, yarn RoPE, D = 24,
Dv = 12) from the NPU spec in the TE layout, reference kernels.

Per case: the logits of this rank (its CP chunks; TP: gathered), every parameter gradient (CP:
summed over the ranks, as Megatron's DP x CP reduction does; TP: this rank's shard of the
one-process gradient) and the losses of 5 Adam steps; the worst error over the ranks.

And at TP=2 one checkpoint case (:func:`te_checkpoint_case`): the NPU spec's MLA down
projections are TP-sharded ``ColumnParallelLinear`` s, Megatron's TE MLA spec's are duplicated
``TELinear`` s (every TP rank holds the whole weight; ``TELinear.sharded_state_dict`` writes it
replicated, without a TP axis); dist checkpoints must move between the two.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from tests.transformer.mla_models import VOCAB, dsa_config, gpt, inputs, mla_config, npu_block

PACKED_CP = (4, 8, 4)  # every packed length divides by 2 * CP = 4
STEPS = 5
DSA_COEFF = 1.0

CP_CASES = [
    {"comm": "p2p", "format": "sbhd"},
    {"comm": "all_gather", "format": "sbhd"},
    {"comm": "p2p", "format": "thd"},
    {"comm": "all_gather", "format": "thd"},
    {"comm": "p2p", "format": "sbhd", "mla_value_padding": "on", "rope_kernel": "reference"},
    {"comm": "all_gather", "format": "thd", "rope_kernel": "reference"},
    {"comm": "a2a", "format": "sbhd"},
    {"comm": "all_gather", "format": "sbhd", "dsa": True},
    {"comm": "all_gather", "format": "thd", "dsa": True},
]
TP_CASES = [
    {"format": "sbhd"},
    {"format": "thd"},
    {"format": "sbhd", "q_lora_rank": None},
    {"format": "sbhd", "sequence_parallel": True},
    {"format": "sbhd", "sequence_parallel": True, "dsa": True},
    # Megatron 0.16.1's own get_query_key_value_tensors under TP=2 (the k_pos_emb gradient of
    # each rank's heads only): reported, expected to miss one process
    {"format": "sbhd", "megatrons_qkv": True},
]


def _relayout(layout):
    from megatron.core import parallel_state

    from mcore_npu.training import runtime

    parallel_state.destroy_model_parallel()
    return runtime.initialize(layout, seed=0)


def _model(case, **config):
    spec_keys = {k: case[k] for k in ("mla_value_padding", "rope_kernel") if k in case}
    q_lora = case.get("q_lora_rank", 32)
    if case.get("dsa"):  # top-k 4 of 16, the indexer trained (its KL loss at DSA_COEFF)
        built = dsa_config(4, coeff=DSA_COEFF, q_lora_rank=q_lora, **config)
    else:
        built = mla_config(q_lora, **config)
    model = gpt(built, npu_block(built, param_layout="te", **spec_keys), seed=3,
                parallel_output=False)  # fmt: skip
    if case.get("megatrons_qkv"):
        for layer in model.decoder.layers:
            layer.self_attention._runs_here = lambda _context: False
    return model


def _batch(packed):
    ids, pos, kwargs = inputs(packed, lengths=PACKED_CP)
    labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(9))
    return ids, pos, labels, kwargs


def _train(model, ids, pos, labels, kwargs, reduce=None, tokens=None, tp_reduce=None):
    """Step-0 logits and gradients, then the losses of ``STEPS`` Adam steps.

    The loss is the summed cross entropy of this rank's tokens over ``tokens`` (all tokens of
    the batch); ``reduce(tensor)`` sums a tensor over the CP ranks (None: one rank);
    ``tp_reduce`` sums the gradients of the parameters tagged ``sequence_parallel`` over the TP
    ranks (as Megatron's ``finalize_model_grads`` does under sequence parallelism)."""
    tokens = ids.numel() if tokens is None else tokens
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, first = [], None
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids, pos, None, **kwargs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / tokens
        loss.backward()
        total = loss.detach().clone()
        if reduce is not None:
            reduce(total)
            for p in model.parameters():
                reduce(p.grad)
        if tp_reduce is not None:
            for p in model.parameters():
                if getattr(p, "sequence_parallel", False):
                    tp_reduce(p.grad)
        if first is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            first = (logits.detach(), grads)
        losses.append(total.item())
        optimizer.step()
    return first, losses


def _one_process(case):
    model = _model(case)
    ids, pos, labels, kwargs = _batch(case["format"] == "thd")
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return state, _train(model, ids, pos, labels, kwargs)


def _worst(values, group):
    worst = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=group)
    return worst.tolist()


def _cp_case(case, reference):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from mcore_npu.transformer.context_parallel import thd_get_partitioned_indices

    state, ((want_logits, want_grads), want_losses) = reference
    group = parallel_state.get_context_parallel_group()
    size, rank = group.size(), group.rank()
    model = _model(case, context_parallel_size=size, cp_comm_type=case["comm"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])
    ids, pos, labels, kwargs = _batch(case["format"] == "thd")
    if case["format"] == "thd":
        cu = kwargs["packed_seq_params"].cu_seqlens_q_padded
        index = thd_get_partitioned_indices(cu, ids.shape[1], size, rank)
        local = [t[:, index] for t in (ids, pos, labels)]
        want_logits = want_logits[:, index]
    else:
        chunks = get_batch_on_this_cp_rank({"ids": ids, "pos": pos, "labels": labels,
                                            "logits": want_logits})  # fmt: skip
        local = [chunks[k] for k in ("ids", "pos", "labels")]
        want_logits = chunks["logits"]

    def reduce(t):
        torch.distributed.all_reduce(t, group=group)

    (logits, grads), losses = _train(model, *local, kwargs, reduce, tokens=ids.numel())
    errors = [(logits - want_logits).abs().max().item(),
              max((grads[n] - want_grads[n]).abs().max().item() for n in want_grads),
              max(abs(a - b) for a, b in zip(losses, want_losses))]  # fmt: skip
    return {**case, "cp": size, **dict(zip(("logits", "grads", "losses"), _worst(errors, group))),
            "loss_drop": want_losses[0] - want_losses[-1]}  # fmt: skip


def _tp_case(case, reference):
    from megatron.core import parallel_state

    state, ((want_logits, want_grads), want_losses) = reference
    group = parallel_state.get_tensor_model_parallel_group()
    size, rank = group.size(), group.rank()
    sp = bool(case.get("sequence_parallel"))
    model = _model(case, tensor_model_parallel_size=size, sequence_parallel=sp)
    shards = load_shards(model, state, size, rank)

    def tp_reduce(t):
        torch.distributed.all_reduce(t, group=group)

    (logits, grads), losses = _train(model, *_batch(case["format"] == "thd"),
                                     tp_reduce=tp_reduce if sp else None)  # fmt: skip

    def mine(name, full):
        return _shard(full, shards.get(name), name, size, rank)

    errors = [(logits - want_logits).abs().max().item(),
              max((grads[n] - mine(n, want_grads[n])).abs().max().item() for n in want_grads),
              max(abs(a - b) for a, b in zip(losses, want_losses))]  # fmt: skip
    return {**case, "tp": size, "sharded": len(shards),
            **dict(zip(("logits", "grads", "losses"), _worst(errors, group)))}  # fmt: skip


def load_shards(model, state: dict, size: int, rank: int) -> dict:
    """Copy this TP rank's part of each one-process tensor in ``state`` into ``model``; returns
    name -> partition dim of the TP-sharded parameters."""
    shards = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                shards[name] = p.partition_dim
            p.copy_(_shard(state[name], shards.get(name), name, size, rank))
    return shards


def _shard(full, dim, name, size, rank):
    """This TP rank's part of a one-process tensor: dim None = replicated; a gated MLP's
    ``linear_fc1`` holds its share of the gate rows and of the up rows (Megatron's SwiGLU
    layout), every other sharded tensor one contiguous chunk along ``dim``."""
    if dim is None:
        return full
    if name.endswith("mlp.linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
        return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)])
    return full.chunk(size, dim=dim)[rank]


DOWN_PROJECTIONS = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")


def _duplicated(sharded, full, tp_rank: int):
    """``sharded`` (this rank's TP shard of a down projection) as TE's duplicated ``TELinear``
    writes it: the whole weight ``full`` on every rank, the layer axes kept, replica id
    ``(0, tp_rank, 0)`` (megatron-core 0.16.1 ``make_sharded_tensors_for_checkpoint``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    layer_axes = [(axis, sharded.global_offset[axis], sharded.axis_fragmentations[axis])
                  for axis in range(sharded.prepend_axis_num)]  # fmt: skip
    return ShardedTensor.from_rank_offsets(sharded.key, full, *layer_axes,
                                           replica_id=(0, tp_rank, 0),
                                           prepend_axis_num=sharded.prepend_axis_num)  # fmt: skip


def te_checkpoint_case() -> dict:
    """At TP=2: a checkpoint written in TE's duplicated layout loads into the NPU spec (every
    tensor equal to the writer's), and the NPU spec's sharded checkpoint loads into TE's
    layout (the whole down projections equal the writer's shards put together)."""
    import shutil
    import tempfile
    from pathlib import Path

    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from mcore_npu.training import checkpointing

    group = parallel_state.get_tensor_model_parallel_group()
    size, rank = group.size(), group.rank()
    folder = [
        tempfile.mkdtemp(prefix="mla_te_ckpt_") if torch.distributed.get_rank() == 0 else None
    ]
    torch.distributed.broadcast_object_list(folder, src=0)
    root = Path(folder[0])
    config = mla_config(32, tensor_model_parallel_size=size)

    def model(seed):
        return gpt(config, npu_block(config, param_layout="te"), seed=seed)

    def whole(shard):
        parts = [torch.empty_like(shard) for _ in range(size)]
        torch.distributed.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    def te_layout(state):
        downs = [k for k, v in state.items()
                 if isinstance(v, ShardedTensor) and k.endswith(DOWN_PROJECTIONS)]  # fmt: skip
        for key in downs:
            state[key] = _duplicated(state[key], whole(state[key].data), rank)
        return state, downs

    try:
        writer = model(3)
        te_state, downs = te_layout(writer.sharded_state_dict())
        path = checkpointing.save(te_state, root / "te", 1)
        reader = model(4)
        loaded = checkpointing.load(reader.sharded_state_dict(), path)
        reader.load_state_dict(loaded)
        written = dict(writer.named_parameters())
        te_to_npu = max((p - written[n]).abs().max().item() for n, p in reader.named_parameters())
        path = checkpointing.save(writer.sharded_state_dict(), root / "npu", 1)
        template, _ = te_layout(model(5).sharded_state_dict())
        loaded = checkpointing.load(template, path)
        npu_to_te = max((loaded[k] - whole(writer.state_dict()[k])).abs().max().item()
                        for k in downs)  # fmt: skip
    finally:
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return {"checkpoint": "te_duplicated_down_projections", "tp": size, "downs": len(downs),
            **dict(zip(("te_to_npu", "npu_to_te"), _worst([te_to_npu, npu_to_te], group)))}  # fmt: skip


def cases() -> list[dict]:
    """Every case on both ranks (collectives); call with any parallel state of 2 ranks. Leaves
    Megatron's parallel state as it found it (the caller's layout)."""
    from megatron.core import parallel_state

    from mcore_npu.training import runtime

    before = runtime.ParallelLayout(
        tensor=parallel_state.get_tensor_model_parallel_world_size(),
        context=parallel_state.get_context_parallel_world_size(),
    )
    _relayout(runtime.ParallelLayout())  # no model parallelism: the one-process answers
    keys = {json.dumps({k: v for k, v in c.items() if k != "comm"}, sort_keys=True): c
            for c in CP_CASES + TP_CASES}  # fmt: skip
    references = {key: _one_process(case) for key, case in keys.items()}

    def reference(case):
        return references[json.dumps({k: v for k, v in case.items() if k != "comm"},
                                     sort_keys=True)]  # fmt: skip

    _relayout(runtime.ParallelLayout(context=2))
    results = [_cp_case(case, reference(case)) for case in CP_CASES]
    _relayout(runtime.ParallelLayout(tensor=2))
    results += [_tp_case(case, reference(case)) for case in TP_CASES]
    results.append(te_checkpoint_case())
    _relayout(before)
    return results


if __name__ == "__main__":
    from mcore_npu.training import runtime

    rt = runtime.initialize(runtime.ParallelLayout(context=2), seed=0)
    found = cases()
    if rt.launch.rank == 0:
        for result in found:
            print("MLA " + json.dumps(result), flush=True)
    runtime.shutdown()
