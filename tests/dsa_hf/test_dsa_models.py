"""Tiny GLM-5 and DeepSeek-V3.2 through the plugin's DSA bridge (``integrations.hf_dsa``) into
the NPU spec's DSA layers, against transformers 5.25's own models (eager attention).

The checkpoints are dsa_models.py's: 3 layers (dense, MoE, MoE), MLA with q_lora_rank, the
lightning indexer with 8 heads and ``index_topk`` 5, fewer than the keys of most queries, so the
indexer decides what each query sees; GLM-5 rotates the indexer's rope slice in interleaved pairs,
DeepSeek-V3.2 in halves (and has yarn RoPE). fp32, reference kernels, one process (the CPU
runtime). Checked: logits within 1e-5 (absolute) of transformers for 12 and 33 tokens, batch 2
and 1, with transformers' index scores leaving a margin at the k-th key (no near-tie decides the
top-k); the two sequences packed into one thd row give each one's own logits; export is
bit-exact; with the indexer loss coefficient 0 the indexer gets no gradient and the rest do;
none of transformer_engine, fast_hadamard_transform, tilelang, flash_mla is imported.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("mbridge")
pytest.importorskip("transformers.models.glm_moe_dsa")
pytest.importorskip("transformers.models.deepseek_v32")

from tests.dsa_hf.dsa_models import MODEL_TYPES, TOPK, VOCAB, save_tiny
from tests.dsa_hf.test_dsa_config import megatron_names
from tests.hf_model_checks import (
    batches,
    logit_errors,
    logit_moves,
    npu_logits,
    packed_errors,
    plugin_run,
    run_tp2,
    saved_and_exported,
    tp2_results,
)

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

TOLERANCE = 1e-5  # max |logit difference|, absolute (the logits' max |value| is printed)
PACKED_TOLERANCE = 1e-5
MARGIN = 1e-4  # transformers' k-th index score minus the (k+1)-th, at least, for every query
LENGTHS = (12, 33)
BLOCKED = ("transformer_engine", "fast_hadamard_transform", "tilelang", "flash_mla")


class _IndexScores:
    """Records transformers' index scores ``[B, S, T]`` (causal mask applied): the tensor each
    indexer's forward takes its top-k of (its one ``Tensor.topk`` call)."""

    def __init__(self, model):
        self.scores: list[torch.Tensor] = []
        self.handles = []
        for layer in model.model.layers:
            indexer = layer.self_attn.indexer
            self.handles.append(indexer.register_forward_pre_hook(self._on))
            self.handles.append(indexer.register_forward_hook(self._off))

    def _on(self, module, args):
        def topk(tensor, *a, **k):
            self.scores.append(tensor.detach().clone())
            return torch._C.TensorBase.topk(tensor, *a, **k)

        torch.Tensor.topk = topk

    def _off(self, module, args, output):
        del torch.Tensor.topk

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def margin(self, k: int) -> float:
        """The smallest k-th minus (k+1)-th score over the queries with more than k keys."""
        gaps = []
        for scores in self.scores:
            ranked = scores.sort(dim=-1, descending=True).values
            keys = torch.arange(1, scores.shape[1] + 1)  # causal: query s sees s + 1 keys
            ranked = ranked[:, keys > k]
            gaps.append((ranked[..., k - 1] - ranked[..., k]).min())
        return float(torch.stack(gaps).min())


@pytest.fixture(scope="module", params=MODEL_TYPES)
def run(request, tmp_path_factory):
    """The checkpoint, transformers' logits and index-score margin, and the plugin's bridge,
    model and logits (sbhd and packed thd), the plugin built and run with ``BLOCKED`` refused at
    import (:func:`~tests.hf_model_checks.plugin_run`)."""
    model_type = request.param
    path = tmp_path_factory.mktemp(model_type)
    hf_model = save_tiny(model_type, path)
    tokens = batches(LENGTHS, VOCAB)
    recorder = _IndexScores(hf_model)
    try:
        with torch.no_grad():
            hf = {n: hf_model(input_ids=ids).logits for n, ids in tokens.items()}
    finally:
        recorder.remove()
    return types.SimpleNamespace(
        model_type=model_type,
        path=str(path),
        hf_model=hf_model,
        batches=tokens,
        hf=hf,
        margin=recorder.margin(TOPK),
        **vars(plugin_run(path, BLOCKED, tokens)),
    )


