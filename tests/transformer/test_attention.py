"""NPUFusionAttention inside a real GPTModel, with torch_npu replaced by a recording stand-in.

We have no NPU: the stand-in module (tests/conftest.py) records every npu_fusion_attention call
and returns zeros, so these tests check what the NPU kernel would receive, not its numbers.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.transformer.attention import NPUFusionAttention
from tests.transformer.megatron_models import batch, gpt, npu_spec, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


def _snapshot(config) -> dict:
    """Each config field's object and its repr (catches rebinding and in-place edits)."""
    return {f.name: (id(getattr(config, f.name)), repr(getattr(config, f.name)))
            for f in dataclasses.fields(config)}  # fmt: skip


def test_forward_sends_sbh_query_heads_scale_and_one_compressed_mask(fake_torch_npu):
    config = tiny_config(num_layers=3)
    before = _snapshot(config)
    model = gpt(config, npu_spec(config, kernel="torch_npu"))
    ids, pos = batch(b=2, s=16)
    model(ids, pos, None)
    assert len(fake_torch_npu.calls) == 3  # one call per layer, nothing else
    masks = set()
    for (q, k, v, head_num, layout), kwargs in fake_torch_npu.calls:
        assert layout == "SBH" and head_num == 4  # query heads (per tensor-parallel rank)
        assert q.shape == (16, 2, 4 * 16) and k.shape == v.shape == (
            16,
            2,
            2 * 16,
        )  # GQA: no repeat
        assert kwargs["scale"] == pytest.approx(16**-0.5)
        assert kwargs["sparse_mode"] == 2 and kwargs["keep_prob"] == 1.0
        masks.add(id(kwargs["atten_mask"]))
    assert masks == {id(compressed_causal_mask(torch.device("cpu")))}
    assert _snapshot(config) == before  # nothing wrote to config


def test_packed_forward_sends_tnd_lengths_without_leading_zero_and_syncs_once(fake_torch_npu):
    from megatron.core.packed_seq_params import PackedSeqParams

    config = tiny_config(num_layers=4)
    spec = npu_spec(config, kernel="torch_npu")
    memo = spec.submodules.self_attention.submodules.core_attention.params["seq_lengths_memo"]
    model = gpt(config, spec)
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=9, max_seqlen_kv=9)  # fmt: skip
    ids, pos = batch(b=1, s=16)
    with _count_tolist() as syncs:
        model(ids, pos, None, packed_seq_params=params)
    # one device-to-host sync for 4 layers (Megatron's own thd RoPE makes others; not ours)
    assert syncs.count == 1 and memo.conversions == 1
    assert len(fake_torch_npu.calls) == 4
    for (q, _k, _v, head_num, layout), kwargs in fake_torch_npu.calls:
        assert layout == "TND" and head_num == 4 and q.shape == (16, 4, 16)
        assert kwargs["actual_seq_qlen"] == [5, 14, 16] == kwargs["actual_seq_kvlen"]
        assert kwargs["sparse_mode"] == 3


def test_padded_cu_seqlens_set_the_segment_boundaries(fake_torch_npu):
    from megatron.core.packed_seq_params import PackedSeqParams

    config = tiny_config(num_layers=1)
    model = gpt(config, npu_spec(config, kernel="torch_npu"))
    real = torch.tensor([0, 4, 13, 15], dtype=torch.int32)
    padded = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                             cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                             max_seqlen_q=9, max_seqlen_kv=9)  # fmt: skip
    ids, pos = batch(b=1, s=16)
    model(ids, pos, None, packed_seq_params=params)
    # slots of 5, 9, 2 tokens hold 4, 9, 2 real ones: the one padding token is its own segment
    assert fake_torch_npu.calls[0][1]["actual_seq_qlen"] == [4, 5, 14, 16]


class _count_tolist:
    """Counts Tensor.tolist calls made by mcore_npu code (device-to-host conversions)."""

    def __enter__(self):
        self.count = 0
        self._original = torch.Tensor.tolist
        counter = self

        def counting(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            # the CPU runtime's TorchFunctionMode re-dispatches every call: not a caller of its own
            shims = f"{os.sep}mcore_npu{os.sep}cpu{os.sep}shims.py"
            if f"{os.sep}mcore_npu{os.sep}" in caller and not caller.endswith(shims):
                counter.count += 1
            return counter._original(tensor, *args, **kwargs)

        torch.Tensor.tolist = counting
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._original


def test_training_mode_passes_keep_prob(fake_torch_npu):
    config = tiny_config(num_layers=1, attention_dropout=0.25)
    model = gpt(config, npu_spec(config, kernel="torch_npu"))
    ids, pos = batch()
    model.train()
    model(ids, pos, None)
    model.eval()
    model(ids, pos, None)
    assert [kw["keep_prob"] for _, kw in fake_torch_npu.calls] == [0.75, 1.0]


def _core(config, **kwargs):
    return NPUFusionAttention(config, layer_number=1, attn_mask_type=_causal(), **kwargs)


def _causal():
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal


def _qkv(s=8, b=2):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, 4, 16, generator=gen)
    k = torch.randn(s, b, 2, 16, generator=gen)
    return q, k, k.clone()


