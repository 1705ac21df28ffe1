"""Bad inputs: each is refused with the right exception type and a message naming the argument."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops import fusion_attention
from mcore_npu.ops.reference import npu_fusion_attention

B, S, N, D = 2, 8, 4, 16


def bsh(s=S, n=N, d=D, dtype=torch.float32):
    return torch.randn(B, s, n * d, dtype=dtype)


def tnd(t=10, n=N, d=D):
    return torch.randn(t, n, d)


CAUSAL = compressed_causal_mask()
OK = dict(query=bsh(), key=bsh(), value=bsh(), head_num=N, input_layout="BSH")
OK_TND = dict(query=tnd(), key=tnd(), value=tnd(), head_num=N, input_layout="TND",
              actual_seq_qlen=[4, 10], actual_seq_kvlen=[4, 10])  # fmt: skip


def call(base, **changes):
    return {**base, **changes}


BAD = [
    # (id, kwargs, exception, argument named in the message)
    ("query-not-tensor", call(OK, query=[[1.0]]), TypeError, "query"),
    (
        "query-int-dtype",
        call(OK, query=bsh().long(), key=bsh().long(), value=bsh().long()),
        TypeError,
        "query",
    ),
    ("key-dtype-mismatch", call(OK, key=bsh(dtype=torch.float16)), TypeError, "key"),
    ("layout-unknown", call(OK, input_layout="BHS"), ValueError, "input_layout"),
    ("layout-not-str", call(OK, input_layout=3), TypeError, "input_layout"),
    ("head-num-float", call(OK, head_num=4.0), TypeError, "head_num"),
    ("head-num-zero", call(OK, head_num=0), ValueError, "head_num"),
    ("head-num-too-many", call(OK, head_num=512), ValueError, "head_num"),
    ("head-num-not-dividing", call(OK, head_num=3), ValueError, "head_num"),
    ("rank-mismatch", call(OK, query=torch.randn(B, S, N, D)), ValueError, "query"),
    (
        "bsnd-head-num-wrong",
        dict(
            query=torch.randn(B, S, N, D),
            key=torch.randn(B, S, N, D),
            value=torch.randn(B, S, N, D),
            head_num=2,
            input_layout="BSND",
        ),
        ValueError,
        "head_num",
    ),
    ("nq-not-multiple-of-nkv", call(OK, key=bsh(n=3), value=bsh(n=3)), ValueError, "key"),
    (
        "batch-mismatch",
        call(OK, key=torch.randn(B + 1, S, N * D), value=torch.randn(B + 1, S, N * D)),
        ValueError,
        "key",
    ),
    ("kv-length-mismatch", call(OK, value=bsh(s=S + 1)), ValueError, "value"),
    (
        "dv-larger-than-d",
        dict(
            query=torch.randn(B, N, S, D),
            key=torch.randn(B, N, S, D),
            value=torch.randn(B, N, S, D + 8),
            head_num=N,
            input_layout="BNSD",
        ),
        ValueError,
        "value",
    ),
    ("mask-float", call(OK, atten_mask=torch.zeros(S, S)), TypeError, "atten_mask"),
    (
        "mask-padding-b11s",
        call(OK, atten_mask=torch.zeros(B, 1, 1, S, dtype=torch.bool)),
        ValueError,
        "atten_mask",
    ),
    (
        "mask-wrong-shape",
        call(OK, atten_mask=torch.zeros(S, S + 1, dtype=torch.bool)),
        ValueError,
        "atten_mask",
    ),
    (
        "mode2-dense-mask",
        call(OK, atten_mask=torch.ones(S, S, dtype=torch.bool).triu(1), sparse_mode=2),
        ValueError,
        "atten_mask",
    ),
    ("mode3-no-mask", call(OK, sparse_mode=3), ValueError, "atten_mask"),
    (
        "mode4-no-mask",
        call(OK, sparse_mode=4, pre_tockens=2, next_tockens=0),
        ValueError,
        "atten_mask",
    ),
    (
        "mode6-wrong-mask",
        call(OK, sparse_mode=6, atten_mask=CAUSAL, prefix=[4, 4]),
        ValueError,
        "atten_mask",
    ),
    ("mode7-not-tnd", call(OK, sparse_mode=7, atten_mask=CAUSAL), ValueError, "sparse_mode"),
    (
        "mode5-tnd",
        call(OK_TND, sparse_mode=5, atten_mask=torch.zeros(1, 1, 6, 6, dtype=torch.bool)),
        ValueError,
        "sparse_mode",
    ),
    ("mode9", call(OK, sparse_mode=9), ValueError, "sparse_mode"),
    ("keep-prob-zero", call(OK, keep_prob=0.0), ValueError, "keep_prob"),
    ("keep-prob-above-one", call(OK, keep_prob=1.5), ValueError, "keep_prob"),
    ("keep-prob-str", call(OK, keep_prob="0.9"), TypeError, "keep_prob"),
    ("scale-nan", call(OK, scale=float("nan")), ValueError, "scale"),
    ("scale-inf", call(OK, scale=float("inf")), ValueError, "scale"),
    ("scale-tensor", call(OK, scale=torch.tensor(0.1)), TypeError, "scale"),
    ("padding-mask", call(OK, padding_mask=torch.zeros(B, S)), ValueError, "padding_mask"),
    (
        "tnd-no-lengths",
        call(OK_TND, actual_seq_qlen=None, actual_seq_kvlen=None),
        ValueError,
        "actual_seq_qlen",
    ),
    (
        "tnd-leading-zero",
        call(OK_TND, actual_seq_qlen=[0, 4, 10], actual_seq_kvlen=[0, 4, 10]),
        ValueError,
        "actual_seq_qlen",
    ),
    (
        "tnd-decreasing",
        call(OK_TND, actual_seq_qlen=[6, 4, 10], actual_seq_kvlen=[4, 10]),
        ValueError,
        "actual_seq_qlen",
    ),
    (
        "tnd-wrong-total",
        call(OK_TND, actual_seq_qlen=[4, 9], actual_seq_kvlen=[4, 9]),
        ValueError,
        "actual_seq_qlen",
    ),
    (
        "tnd-device-tensor",
        call(OK_TND, actual_seq_qlen=torch.tensor([4, 10])),
        TypeError,
        "actual_seq_qlen",
    ),
    ("tnd-kv-segment-count", call(OK_TND, actual_seq_kvlen=[10]), ValueError, "actual_seq_kvlen"),
    ("lengths-without-tnd", call(OK, actual_seq_qlen=[8, 16]), ValueError, "actual_seq_qlen"),
    (
        "tnd-3d-mask",
        call(OK_TND, atten_mask=torch.zeros(1, 6, 6, dtype=torch.bool)),
        ValueError,
        "atten_mask",
    ),
    ("pre-tockens-float", call(OK, pre_tockens=2.0), TypeError, "pre_tockens"),
    (
        "negative-next-without-pre",
        call(OK, next_tockens=-3, pre_tockens=1, atten_mask=torch.zeros(S, S, dtype=torch.bool)),
        ValueError,
        "next_tockens",
    ),
    (
        "mode7-next-out-of-range",
        call(OK_TND, sparse_mode=7, atten_mask=CAUSAL, pre_tockens=100, next_tockens=3),
        ValueError,
        "next_tockens",
    ),
    ("prefix-wrong-mode", call(OK, prefix=[2, 2]), ValueError, "prefix"),
    (
        "prefix-missing",
        call(OK, sparse_mode=6, atten_mask=torch.zeros(3072, 2048, dtype=torch.bool)),
        TypeError,
        "prefix",
    ),
    (
        "prefix-out-of-range",
        call(
            OK, sparse_mode=5, prefix=[2, 99], atten_mask=torch.zeros(B, 1, S, S, dtype=torch.bool)
        ),
        ValueError,
        "prefix",
    ),
    ("pse-wrong-shape", call(OK, pse=torch.zeros(B, N, S)), ValueError, "pse"),
    (
        "pse-with-mode8",
        call(
            OK_TND,
            sparse_mode=8,
            atten_mask=CAUSAL,
            pre_tockens=100,
            next_tockens=100,
            pse=torch.zeros(1, N, 4, 4),
        ),
        ValueError,
        "pse",
    ),
    ("inner-precise", call(OK, inner_precise=5), ValueError, "inner_precise"),
    ("sync-not-bool", call(OK, sync=1), TypeError, "sync"),
    (
        "head-dim-too-big",
        dict(
            query=torch.randn(1, 2, 1, 800),
            key=torch.randn(1, 2, 1, 800),
            value=torch.randn(1, 2, 1, 800),
            head_num=1,
            input_layout="BSND",
        ),
        ValueError,
        "query",
    ),
]


@pytest.mark.parametrize("kwargs, error, argument", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_refused_naming_the_argument(kwargs, error, argument):
    with pytest.raises(error) as info:
        npu_fusion_attention(**kwargs)
    message = str(info.value)
    assert message.startswith(f"npu_fusion_attention: {argument}:"), message
    assert "fix:" in message


def test_there_are_at_least_25_distinct_bad_inputs():
    assert len({b[0] for b in BAD}) >= 25


TENSOR_BAD = [b for b in BAD if isinstance(b[1]["query"], torch.Tensor)]


@pytest.mark.parametrize(
    "kwargs, error, argument", [b[1:] for b in TENSOR_BAD], ids=[b[0] for b in TENSOR_BAD]
)
def test_dispatch_validates_before_the_npu_kernel_runs(kwargs, error, argument, fake_torch_npu):
    args = {k: v for k, v in kwargs.items() if k not in ("query", "key", "value", "head_num",
                                                          "input_layout")}  # fmt: skip
    with pytest.raises(error):
        fusion_attention(kwargs["query"], kwargs["key"], kwargs["value"], kwargs["head_num"],
                         kwargs["input_layout"], kernel="torch_npu", **args)  # fmt: skip
    assert fake_torch_npu.calls == []


def test_padding_mask_message_names_the_helpers():
    with pytest.raises(ValueError, match="build_npu_attention_mask.*padding_to_packed"):
        npu_fusion_attention(**call(OK, atten_mask=torch.zeros(B, 1, 1, S, dtype=torch.bool)))


def test_leading_zero_message_names_cu_seqlens():
    with pytest.raises(
        ValueError, match=r"cu_seqlens passed unsliced.*\n(.*\n)*.*cu_seqlens\[1:\]"
    ):
        npu_fusion_attention(
            **call(OK_TND, actual_seq_qlen=[0, 4, 10], actual_seq_kvlen=[0, 4, 10])
        )


def test_float64_only_for_the_reference():
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    npu_fusion_attention(q, q, q, 2, "BSND")  # the reference takes it
    with pytest.raises(TypeError, match="float64 is accepted by the reference kernel only"):
        from mcore_npu.ops.validation import validate_call

        validate_call(q, q, q, 2, "BSND", kernel="torch_npu")


def test_band_without_mask_warns_that_it_is_ignored():
    with pytest.warns(UserWarning, match="ignored when atten_mask is None"):
        npu_fusion_attention(**call(OK, pre_tockens=2, next_tockens=0))


def test_what_only_the_reference_lacks_is_refused_before_it_runs():
    from mcore_npu.ops.validation import validate_call

    alibi = torch.zeros(1, N, 1024, S)  # the ALiBi-compressed pse: 1024 rows for Sq = 8
    with pytest.raises(NotImplementedError, match="pse: the ALiBi-compressed form"):
        npu_fusion_attention(**call(OK, pse=alibi))
    validate_call(**call(OK, pse=alibi), kernel="torch_npu")  # the real operator takes it
    tnd_bias = torch.zeros(1, N, 4, 4)
    with pytest.raises(NotImplementedError, match="pse: with layout TND"):
        npu_fusion_attention(**call(OK_TND, pse=tnd_bias))
