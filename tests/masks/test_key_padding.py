"""verl's ``[B, S]`` key-padding mask in Megatron's mask slot (``mcore_npu.masks.key_padding``).

Polarity: the ``keep`` masks here are verl's, **True = real token**; every other mask (the
dense ones built for comparison, ``ExplicitMask``) is True = masked out.

Checked: a right-padded keep mask on a causal layer is read as the causal description (the cached
compressed mask; no S x S tensor is made, measured with the allocation tracker) and gives the
dense causal + padding mask's outputs on every real token, through ``NPUFusionAttention`` and in
a GPTModel with the recording torch_npu stand-in; the shape rule, the row rule when B == S, the
refusals (left padding, non-causal layers, Sq != Skv) and one host sync per mask tensor.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from mcore_npu.masks import (
    ExplicitMask,
    FullAttention,
    SeqLengthsMemo,
    SlidingWindow,
    TopLeftCausalMask,
    build_npu_attention_mask,
    compressed_causal_mask,
    describe_mask,
)
from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.transformer.attention import NPUFusionAttention
from tests.transformer.megatron_models import batch, gpt, npu_spec, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

CAUSAL = [AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right]


def _keep(lengths, seq: int) -> torch.Tensor:
    """``[B, S]`` bool, True = real token, right-padded (verl's ``preprocess_bshd_engine``)."""
    return torch.arange(seq).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def _describe(kind, mask, *, batch, seq, memo=None, **kwargs):
    return describe_mask(kind, mask, seq_q=seq, seq_kv=seq, batch=batch, memo=memo, **kwargs)


@pytest.mark.parametrize("kind", CAUSAL)
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_a_right_padded_keep_mask_on_a_causal_layer_is_the_causal_description(kind, dtype):
    keep = _keep([5, 3, 1], seq=6).to(dtype)
    assert _describe(kind, keep, batch=3, seq=6) == _describe(kind, None, batch=3, seq=6)


def test_with_a_causal_window_it_is_the_window():
    keep = _keep([5, 3, 1], seq=6)
    desc = _describe(AttnMaskType.causal, keep, batch=3, seq=6, window_size=(2, 0))
    assert desc == SlidingWindow(2, 0)


def test_no_mask_layers_ignore_it_as_they_ignore_every_mask():
    keep = _keep([5, 3, 1], seq=6)
    assert _describe(AttnMaskType.no_mask, keep, batch=3, seq=6) == FullAttention()


def test_the_shape_tells_it_from_a_dense_mask():
    dense = torch.ones(6, 6, dtype=torch.bool).triu(1)  # [S, S], True = masked out
    desc = _describe(AttnMaskType.causal, dense, batch=3, seq=6)
    assert isinstance(desc, ExplicitMask) and desc.mask is dense


def test_when_batch_equals_seq_the_rows_tell_them_apart():
    """B == S: a keep mask's rows are real-token prefixes starting at key 0; a dense causal mask
    (True = masked out) has row 0 = [F, T, T, ...], and a keep-shaped dense one would leave
    query 0 without any key."""
    keep = _keep([4, 2, 3, 1], seq=4)
    assert _describe(AttnMaskType.causal, keep, batch=4, seq=4) == TopLeftCausalMask()
    dense = torch.ones(4, 4, dtype=torch.bool).triu(1)
    desc = _describe(AttnMaskType.causal, dense, batch=4, seq=4)
    assert isinstance(desc, ExplicitMask) and desc.mask is dense


@pytest.mark.parametrize(
    ("kind", "keep", "seq_kv", "match"),
    [
        (AttnMaskType.causal, [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], 6, "left or interior"),
        (AttnMaskType.causal, [[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1]], 6, "left or interior"),
        (AttnMaskType.padding, [[1, 1, 1, 0, 0, 0], [1] * 6], 6, "would attend the padded"),
        (AttnMaskType.arbitrary, [[1, 1, 1, 0, 0, 0], [1] * 6], 6, "would attend the padded"),
    ],
)
def test_what_the_causal_description_would_not_honour_is_refused(kind, keep, seq_kv, match):
    mask = torch.tensor(keep, dtype=torch.bool)
    with pytest.raises(ValueError, match=f"attention_mask: .*{match}.*") as info:
        _describe(kind, mask, batch=2, seq=seq_kv)
    assert "\n" not in str(info.value) and "True = real token" in str(info.value)


def test_a_key_padding_mask_with_fewer_queries_than_keys_is_refused():
    keep = _keep([5, 3], seq=6)
    with pytest.raises(ValueError, match="Sq == Skv"):
        describe_mask(AttnMaskType.causal, keep, seq_q=2, seq_kv=6, batch=2)


def test_each_mask_tensor_is_read_once_per_memo():
    memo, keep = SeqLengthsMemo(), _keep([6, 4, 4, 2, 6, 1], seq=6)  # B == S: the rows are read
    for _ in range(5):
        assert (
            _describe(AttnMaskType.causal, keep, batch=6, seq=6, memo=memo) == TopLeftCausalMask()
        )
    assert memo.keep_reads == 1
    _describe(AttnMaskType.causal, keep.clone(), batch=6, seq=6, memo=memo)
    assert memo.keep_reads == 2


def test_the_description_allocates_nothing_of_size_s_squared():
    seq = 4096
    keep = _keep([seq, seq - 700], seq=seq)
    compressed_causal_mask(torch.device("cpu"))  # the one cached mask, built once per device
    with track_allocations() as usage:
        args = _describe(AttnMaskType.causal, keep, batch=2, seq=seq).operator_args()
    assert args.atten_mask is compressed_causal_mask(torch.device("cpu"))
    assert usage.peak_bytes < seq * 2, usage  # a few flags; one [S, S] bool mask is 16 MiB
    with track_allocations() as dense:
        build_npu_attention_mask(keep)  # the control: what a dense mask costs
    assert dense.peak_bytes >= 2 * seq * seq


def _core():
    return NPUFusionAttention(tiny_config(), layer_number=1, attn_mask_type=AttnMaskType.causal)


def test_attention_with_it_equals_the_dense_mask_on_every_real_token():
    lengths, seq = [8, 5, 2], 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 3, 4, 16, generator=gen, dtype=torch.float64)  # [s, b, n, d]
    k = torch.randn(seq, 3, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(seq, 3, 2, 16, generator=gen, dtype=torch.float64)
    keep = _keep(lengths, seq)
    core = _core()
    got = core(q, k, v, keep)  # [s, b, 64]
    want = core(q, k, v, build_npu_attention_mask(keep))  # [B, 1, S, S], True = masked out
    real = keep.t()  # [s, b]
    assert torch.isfinite(got).all()  # padded query rows see real keys: finite, not NaN
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-12)


def test_a_gpt_model_given_verls_mask_sends_the_compressed_mask(fake_torch_npu):
    config = tiny_config(num_layers=2)
    model = gpt(config, npu_spec(config, kernel="torch_npu"))
    ids, pos = batch(b=3, s=16)
    model(ids, pos, _keep([16, 9, 4], seq=16))
    assert len(fake_torch_npu.calls) == 2
    cached = compressed_causal_mask(torch.device("cpu"))
    for _, kwargs in fake_torch_npu.calls:
        assert kwargs["atten_mask"] is cached and kwargs["sparse_mode"] == 2
