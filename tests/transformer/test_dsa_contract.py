"""The DSA layer's contract with torch_npu: a tiny model of the fused kernels' shapes (32 heads,
kv_lora_rank 512, a rope part of 64, 64 indexer heads of 128) runs forward and backward on the
NPU spec with its DSA operators' kernels set to ``torch_npu``, and a stand-in ``torch_npu``
records the documented calls of ``npu_lightning_indexer``, ``npu_sparse_flash_attention`` (+ its
grad) and ``npu_sparse_lightning_indexer_grad_kl_loss``: names, layouts (BSND for sbhd, TND with
the packed ends for thd), ``sparse_mode=3``, ``attention_mode=2`` and the absorbed shapes.

The stand-in is a stand-in only for hardware we do not have: it answers every call with the
plugin's own references (``mcore_npu.ops.dsa``), so the model computes real numbers while the
calls are checked; it says nothing about the real kernels' numbers."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from mcore_npu.ops import dsa
from tests.megatron_features import DSA_CONFIG_FIELDS, needs_fields
from tests.transformer.mla_models import PACKED, VOCAB, gpt, inputs, mla_config, npu_block

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.usefixtures("megatron_runtime"),
    needs_fields(*DSA_CONFIG_FIELDS, feature="DeepSeek Sparse Attention"),
]

HEADS, LORA, ROPE = 32, 512, 64  # the fused attention's shapes (and the KL loss's heads)
INDEX_HEADS, INDEX_DIM = 64, 128  # the fused indexer's (TND: exactly 64 heads)
SHAPES = dict(num_attention_heads=HEADS, kv_lora_rank=LORA, qk_pos_emb_head_dim=ROPE,
              dsa_indexer_n_heads=INDEX_HEADS, dsa_indexer_head_dim=INDEX_DIM, num_layers=1,
              params_dtype=torch.bfloat16, bf16=True)  # fmt: skip
DSA_KERNELS = ("lightning_indexer_kernel", "sparse_attention_kernel", "indexer_loss_kernel")
INDEXER, ATTENTION = "npu_lightning_indexer", "npu_sparse_flash_attention"
GRAD, KL_LOSS = "npu_sparse_flash_attention_grad", "npu_sparse_lightning_indexer_grad_kl_loss"
MAX = 2**63 - 1


class TorchNpuStandIn(types.ModuleType):
    """``torch_npu`` with the three DSA operators at their documented signatures: each call is
    recorded as ``(name, positional args, keywords)`` and answered by the plugin's reference."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[str, tuple, dict]] = []
        self.npu = types.SimpleNamespace(get_soc_version=lambda: 225)

    def one(self, name: str) -> tuple[tuple, dict]:
        """``(positional args, keywords)`` of the one call of ``name``."""
        found = [(args, kwargs) for n, args, kwargs in self.calls if n == name]
        assert len(found) == 1, [n for n, _, _ in self.calls]
        return found[0]

    def npu_lightning_indexer(self, query, key, weights, *, actual_seq_lengths_query=None,
                              actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                              layout_key="BSND", sparse_count=2048, sparse_mode=3,
                              pre_tokens=MAX, next_tokens=MAX, return_value=False):  # fmt: skip
        kwargs = dict(actual_seq_lengths_query=actual_seq_lengths_query,
                      actual_seq_lengths_key=actual_seq_lengths_key, layout_query=layout_query,
                      layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode,
                      return_value=return_value)  # fmt: skip
        self.calls.append((INDEXER, (query, key, weights), kwargs))
        return dsa.indexer_reference(query, key, weights, **_host(kwargs))

    def npu_sparse_flash_attention(self, query, key, value, sparse_indices, scale_value, *,
                                   block_table=None, actual_seq_lengths_query=None,
                                   actual_seq_lengths_kv=None, query_rope=None, key_rope=None,
                                   sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                   sparse_mode=3, pre_tokens=MAX, next_tokens=MAX,
                                   attention_mode=0, return_softmax_lse=False):  # fmt: skip
        kwargs = dict(actual_seq_lengths_query=actual_seq_lengths_query,
                      actual_seq_lengths_kv=actual_seq_lengths_kv, query_rope=query_rope,
                      key_rope=key_rope, sparse_block_size=sparse_block_size,
                      layout_query=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode,
                      attention_mode=attention_mode, return_softmax_lse=return_softmax_lse)  # fmt: skip
        self.calls.append((ATTENTION, (query, key, value, sparse_indices, scale_value), kwargs))
        with torch.no_grad():
            return dsa.sparse_attention_reference(query, key, value, sparse_indices, scale_value,
                                                  **_host(kwargs))  # fmt: skip

    def npu_sparse_flash_attention_grad(self, query, key, value, sparse_indices, d_out, out,
                                        softmax_max, softmax_sum, scale_value, sparse_block_size,
                                        *, query_rope=None, key_rope=None, actual_seq_qlen=None,
                                        actual_seq_kvlen=None, layout="BSND", sparse_mode=3,
                                        pre_tokens=MAX, next_tokens=MAX, attention_mode=0):  # fmt: skip
        kwargs = dict(query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=actual_seq_qlen,
                      actual_seq_kvlen=actual_seq_kvlen, layout=layout, sparse_mode=sparse_mode,
                      attention_mode=attention_mode)  # fmt: skip
        self.calls.append((GRAD, (query, key, value, sparse_indices, d_out, out, softmax_max,
                                  softmax_sum, scale_value, sparse_block_size), kwargs))  # fmt: skip
        leaves = [t.detach().requires_grad_() for t in (query, key, value, query_rope, key_rope)]
        lengths = _host(dict(actual_seq_lengths_query=actual_seq_qlen,
                             actual_seq_lengths_kv=actual_seq_kvlen))  # fmt: skip
        with torch.enable_grad():
            o = dsa.sparse_attention_reference(
                *leaves[:3], sparse_indices, scale_value, query_rope=leaves[3],
                key_rope=leaves[4], sparse_block_size=sparse_block_size, layout_query=layout,
                layout_kv=layout, sparse_mode=sparse_mode, **lengths)[0]  # fmt: skip
            return torch.autograd.grad(o, leaves, d_out)

    def npu_sparse_lightning_indexer_grad_kl_loss(self, query, key, query_index, key_index,
                                                  weights, sparse_indices, softmax_max,
                                                  softmax_sum, scale_value, *, query_rope=None,
                                                  key_rope=None, actual_seq_qlen=None,
                                                  actual_seq_klen=None, layout="BSND",
                                                  sparse_mode=3, pre_tokens=MAX,
                                                  next_tokens=MAX):  # fmt: skip
        kwargs = dict(query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=actual_seq_qlen,
                      actual_seq_klen=actual_seq_klen, layout=layout, sparse_mode=sparse_mode)  # fmt: skip
        self.calls.append((KL_LOSS, (query, key, query_index, key_index, weights, sparse_indices,
                                     softmax_max, softmax_sum, scale_value), kwargs))  # fmt: skip
        return dsa.indexer_kl_loss_reference(
            query, key, query_index, key_index, weights, sparse_indices, softmax_max,
            softmax_sum, scale_value, **_host(kwargs))  # fmt: skip


