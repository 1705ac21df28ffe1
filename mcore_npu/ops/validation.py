"""One validation step for every documented rule of ``npu_fusion_attention``.

``validate_call`` runs before either kernel (the NPU operator or the reference) sees the
arguments. It raises ``TypeError`` for wrong types and ``ValueError`` for wrong values; each
message starts with the argument's name, shows the shapes and dtypes received, and ends with what
to do instead. Mask polarity throughout: ``atten_mask`` True/1 = masked out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from mcore_npu._warnings import warn_once
from mcore_npu.ops import contract as C
from mcore_npu.ops._checks import describe, is_int, is_real
from mcore_npu.ops.contract import AttentionProblem


class _Reporter:
    """Builds error messages that show every input tensor, aligned, under the complaint."""

    def __init__(self, query, key, value, layout) -> None:
        self._lines = [
            f"  {name + ':':<7}{describe(t)}"
            for name, t in (("query", query), ("key", key), ("value", value))
        ]
        self._layout = layout

    def fail(self, exc: type[Exception], argument: str, problem: str, fix: str):
        layout = f" (input_layout={self._layout!r})" if self._layout else ""
        first = f"npu_fusion_attention: {argument}: {problem}{layout}"
        raise exc("\n".join([first, *self._lines, f"  fix: {fix}"]))


def validate_call(
    query,
    key,
    value,
    head_num,
    input_layout,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=C.INT32_MAX,
    next_tockens=C.INT32_MAX,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    *,
    kernel: str = "torch_npu",
) -> AttentionProblem:
    """Check one call against the contract; returns its geometry (B, Nq, Nkv, Sq, Skv, D, Dv;
    TND: segments). Only ``kernel="reference"`` takes float64, and it raises NotImplementedError for
    ``pse`` with TND or in ALiBi-compressed form."""
    layout = input_layout.upper() if isinstance(input_layout, str) else None
    report = _Reporter(query, key, value, layout)
    _check_tensors(report, query, key, value, kernel)
    _check_layout(report, input_layout)
    _check_head_num(report, head_num)
    problem = _geometry(report, query, key, value, head_num, layout)
    _check_scalars(report, scale, keep_prob, inner_precise, gen_mask_parallel, sync)
    _check_sparse_mode(report, sparse_mode, layout)
    if padding_mask is not None:
        fix = "pass padding_mask=None; express padding through atten_mask or packed TND lengths"
        report.fail(ValueError, "padding_mask", "is not supported by the operator", fix)
    if layout == "TND":
        problem = _with_segments(report, problem, actual_seq_qlen, actual_seq_kvlen)
    elif actual_seq_qlen is not None or actual_seq_kvlen is not None:
        fix = "drop actual_seq_qlen/actual_seq_kvlen, or pack the batch and use layout TND"
        report.fail(ValueError, "actual_seq_qlen", "is only read with input_layout='TND'", fix)
    _check_band(report, problem, sparse_mode, pre_tockens, next_tockens, atten_mask)
    _check_mask(report, problem, sparse_mode, atten_mask, query.device)
    _check_prefix(report, problem, sparse_mode, prefix)
    _check_pse(report, problem, sparse_mode, pse, query, kernel)
    return problem


def _check_tensors(report, query, key, value, kernel) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            problem = f"expected a torch.Tensor, got {type(t).__name__}"
            report.fail(TypeError, name, problem, "pass q, k and v as tensors")
    allowed = C.SUPPORTED_DTYPES + (("float64",) if kernel == "reference" else ())
    dtype = str(query.dtype).removeprefix("torch.")
    if dtype not in allowed:
        only = " (float64 is accepted by the reference kernel only)" if dtype == "float64" else ""
        fix = f"cast q, k and v to one of {', '.join(C.SUPPORTED_DTYPES)}"
        report.fail(TypeError, "query", f"dtype {dtype} is not supported{only}", fix)
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            problem = f"dtype {t.dtype} differs from query's {query.dtype}"
            report.fail(TypeError, name, problem, "give query, key and value the same dtype")
        if t.device != query.device:
            problem = f"is on {t.device} but query is on {query.device}"
            report.fail(ValueError, name, problem, "move query, key and value to one device")


def _check_layout(report, input_layout) -> None:
    fix = f"pass one of {', '.join(C.LAYOUTS)}"
    if not isinstance(input_layout, str):
        problem = f"expected a str, got {type(input_layout).__name__}"
        report.fail(TypeError, "input_layout", problem, fix)
    if input_layout.upper() not in C.LAYOUTS:
        report.fail(ValueError, "input_layout", f"unknown layout {input_layout!r}", fix)


def _check_head_num(report, head_num) -> None:
    if not is_int(head_num):
        problem = f"expected an int, got {type(head_num).__name__}"
        fix = "pass the number of query heads on this rank as an int"
        report.fail(TypeError, "head_num", problem, fix)
    if not 0 < head_num <= C.MAX_HEADS:
        problem = f"{head_num} is outside 1..{C.MAX_HEADS}"
        fix = "pass the number of query heads on this rank (Nq)"
        report.fail(ValueError, "head_num", problem, fix)


def _geometry(report, query, key, value, head_num, layout) -> AttentionProblem:
    rank = 4 if layout in ("BSND", "BNSD") else 3
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != rank:
            problem = f"layout {layout} needs {rank}-D tensors, got {t.dim()}-D"
            fix = f"reshape to the {layout} layout or pick the layout that matches"
            report.fail(ValueError, name, problem, fix)
    if layout in ("BSH", "SBH"):
        b_axis, s_axis = (0, 1) if layout == "BSH" else (1, 0)
        hidden_q = query.shape[-1]
        if hidden_q % head_num:
            problem = f"query hidden size {hidden_q} is not divisible by head_num={head_num}"
            report.fail(ValueError, "head_num", problem, "pass head_num = H_q / head_dim")
        head_dim = hidden_q // head_num
        if key.shape[-1] % head_dim:
            problem = f"key hidden size {key.shape[-1]} is not a multiple of head_dim={head_dim}"
            report.fail(ValueError, "key", problem, "give key Nkv * head_dim features")
        heads_kv = key.shape[-1] // head_dim
        # Dv < D (MLA): the value's hidden size is Nkv * Dv, Nkv taken from the key
        if heads_kv and value.shape[-1] % heads_kv:
            problem = f"hidden size {value.shape[-1]} is not a multiple of the {heads_kv} kv heads "
            problem += f"(key hidden size {key.shape[-1]} / head_dim {head_dim})"
            fix = "give value Nkv * Dv features (Dv <= head_dim)"
            report.fail(ValueError, "value", problem, fix)
        head_dim_v = value.shape[-1] // heads_kv if heads_kv else head_dim
        dims = (query.shape[b_axis], query.shape[s_axis], key.shape[s_axis], head_dim, head_dim_v)
        batches = (query.shape[b_axis], key.shape[b_axis], value.shape[b_axis])
        kv_seqs = (key.shape[s_axis], value.shape[s_axis])
    else:
        n_axis, s_axis, b_axis = {"BSND": (2, 1, 0), "BNSD": (1, 2, 0), "TND": (1, 0, None)}[layout]
        if query.shape[n_axis] != head_num:
            problem = f"{head_num} differs from the query's head axis ({query.shape[n_axis]})"
            report.fail(ValueError, "head_num", problem, "pass head_num = query heads (Nq)")
        heads_kv = key.shape[n_axis]
        if value.shape[n_axis] != heads_kv:
            problem = f"has {value.shape[n_axis]} heads, key has {heads_kv}"
            fix = "give key and value the same number of heads"
            report.fail(ValueError, "value", problem, fix)
        if key.shape[-1] != query.shape[-1]:
            problem = f"head dim {key.shape[-1]} differs from query's {query.shape[-1]}"
            report.fail(ValueError, "key", problem, "give query and key the same head dim")
        batch = 1 if b_axis is None else query.shape[b_axis]
        dims = (batch, query.shape[s_axis], key.shape[s_axis], query.shape[-1], value.shape[-1])
        batches = (batch,) * 3
        if b_axis is not None:
            batches = tuple(t.shape[b_axis] for t in (query, key, value))
        kv_seqs = (key.shape[s_axis], value.shape[s_axis])
    batch, seq_q, seq_kv, head_dim, head_dim_v = dims
    if len(set(batches)) != 1:
        problem = f"batch sizes differ (query/key/value: {batches})"
        report.fail(ValueError, "key", problem, "give query, key and value the same batch size")
    if len(set(kv_seqs)) != 1:
        problem = f"sequence length {kv_seqs[1]} differs from key's {kv_seqs[0]}"
        fix = "give key and value the same sequence length"
        report.fail(ValueError, "value", problem, fix)
    if heads_kv == 0 or head_num % heads_kv:
        problem = f"query heads ({head_num}) are not a multiple of kv heads ({heads_kv})"
        fix = "use Nkv that divides Nq (GQA/MQA), or repeat kv heads"
        report.fail(ValueError, "key", problem, fix)
    if head_dim_v > head_dim:
        problem = f"head dim {head_dim_v} exceeds query/key head dim {head_dim}"
        report.fail(ValueError, "value", problem, "keep Dv <= D")
    if head_dim > C.MAX_HEAD_DIM or head_dim == 0:
        problem = f"head dim {head_dim} is outside 1..{C.MAX_HEAD_DIM}"
        fix = "split heads differently; 64 and 128 are safe on every release"
        report.fail(ValueError, "query", problem, fix)
    if max(seq_q, seq_kv) > C.MAX_SEQ:
        problem = f"sequence length {max(seq_q, seq_kv)} exceeds {C.MAX_SEQ}"
        fix = "split the sequence (context parallelism or chunking)"
        report.fail(ValueError, "query", problem, fix)
    return AttentionProblem(layout, batch, head_num, heads_kv, seq_q, seq_kv, head_dim, head_dim_v)


def _check_scalars(report, scale, keep_prob, inner_precise, gen_mask_parallel, sync) -> None:
    if not is_real(scale):
        problem = f"expected a float, got {type(scale).__name__}"
        fix = "pass scale=1/sqrt(head_dim) (the operator's default is 1.0, not 1/sqrt(D))"
        report.fail(TypeError, "scale", problem, fix)
    if not math.isfinite(scale):
        report.fail(ValueError, "scale", f"{scale} is not finite", "pass a finite softmax scale")
    if not is_real(keep_prob):
        problem = f"expected a float, got {type(keep_prob).__name__}"
        report.fail(TypeError, "keep_prob", problem, "pass keep_prob = 1 - dropout probability")
    if not 0.0 < keep_prob <= 1.0:
        fix = "pass keep_prob = 1 - dropout probability; 1.0 disables dropout"
        report.fail(ValueError, "keep_prob", f"{keep_prob} is outside (0, 1]", fix)
    if not is_int(inner_precise) or inner_precise not in (0, 1, 2):
        problem = f"{inner_precise!r} is not 0, 1 or 2"
        fix = "pass 0 (default) or 2 (invalid-row handling)"
        report.fail(ValueError, "inner_precise", problem, fix)
    for name, flag in (("gen_mask_parallel", gen_mask_parallel), ("sync", sync)):
        if not isinstance(flag, bool):
            problem = f"expected a bool, got {type(flag).__name__}"
            report.fail(TypeError, name, problem, f"pass {name}=True or False")


def _check_sparse_mode(report, sparse_mode, layout) -> None:
    if not is_int(sparse_mode):
        problem = f"expected an int, got {type(sparse_mode).__name__}"
        report.fail(TypeError, "sparse_mode", problem, "pass an int from 0 to 8")
    allowed = C.SPARSE_MODES_TND if layout == "TND" else C.SPARSE_MODES_DENSE_LAYOUTS
    if sparse_mode not in allowed:
        problem = f"{sparse_mode} is not accepted with layout {layout} (allowed: {sorted(allowed)})"
        fix = "modes 7/8 need TND; mode 5 needs a non-TND layout (use 6 with TND)"
        report.fail(ValueError, "sparse_mode", problem, fix)


def _with_segments(report, problem, actual_seq_qlen, actual_seq_kvlen) -> AttentionProblem:
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        fix = "pass the cumulative end offsets of every segment, "
        fix += "e.g. lengths 2,2,2 -> [2, 4, 6] (mcore_npu.masks.actual_seq_lengths)"
        missing = "TND needs both actual_seq_qlen and actual_seq_kvlen"
        report.fail(ValueError, "actual_seq_qlen", missing, fix)
    ends_q = _cumulative_ends(report, "actual_seq_qlen", actual_seq_qlen, problem.seq_q)
    ends_kv = _cumulative_ends(report, "actual_seq_kvlen", actual_seq_kvlen, problem.seq_kv)
    if len(ends_q) != len(ends_kv):
        differ = f"has {len(ends_kv)} segments, actual_seq_qlen has {len(ends_q)}"
        fix = "describe the same segments on both sides"
        report.fail(ValueError, "actual_seq_kvlen", differ, fix)
    if len(ends_q) > C.MAX_TND_SEGMENTS:
        many = f"{len(ends_q)} segments exceed {C.MAX_TND_SEGMENTS}"
        report.fail(
            ValueError, "actual_seq_qlen", many, "split the packed batch into several calls"
        )
    segments = dict(segments_q=(0, *ends_q), segments_kv=(0, *ends_kv))
    return dataclasses.replace(problem, batch=len(ends_q), **segments)


def _cumulative_ends(report, name, ends, total) -> tuple[int, ...]:
    if isinstance(ends, torch.Tensor):
        problem = f"got a tensor {list(ends.shape)}; the operator takes a host list of ints"
        fix = "convert once per step, not per layer: "
        fix += "mcore_npu.masks.actual_seq_lengths(cu_seqlens) (drops the leading 0)"
        report.fail(TypeError, name, problem, fix)
    if not isinstance(ends, Sequence) or not all(is_int(x) for x in ends) or not ends:
        problem = f"expected a non-empty list of ints, got {ends!r}"
        report.fail(TypeError, name, problem, "pass cumulative end offsets, e.g. [2, 4, 6]")
    ends = list(ends)
    while len(ends) > 1 and ends[-1] == 0:  # trailing unused entries may be 0
        ends.pop()
    if ends[0] == 0 and len(ends) > 1:
        problem = f"starts with 0 ({ends[:4]}...): this is almost always a "
        problem += "Megatron/FlashAttention cu_seqlens passed unsliced"
        fix = "pass cu_seqlens[1:] (cumulative ends without the leading 0); "
        fix += "if the first segment really is empty, drop it"
        report.fail(ValueError, name, problem, fix)
    if any(b < a for a, b in zip(ends, ends[1:])) or ends[0] < 0:
        fix = "pass cumulative END offsets (a running sum of the segment lengths)"
        report.fail(ValueError, name, f"{ends} is not non-decreasing", fix)
    if ends[-1] != total:
        problem = f"ends at {ends[-1]} but the tensor holds {total} tokens"
        fix = "the last cumulative offset must equal the token count T"
        report.fail(ValueError, name, problem, fix)
    return tuple(ends)


def _check_band(report, problem, sparse_mode, pre, nxt, atten_mask) -> None:
    for name, v in (("pre_tockens", pre), ("next_tockens", nxt)):
        if not is_int(v):
            got = f"expected an int, got {type(v).__name__}"
            report.fail(TypeError, name, got, f"pass an int (default {C.INT32_MAX} = unbounded)")
        if not -C.INT32_MAX - 1 <= v <= C.INT32_MAX:
            report.fail(ValueError, name, f"{v} does not fit in int32", "pass an int32 value")
    if sparse_mode in (7, 8):
        _check_split_q_band(report, problem, sparse_mode, pre, nxt)
    if sparse_mode not in C.MODES_WITH_BAND:
        return
    if nxt < 0 and (pre < -nxt or -nxt >= problem.seq_kv):
        needs = f"a negative next_tockens={nxt} needs pre_tockens >= {-nxt} and "
        needs += f"|next_tockens| < Skv={problem.seq_kv} (got pre_tockens={pre})"
        fix = "widen pre_tockens or shrink |next_tockens|"
        report.fail(ValueError, "next_tockens", needs, fix)
    if pre < 0 and (nxt < -pre or -pre >= problem.seq_q):
        needs = f"a negative pre_tockens={pre} needs next_tockens >= {-pre} and "
        needs += f"|pre_tockens| < Sq={problem.seq_q} (got next_tockens={nxt})"
        fix = "widen next_tockens or shrink |pre_tockens|"
        report.fail(ValueError, "pre_tockens", needs, fix)
    if atten_mask is None and sparse_mode == 0 and (pre, nxt) != (C.INT32_MAX, C.INT32_MAX):
        warn_once(
            "mode0-band-without-mask",
            "npu_fusion_attention: pre_tockens/next_tockens are ignored when atten_mask is None "
            "(the operator computes full attention); pass a mask to get a band.",
        )


def split_q_band_segment(problem: AttentionProblem, sparse_mode: int) -> int | None:
    """Modes 7/8: the segment that takes the band instead of the causal rule (mode 7: the last
    with Sq_s > 0; mode 8: the first with Skv_s > 0), or None."""
    lengths = problem.segment_lengths()
    if sparse_mode == 7:
        candidates = [s for s, (sq, _) in enumerate(lengths) if sq > 0][-1:]
    else:
        candidates = [s for s, (_, skv) in enumerate(lengths) if skv > 0][:1]
    return candidates[0] if candidates else None


def _check_split_q_band(report, problem, sparse_mode, pre, nxt) -> None:
    s = split_q_band_segment(problem, sparse_mode)
    if s is None:
        return
    sq, skv = problem.segment_lengths()[s]
    low_next, high_next = (sq - skv, 0) if sparse_mode == 7 else (sq - skv, C.INT32_MAX)
    if pre < skv or not low_next <= nxt <= high_next:
        needs = f"sparse_mode={sparse_mode} needs, for segment {s} (Sq={sq}, Skv={skv}), "
        needs += f"pre_tockens >= {skv} and {low_next} <= next_tockens <= {high_next}; "
        needs += f"got pre={pre}, next={nxt}"
        fix = "pick pre/next inside those bounds, or use sparse_mode 3 per segment"
        report.fail(ValueError, "next_tockens", needs, fix)


def _check_mask(report, problem, sparse_mode, mask, device) -> None:
    if mask is None:
        if sparse_mode in C.MODES_WITH_COMPRESSED_MASK or sparse_mode in (5, 6):
            none = f"is None with sparse_mode={sparse_mode}: "
            none += "the operator would silently compute full, non-causal attention"
            fix = "pass mcore_npu.masks.compressed_causal_mask(device) "
            fix += "(the fixed [2048, 2048] bool mask)"
            report.fail(ValueError, "atten_mask", none, fix)
        return
    if not isinstance(mask, torch.Tensor):
        got = f"expected a tensor, got {type(mask).__name__}"
        report.fail(TypeError, "atten_mask", got, "pass a bool tensor, True = masked out")
    if mask.dtype not in (torch.bool, torch.uint8):
        fix = "pass a bool mask with True = masked out (not an additive float mask)"
        report.fail(TypeError, "atten_mask", f"dtype {mask.dtype} is not bool/uint8", fix)
    if mask.device != device:
        where = f"is on {mask.device}, query on {device}"
        report.fail(ValueError, "atten_mask", where, "move the mask to the query's device")
    shape = tuple(mask.shape)
    if sparse_mode in C.MODES_WITH_COMPRESSED_MASK:
        if shape != C.COMPRESSED_MASK_SHAPE:
            wrong = f"sparse_mode={sparse_mode} takes the compressed [2048, 2048] mask, "
            wrong += f"got {list(shape)}"
            fix = "pass mcore_npu.masks.compressed_causal_mask(device), "
            fix += "or use sparse_mode=0/1 for a dense mask"
            report.fail(ValueError, "atten_mask", wrong, fix)
        return
    if sparse_mode == 6:
        if shape != C.PREFIX_COMPRESSED_MASK_SHAPE:
            wrong = f"sparse_mode=6 takes a [3072, 2048] mask, got {list(shape)}"
            report.fail(ValueError, "atten_mask", wrong, "pass the compressed prefix mask")
        return
    _check_dense_mask_shape(report, problem, sparse_mode, shape)


def _check_dense_mask_shape(report, problem, sparse_mode, shape) -> None:
    b, n, sq, skv = problem.batch, problem.heads_q, problem.seq_q, problem.seq_kv
    if problem.layout == "TND":
        longest_q = max(q for q, _ in problem.segment_lengths())
        longest_kv = max(kv for _, kv in problem.segment_lengths())
        if len(shape) != 2 or shape[0] < longest_q or shape[1] < longest_kv:
            wrong = "TND takes a 2-D [maxSq, maxSkv] mask covering the longest segment "
            wrong += f"({longest_q} x {longest_kv}), got {list(shape)}"
            fix = "pass a 2-D mask, or the compressed mask with sparse_mode 2/3/4"
            report.fail(ValueError, "atten_mask", wrong, fix)
        return
    if len(shape) == 4 and shape[2] == 1 and sq > 1:
        wrong = f"shape {list(shape)} is a [B,1,1,S] padding mask, which the operator rejects "
        wrong += "('get unsupported atten_mask shape')"
        fix = "expand it with mcore_npu.masks.build_npu_attention_mask(keep_mask), "
        fix += "or pack the batch with mcore_npu.masks.padding_to_packed(keep_mask) and use TND"
        report.fail(ValueError, "atten_mask", wrong, fix)
    accepted = [(b, n, sq, skv), (b, 1, sq, skv)]
    if sparse_mode != 5:
        accepted += [(1, 1, sq, skv), (sq, skv)]
    if shape not in accepted:
        wrong = f"shape {list(shape)} is not accepted with sparse_mode={sparse_mode}; accepted: "
        wrong += f"{', '.join(map(str, map(list, accepted)))}"
        fix = "build the mask for this batch's Sq and Skv (True = masked out)"
        report.fail(ValueError, "atten_mask", wrong, fix)


def _check_prefix(report, problem, sparse_mode, prefix) -> None:
    per_entry = "pass one prefix length per batch entry"
    if sparse_mode not in (5, 6):
        if prefix is not None:
            unused = f"is only read with sparse_mode 5/6 (got sparse_mode={sparse_mode})"
            report.fail(ValueError, "prefix", unused, "drop prefix or use sparse_mode 5/6")
        return
    if not isinstance(prefix, Sequence) or not all(is_int(x) for x in prefix):
        got = f"sparse_mode={sparse_mode} needs a list of ints, got {prefix!r}"
        report.fail(TypeError, "prefix", got, per_entry)
    if len(prefix) != problem.batch or problem.batch > C.MAX_PREFIX_BATCH:
        count = f"has {len(prefix)} entries for batch {problem.batch} "
        count += f"(at most {C.MAX_PREFIX_BATCH})"
        report.fail(ValueError, "prefix", count, per_entry)
    if problem.layout == "TND":
        lengths = problem.segment_lengths()
    else:
        lengths = [(problem.seq_q, problem.seq_kv)] * problem.batch
    for b, (p, (sq, skv)) in enumerate(zip(prefix, lengths)):
        low = max(0, skv - sq)
        if not low <= p <= skv:
            outside = f"prefix[{b}]={p} is outside [{low}, {skv}] (Sq={sq}, Skv={skv})"
            fix = "prefix lengths must lie in [max(0, Skv - Sq), Skv]"
            report.fail(ValueError, "prefix", outside, fix)


def _check_pse(report, problem, sparse_mode, pse, query, kernel) -> None:
    if pse is None:
        return
    if not isinstance(pse, torch.Tensor):
        got = f"expected a tensor, got {type(pse).__name__}"
        report.fail(TypeError, "pse", got, "pass an additive bias tensor or None")
    if sparse_mode in (7, 8):
        rejected = f"is rejected with sparse_mode={sparse_mode}"
        report.fail(ValueError, "pse", rejected, "use sparse_mode 0-4 with a position bias")
    if pse.dtype != query.dtype or pse.device != query.device:
        got = f"is {pse.dtype} on {pse.device}, query is {query.dtype} on {query.device}"
        report.fail(TypeError, "pse", got, "give pse the query's dtype and device")
    if problem.layout == "TND":
        if kernel == "reference":
            missing = "with layout TND is not implemented by the reference kernel"
            fix = "use a non-TND layout for position biases"
            report.fail(NotImplementedError, "pse", missing, fix)
        return
    b, n, sq, skv = problem.batch, problem.heads_q, problem.seq_q, problem.seq_kv
    rows = C.ALIBI_COMPRESSED_ROWS
    accepted = [(b, n, sq, skv), (b, n, 1, skv), (1, n, sq, skv)]
    accepted += [(b, n, rows, skv), (1, n, rows, skv)]
    if tuple(pse.shape) not in accepted:
        wrong = f"shape {list(pse.shape)} is not accepted; accepted: "
        wrong += f"{', '.join(map(str, map(list, accepted)))}"
        fix = "pass a [B|1, N, Sq|1, Skv] bias (N = query heads on this rank)"
        report.fail(ValueError, "pse", wrong, fix)
    if kernel == "reference" and pse.shape[2] not in (1, sq):
        missing = f"the ALiBi-compressed form ({list(pse.shape)}: 1024 rows for Sq={sq}) "
        missing += "is not implemented by the reference kernel"
        report.fail(NotImplementedError, "pse", missing, "pass the full [B|1, N, Sq, Skv] bias")