def test_context_parallel_comm_types_outside_the_plugin_are_refused():
    """CP itself runs (tests/distributed/test_context_parallel.py); these values never do."""
    config = tiny_config()
    object.__setattr__(config, "context_parallel_size", 2)
    object.__setattr__(config, "cp_comm_type", "a2a+p2p")
    with pytest.raises(NotImplementedError, match="a2a\\+p2p.*fix"):
        _core(config)
    object.__setattr__(config, "cp_comm_type", ["p2p", "ring"])
    with pytest.raises(ValueError, match="layer 2: cp_comm_type='ring': unknown value"):
        NPUFusionAttention(config, 2, _causal())


def test_attention_bias_of_wrong_shape_is_refused():
    core = _core(tiny_config())
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"attention_bias: shape \[2, 4, 8\]"):
        core(q, k, v, None, attention_bias=torch.zeros(2, 4, 8))


def test_attention_bias_is_added_after_scaling_as_in_megatron():
    core = _core(tiny_config())
    q, k, v = _qkv()  # [8, 2, 4, 16], GQA 4 query heads over 2 kv heads
    bias = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    got = core(q, k, v, None, attention_bias=bias)  # [8, 2, 64]
    # softmax(scale * Q K^T + bias) V, causal, by hand (Transformer Engine's post-scale bias)
    qh = q.permute(1, 2, 0, 3)  # [b, n, s, d]
    kh, vh = (t.permute(1, 2, 0, 3).repeat_interleave(2, dim=1) for t in (k, v))
    scores = qh @ kh.transpose(-1, -2) * 16**-0.5 + bias
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    want = (scores.softmax(-1) @ vh).permute(2, 0, 1, 3).reshape(8, 2, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_style_mask_is_expanded_once_and_shared_by_every_layer(fake_torch_npu):
    # Megatron's own attention tests pass a [B, 1, 1, S] bool mask (True = masked out)
    config = tiny_config(num_layers=3)
    model = gpt(config, npu_spec(config, kernel="torch_npu"))
    ids, pos = batch(b=2, s=16)
    mask = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    mask[0, ..., 12:] = True
    model(ids, pos, mask)
    sent = [kwargs["atten_mask"] for _, kwargs in fake_torch_npu.calls]
    assert len(sent) == 3 and all(m is sent[0] for m in sent)  # one tensor for all layers
    assert sent[0].shape == (2, 1, 16, 16) and sent[0].is_contiguous()
    assert torch.equal(sent[0], mask.expand(2, 1, 16, 16))
    assert {kwargs["sparse_mode"] for _, kwargs in fake_torch_npu.calls} == {0}


def test_torch_npu_kernel_without_torch_npu_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    core = _core(tiny_config(), kernel="torch_npu")
    q, k, v = _qkv()
    with pytest.raises(ImportError, match="torch_npu.*\n.*set_env.sh"):
        core(q, k, v, None)


def test_unknown_kernel_and_softmax_type_are_refused():
    with pytest.raises(ValueError, match="kernel: unknown kernel 'fast'"):
        _core(tiny_config(), kernel="fast")
    config = tiny_config()
    object.__setattr__(config, "softmax_type", "learnable")
    with pytest.raises(NotImplementedError, match="softmax_type='learnable'"):
        _core(config)


def test_spec_builders_refuse_unknown_keywords_and_backends():
    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec, get_gpt_layer_spec

    with pytest.raises(TypeError, match="qk_layer_norm: not a keyword.*qk_layernorm"):
        get_gpt_layer_npu_spec(qk_layer_norm=True)
    with pytest.raises(ValueError, match="backend: unknown backend 'npu'"):
        get_gpt_layer_spec("npu")
    with pytest.raises(ImportError, match="backend 'te' needs transformer-engine"):
        get_gpt_layer_spec("te")
    with pytest.raises(TypeError, match="kernel: only the npu_fusion backend"):
        get_gpt_layer_spec("local", kernel="reference")


def test_auto_backend_picks_local_on_this_cpu_machine():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_npu.transformer.layer_specs import get_gpt_layer_spec, resolve_backend

    assert resolve_backend("auto") == "local"
    spec = get_gpt_layer_spec("auto", qk_layernorm=True)
    want = get_gpt_layer_local_spec(qk_layernorm=True)
    assert spec.submodules.self_attention.submodules.core_attention is (
        want.submodules.self_attention.submodules.core_attention
    )
    npu = get_gpt_layer_spec("npu_fusion", qk_layernorm=True)
    assert issubclass(npu.submodules.self_attention.submodules.core_attention.module,
                      NPUFusionAttention)  # fmt: skip