def _host(kwargs: dict) -> dict:
    """The kernel's length tensors as the reference's host lists."""
    return {k: v.tolist() if k.startswith("actual") and v is not None else v
            for k, v in kwargs.items()}  # fmt: skip


@pytest.fixture
def torch_npu(monkeypatch) -> TorchNpuStandIn:
    module = TorchNpuStandIn()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


def _train_step(packed: bool, topk: int, coeff: float = 0.0, **spec):
    """One forward and backward of a 1-layer DSA GPT (bf16) on the NPU spec, its DSA operators'
    kernels ``torch_npu`` (the rest the reference); returns the model."""
    from mcore_npu.transformer.dsa import DSATransformerConfig

    config = mla_config(config_class=DSATransformerConfig, experimental_attention_variant="dsa",
                        dsa_indexer_topk=topk, dsa_indexer_loss_coeff=coeff,
                        dsa_indexer_use_sparse_loss=True, **SHAPES)  # fmt: skip
    kernels = {name: "torch_npu" for name in DSA_KERNELS}
    model = gpt(config, npu_block(config, **{**kernels, **spec}))
    ids, pos, kwargs = inputs(packed)
    logits = model(ids, pos, None, **kwargs)
    labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(7))
    F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    return model


def _batch(packed: bool) -> tuple[str, tuple]:
    """The operators' layout and the leading dims of a query: sbhd ``[2, 16]`` as BSND
    ``[B, S]``; thd (one pack of :data:`PACKED`) as TND ``[T]``."""
    return ("TND", (sum(PACKED),)) if packed else ("BSND", (2, 16))


