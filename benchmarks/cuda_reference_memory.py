"""On a CUDA GPU: does the reference kernel stay lean there too (no repeated K/V, no scores)?

For causal GQA attention (b=1, 32 query heads, 8 kv heads, d=128, bf16) at S in {2048, 8192}
it measures, with ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, the
extra bytes of one forward call beyond q/k/v for:

- ``fusion_attention(kernel="reference")`` in mode 2 (causal, SDPA ``is_causal``) and mode 3 with
  Sq < Skv (an explicit bool keep mask), layout SBH, as ``NPUFusionAttention`` calls it;
- a bare SDPA call with ``enable_gqa=True`` and ``is_causal=True`` (what the reference should cost);
- the output of each checked against a float32 SDPA on repeated K/V (max abs error).

A [B, N, S, S] float score tensor at S=8192 would be 32*8192*8192*2 bytes = 4 GiB; repeating K/V
would add 2 * (32 - 8) * 8192 * 128 * 2 bytes = 96 MiB. Prints JSON; exit 2 without CUDA.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _extra_bytes(torch, fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


HEADS, GROUPS, DIM = 32, 8, 128


def _measure(torch, seq: int) -> dict:
    import torch.nn.functional as F

    from mcore_npu.masks import compressed_causal_mask
    from mcore_npu.ops import fusion_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seq, 1, HEADS * DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(seq, 1, GROUPS * DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    mask, scale = compressed_causal_mask("cuda"), DIM**-0.5

    def plugin(query, mode):  # as NPUFusionAttention calls it: SBH, compressed mask
        return fusion_attention(query, k, v, HEADS, "SBH", kernel="reference", scale=scale,
                                atten_mask=mask, sparse_mode=mode)  # fmt: skip

    def bnsd(t, n):  # [S, 1, n*D] -> [1, n, S, D]
        return t.view(t.shape[0], 1, n, DIM).permute(1, 2, 0, 3)

    def sdpa():
        return F.scaled_dot_product_attention(bnsd(q, HEADS), bnsd(k, GROUPS), bnsd(v, GROUPS),
                                              is_causal=True, scale=scale, enable_gqa=True)  # fmt: skip

    want = F.scaled_dot_product_attention(
        bnsd(q, HEADS).float(), bnsd(k, GROUPS).float().repeat_interleave(HEADS // GROUPS, 1),
        bnsd(v, GROUPS).float().repeat_interleave(HEADS // GROUPS, 1), is_causal=True, scale=scale,
    ).permute(2, 0, 1, 3).reshape(seq, 1, -1)  # fmt: skip
    short = q[: seq // 2]  # Sq < Skv: mode 3 needs an explicit keep mask
    return {
        "S": seq,
        "reference_mode2_extra_bytes": _extra_bytes(torch, lambda: plugin(q, 2)),
        "reference_mode3_short_q_extra_bytes": _extra_bytes(torch, lambda: plugin(short, 3)),
        "sdpa_gqa_causal_extra_bytes": _extra_bytes(torch, sdpa),
        "output_bytes": q.numel() * q.element_size(),
        "reference_vs_fp32_max_abs_error": float((plugin(q, 2).float() - want).abs().max()),
    }


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 2
    rows = [_measure(torch, seq) for seq in (2048, 8192)]
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "rows": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