def test_the_bridge_builds_dsa_layers_with_the_checkpoints_names(run):
    from mcore_npu.integrations.hf_dsa import DSABridge
    from mcore_npu.transformer.dsa import DSAIndexer, NPUDSASelfAttention, NPUSparseAttention

    assert isinstance(run.bridge, DSABridge)
    for layer in run.model.decoder.layers:
        attention = layer.self_attention
        assert type(attention) is NPUDSASelfAttention
        assert type(attention.core_attention) is NPUSparseAttention
        indexer = attention.core_attention.indexer
        assert type(indexer) is DSAIndexer
        assert indexer.settings.rope_interleaved is (run.model_type == "glm_moe_dsa")
        assert indexer.k_norm.eps == 1e-6
    names = {name for name in run.model.state_dict() if "_extra_state" not in name}
    assert names == set(megatron_names())


def test_transformers_index_scores_have_a_margin_at_the_kth_key(run):
    """No near-tie decides transformers' top-k (ReLU scores can tie at exactly 0): the k-th
    score exceeds the (k+1)-th by ``MARGIN`` for every query with more than k keys, far more than
    the two models' hidden states differ by, so both select the same keys."""
    print(f"tiny {run.model_type}: smallest k-th - (k+1)-th index score {run.margin:.2e}")
    assert run.margin > MARGIN, run.margin


def test_logits_match_transformers(run):
    errors, scale = logit_errors(run, LENGTHS)
    print(
        f"tiny {run.model_type}: max |logit - transformers| (tokens, batch): "
        f"{ {key: f'{e:.2e}' for key, e in errors.items()} }; max |logit| {scale:.2f}"
    )
    assert max(errors.values()) <= TOLERANCE, errors


def test_the_latent_norms_take_transformers_epsilon(run):
    """transformers 5.25 builds the q / kv latent RMSNorms with eps 1e-6 whatever
    ``rms_norm_eps`` says (``GlmMoeDsaRMSNorm(q_lora_rank)``); the bridge passes the spec
    keyword ``mla_latent_norm_epsilon=1e-6``, so the layer's latent norms take it while the
    other norms keep ``rms_norm_eps``. GLM-5 (``rms_norm_eps`` 1e-5): with the latent norms
    put back at 1e-5 the logits move at least 5 times further from transformers'."""
    hf_norms = [norm for layer in run.hf_model.model.layers
                for norm in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm)]  # fmt: skip
    ours = [norm for layer in run.model.decoder.layers
            for norm in (layer.self_attention.q_layernorm, layer.self_attention.kv_layernorm)]  # fmt: skip
    assert {norm.variance_epsilon for norm in hf_norms} == {norm.eps for norm in ours} == {1e-6}
    assert {layer.input_layernorm.eps for layer in run.model.decoder.layers} == {
        run.model.config.layernorm_epsilon}  # fmt: skip
    if run.model_type == "deepseek_v32":  # rms_norm_eps 1e-6: the two agree anyway
        assert run.model.config.layernorm_epsilon == 1e-6
        return
    ids, want = run.batches[33], run.hf[33]
    error = float((run.npu[33] - want).abs().max())
    try:
        for norm in ours:
            norm.eps = run.model.config.layernorm_epsilon
        off = float((npu_logits(run.model, ids) - want).abs().max())
    finally:
        for norm in ours:
            norm.eps = 1e-6
    print(f"tiny glm_moe_dsa, 33 tokens: max |logit diff| {error:.2e}; latent norms at "
          f"rms_norm_eps: {off:.2e}")  # fmt: skip
    assert error <= TOLERANCE and off >= 5 * error, (error, off)


def test_packed_thd_gives_each_sequences_logits(run):
    own, hf = packed_errors(run, LENGTHS)
    print(
        f"tiny {run.model_type} packed thd: max |logit - unpacked| per sequence "
        f"{[f'{e:.2e}' for e in own]}, - transformers {[f'{e:.2e}' for e in hf]}"
    )
    assert max(own) <= PACKED_TOLERANCE and max(hf) <= TOLERANCE, (own, hf)


def test_export_is_bit_exact(run):
    saved, exported = saved_and_exported(run)
    assert exported.keys() == saved.keys()
    for key, tensor in saved.items():
        got = exported[key]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
    print(f"export {run.model_type}: {len(saved)} tensors, every one torch.equal")


def test_no_cuda_only_package_is_imported(run):
    """Built, loaded and run with the packages refused at import: none is in ``sys.modules``, and
    no module of the plugin asked for one."""
    probes = sorted({f"{name} <- {Path(where).name}" for name, where in run.attempts})
    print(f"blocked optional imports (probes): {probes}")
    assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
    assert not [where for _, where in run.attempts if "/mcore_npu/" in where]