def _ends(packed: bool):
    """The ``actual_seq_*`` the kernels get (tensors; here as lists): the packed sequences' ends,
    no leading 0, in TND; None in BSND."""
    if not packed:
        return None
    return torch.tensor(PACKED).cumsum(0).tolist()


def _lengths(value):
    """A kernel's ``actual_seq_*`` tensor as a list (None stays None)."""
    return None if value is None else value.tolist()


@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_sparse_attention_calls_are_torch_npus(torch_npu, packed):
    """Loss coefficient 0, top-k 4 (under the sequences): one ``npu_sparse_flash_attention``
    forward and one ``npu_sparse_flash_attention_grad`` backward, with the documented keywords,
    layouts and absorbed shapes; no KL loss (the indexer runs without grad). The indexer runs on
    its reference here (its call: the next test)."""
    model = _train_step(packed, topk=4, lightning_indexer_kernel="reference")
    layout, lead = _batch(packed)
    assert [name for name, _, _ in torch_npu.calls] == [ATTENTION, GRAD]

    (q, k, v, indices, scale), kwargs = torch_npu.one(ATTENTION)
    assert q.shape == (*lead, HEADS, LORA) and k.shape == (*lead, 1, LORA) and v is k
    assert kwargs["query_rope"].shape == (*lead, HEADS, ROPE)
    assert kwargs["key_rope"].shape == (*lead, 1, ROPE)
    assert indices.dtype == torch.int32 and indices.shape == (*lead, 1, 4)
    assert q.dtype == k.dtype == torch.bfloat16
    assert scale == model.decoder.layers[0].self_attention.core_attention.softmax_scale
    assert (kwargs["layout_query"], kwargs["layout_kv"]) == (layout, layout)
    assert (kwargs["sparse_mode"], kwargs["attention_mode"]) == (3, 2)
    assert kwargs["sparse_block_size"] == 1 and kwargs["return_softmax_lse"] is True
    assert _lengths(kwargs["actual_seq_lengths_query"]) == _ends(packed)
    assert _lengths(kwargs["actual_seq_lengths_kv"]) == _ends(packed)

    (gq, gk, gv, g_idx, d_out, out, smax, ssum, g_scale, block), kwargs = torch_npu.one(GRAD)
    assert gq is q and gk is k and gv is k and g_idx is indices and g_scale == scale
    assert d_out.shape == out.shape == q.shape and block == 1
    assert smax.dtype == ssum.dtype == torch.float32 and smax.numel() > 0
    assert kwargs["query_rope"].shape == (*lead, HEADS, ROPE)
    assert (kwargs["layout"], kwargs["sparse_mode"], kwargs["attention_mode"]) == (layout, 3, 2)
    assert _lengths(kwargs["actual_seq_qlen"]) == _ends(packed)
    assert _lengths(kwargs["actual_seq_kvlen"]) == _ends(packed)

    grads = {n: p.grad for n, p in model.named_parameters()}
    indexer = [n for n in grads if ".indexer." in n]
    assert indexer and all(grads[n] is None for n in indexer)  # coefficient 0: no grad
    assert grads["decoder.layers.0.self_attention.linear_kv_up_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_lightning_indexer_call_is_torch_npus(torch_npu, packed):
    """One ``npu_lightning_indexer`` per layer: the indexer's query ``[.., 64, 128]``, its one
    key head and per-head weights, bfloat16 as the kernel takes them, no grad (coefficient 0),
    ``sparse_count`` the top-k, ``sparse_mode=3``, BSND / TND with the packed ends."""
    _train_step(packed, topk=4)
    layout, lead = _batch(packed)
    assert [name for name, _, _ in torch_npu.calls] == [INDEXER, ATTENTION, GRAD]
    (query, key, weights), kwargs = torch_npu.one(INDEXER)
    assert query.shape == (*lead, INDEX_HEADS, INDEX_DIM) and key.shape == (*lead, 1, INDEX_DIM)
    assert weights.shape == (*lead, INDEX_HEADS)
    assert query.dtype == key.dtype == torch.bfloat16 and not query.requires_grad
    assert {k: v for k, v in kwargs.items() if not k.startswith("actual")} == dict(
        layout_query=layout, layout_key=layout, sparse_count=4, sparse_mode=3,
        return_value=False)  # fmt: skip
    assert _lengths(kwargs["actual_seq_lengths_query"]) == _ends(packed)
    assert _lengths(kwargs["actual_seq_lengths_key"]) == _ends(packed)


@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_indexer_kl_loss_call_is_torch_npus(torch_npu, packed):
    """Loss coefficient 0.1 at TP 1 with the sparse loss: one
    ``npu_sparse_lightning_indexer_grad_kl_loss`` over the attention's own inputs, its chosen
    keys (top-k 1024, the kernel's smallest) and its softmax statistics; its gradients reach
    the indexer's parameters. The indexer's top-k runs on its reference."""
    model = _train_step(packed, topk=1024, coeff=0.1, lightning_indexer_kernel="reference")
    layout, lead = _batch(packed)
    assert [name for name, _, _ in torch_npu.calls] == [ATTENTION, KL_LOSS, GRAD]
    (q, k, _, indices, scale), _ = torch_npu.one(ATTENTION)
    grad_args, _ = torch_npu.one(GRAD)
    smax, ssum = grad_args[6:8]  # the forward's softmax statistics

    args, kwargs = torch_npu.one(KL_LOSS)
    query, key, query_index, key_index, weights, chosen, k_max, k_sum, k_scale = args
    assert torch.equal(query, q) and torch.equal(key, k) and not query.requires_grad
    assert query_index.shape == (*lead, INDEX_HEADS, INDEX_DIM)
    assert key_index.shape == (*lead, 1, INDEX_DIM) and weights.shape == (*lead, INDEX_HEADS)
    assert chosen is indices and chosen.shape == (*lead, 1, 1024) and k_scale == scale
    assert k_max is smax and k_sum is ssum
    assert kwargs["query_rope"].shape == (*lead, HEADS, ROPE)
    assert kwargs["key_rope"].shape == (*lead, 1, ROPE)
    assert (kwargs["layout"], kwargs["sparse_mode"]) == (layout, 3)
    assert _lengths(kwargs["actual_seq_qlen"]) == _ends(packed)
    assert _lengths(kwargs["actual_seq_klen"]) == _ends(packed)

    grads = {n: p.grad for n, p in model.named_parameters() if ".indexer." in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for n, g in grads.items()
                         if "k_norm" not in n)  # fmt: skip


def test_the_recipe_switches_off_run_no_torch_npu_call(torch_npu):
    """The fused switches false (``reference``, as ``use_fused_*: false`` sets them): the same
    step calls nothing of torch_npu."""
    _train_step(False, topk=4, coeff=0.1, **{name: "reference" for name in DSA_KERNELS})
    assert torch_npu.calls == []