def test_the_indexer_decides_the_logits(run):
    """The comparison can fail: with the indexer's head weights negated (it picks other keys) or
    its key norm's bias zeroed, the logits move far beyond the tolerance."""
    indexer = run.model.decoder.layers[0].self_attention.core_attention.indexer
    ids, want = run.batches[33][:1], run.hf[33][:1]
    wrongs = {
        "linear_weights_proj.weight": lambda p: p.neg_(),
        "k_norm.bias": lambda p: p.zero_(),
    }
    moved = logit_moves(run.model, indexer, wrongs, ids, want)
    print(f"tiny {run.model_type}: max |logit - transformers| with the indexer wrong: {moved}")
    assert min(moved.values()) > 10 * TOLERANCE, moved
    assert float((npu_logits(run.model, ids) - want).abs().max()) <= TOLERANCE


def test_with_loss_coefficient_0_only_the_indexer_gets_no_gradient(run):
    """``dsa_indexer_loss_coeff=0`` (the bridge's): a backward through the logits leaves every
    indexer parameter without gradient (None or zero) and gives the others non-zero ones."""
    model = run.model
    model.zero_grad(set_to_none=True)
    ids = run.batches[12][:1]
    try:
        model(ids, torch.arange(12)[None], None).float().pow(2).mean().backward()
        indexer, rest = {}, {}
        for name, param in model.named_parameters():
            grad = param.grad
            norm = 0.0 if grad is None else float(grad.abs().sum())
            (indexer if ".indexer." in name else rest)[name] = norm
    finally:
        model.zero_grad(set_to_none=True)
    assert indexer and all(v == 0.0 for v in indexer.values()), indexer
    zero = [name for name, v in rest.items() if v == 0.0]
    # the experts no token of this sequence was routed to may stay at zero
    assert all(".mlp.experts." in name for name in zero), zero


@pytest.mark.distributed
def test_tensor_parallel_2_loads_and_exports_bit_exact(run):
    """Two processes (torchrun, gloo) at TP = 2 with sequence parallelism (``tp_export.py``): the
    weights load split per rank (the indexer whole on each), export back to every tensor of the
    checkpoint ``torch.equal``, and the TP = 2 logits are the one-process ones."""
    done = run_tp2("tests.dsa_hf.tp_export", run.path, run.batches[12], run.npu[12])
    assert done.returncode == 0, done.stderr[-4000:]
    export, diff = tp2_results(done.stdout)
    assert export[1:] == ["True", "True"] and int(export[0]) > 0, export
    print(f"tiny {run.model_type} TP = 2 + SP: {export[0]} tensors exported bit-exact; logits "
          f"within {diff:.1e} of TP = 1")  # fmt: skip
    assert diff <= 1e-5, diff


def test_glm5_layers_sharing_a_top_k_match_transformers(tmp_path):
    """GLM-5 with ``index_topk_freq=2`` (transformers: ``indexer_types`` full, full, shared: the
    third layer reuses the second's top-k and has no indexer): the bridge passes Megatron's rule
    (frequency 2, offset 2) as spec keywords, the third layer is built without an indexer, the
    logits are within the tolerance of transformers' and export is bit-exact (the checkpoint has
    no indexer tensors for that layer)."""
    from mcore_npu.integrations.hf_dsa import dsa_spec_keywords

    hf_model = save_tiny("glm_moe_dsa", tmp_path, index_topk_freq=2)
    assert hf_model.config.indexer_types == ["full", "full", "shared"]
    keywords = dsa_spec_keywords(hf_model.config)
    assert (keywords["dsa_indexer_topk_freq"], keywords["dsa_indexer_skip_topk_offset"]) == (2, 2)
    tokens = batches(LENGTHS, VOCAB)
    with torch.no_grad():
        hf = {n: hf_model(input_ids=ids).logits for n, ids in tokens.items()}
    run = plugin_run(tmp_path, BLOCKED, tokens)
    cores = [layer.self_attention.core_attention for layer in run.model.decoder.layers]
    assert [core.indexer is None for core in cores] == [False, False, True]
    errors = {n: float((run.npu[n] - hf[n]).abs().max()) for n in LENGTHS}
    print(f"tiny glm_moe_dsa, shared third layer: max |logit - transformers| {errors}")
    assert max(errors.values()) <= TOLERANCE, errors
    saved, exported = saved_and_exported(types.SimpleNamespace(path=str(tmp_path), **vars(run)))
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
