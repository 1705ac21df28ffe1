"""The compatibility smoke: every model kind the NPU spec builds, on the installed megatron-core.

``.ci/run`` runs this file on megatron-core 0.15.3 and 0.19.2 (``make compat-smoke``, one
environment each under ``.compat/``); ``make test`` runs it on the locked 0.16.1. Each entry of
:data:`MODELS` builds a tiny ``GPTModel`` from the NPU decoder-block spec (the default ``te``
parameter layout), and the test checks:

- the NPU parts are in the model (the entry's classes, each found at least once);
- one forward and backward: a finite loss, and every parameter gets a finite gradient;
- a ``dist_checkpointing`` save (``mcore_npu.training.checkpointing``), written in this process
  (no helper process left), and a load into a second model of other weights, after which both
  give the same logits, bit for bit.

A new model kind (Gated DeltaNet, ...) is one more entry: a builder ``seed -> GPTModel`` and the
NPU classes it must contain; ``hybrid`` is Megatron's hybrid model class instead.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.transformer import mla_models
from tests.transformer.megatron_models import gpt, tiny_config
from tests.transformer.moe_models import moe_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

VOCAB = 96  # megatron_models.gpt and mla_models.gpt both build with this vocabulary
KERNELS = dict(kernel="reference", rms_norm_kernel="reference", swiglu_kernel="reference",
               grouped_matmul_kernel="reference")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Entry:
    """A model kind: ``build(seed)`` -> GPTModel from the NPU spec; ``parts``: the names (in
    ``mcore_npu.transformer``) of the NPU classes that model must contain; ``refusal()``: on a
    megatron-core that cannot have the model, the pattern its one-line ValueError must match."""

    build: Callable
    parts: tuple[str, ...]
    refusal: Callable[[], str | None] = lambda: None  # the expected one-line refusal, if any


def _block(config):
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    return get_gpt_decoder_block_npu_spec(config, normalization=config.normalization, **KERNELS)


def dense(seed: int):
    config = tiny_config()
    return gpt(config, _block(config), seed=seed)


def moe(seed: int):
    """Every layer MoE: NPUTopKRouter, NPUGroupedMLP experts, NPUSharedExpertMLP."""
    config = moe_config(shared_expert=True)
    return gpt(config, _block(config), seed=seed)


def mla(seed: int):
    """DeepSeek-V3's attention, tiny: q LoRA, latent norms, yarn RoPE."""
    config = mla_models.mla_config()
    return mla_models.gpt(config, _block(config), seed=seed)


def dsa(seed: int):
    """DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2), tiny: MLA with a lightning indexer
    choosing 4 of 16 keys, trained by its KL loss (so every parameter gets a gradient)."""
    config = mla_models.dsa_config(topk=4, coeff=0.1)
    return mla_models.gpt(config, _block(config), seed=seed)


def gdn(seed: int):
    """Qwen3.5's hybrid, tiny: Gated DeltaNet layers and one full-attention layer."""
    from tests.transformer.gdn_models import gdn_config, gdn_gpt

    return gdn_gpt(gdn_config(), seed=seed)


def _gdn_refusal() -> str | None:
    """megatron-core 0.15 has no Gated DeltaNet / DSA config fields: GDNTransformerConfig and
    DSATransformerConfig refuse."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {field.name for field in dataclasses.fields(TransformerConfig)}
    return None if "experimental_attention_variant" in names else "came with megatron-core 0.16"


def hybrid(seed: int):
    """Megatron's hybrid model (MambaModel / HybridModel) from get_hybrid_stack_npu_spec: Mamba,
    attention, MLP and (0.16+, where the stack has the slot) MoE layers."""
    from tests.transformer.mamba_models import hybrid_model
    from tests.transformer.test_hybrid_stack import PATTERN

    return hybrid_model(PATTERN, seed=seed, vocab=VOCAB)


MODELS = {
    "dense": Entry(dense, ("NPUFusionAttention", "NPUMLP", "NPURMSNorm")),
    "moe": Entry(
        moe, ("NPUFusionAttention", "NPUTopKRouter", "NPUGroupedMLP", "NPUSharedExpertMLP")
    ),
    "mla": Entry(mla, ("NPUMLASelfAttention", "NPUFusionAttention", "NPUMLP")),
    "dsa": Entry(dsa, ("NPUDSASelfAttention", "NPUSparseAttention", "NPUMLP"), _gdn_refusal),
    "gdn": Entry(gdn, ("NPUGatedDeltaNet", "NPUFusionAttention"), _gdn_refusal),
    "hybrid": Entry(hybrid, ("NPUMambaMixer", "NPUFusionAttention", "NPUMLP")),
}


def _npu_classes() -> dict[str, type]:
    """The NPU classes an entry may name, by name."""
    from mcore_npu.transformer.attention import NPUFusionAttention
    from mcore_npu.transformer.dsa import NPUDSASelfAttention, NPUSparseAttention
    from mcore_npu.transformer.experts import NPUGroupedMLP
    from mcore_npu.transformer.gated_delta_net import NPUGatedDeltaNet
    from mcore_npu.transformer.mamba import NPUMambaMixer
    from mcore_npu.transformer.mla import NPUMLASelfAttention
    from mcore_npu.transformer.mlp import NPUMLP, NPUSharedExpertMLP
    from mcore_npu.transformer.norms import NPURMSNorm
    from mcore_npu.transformer.router import NPUTopKRouter

    found = (NPUDSASelfAttention, NPUFusionAttention, NPUGatedDeltaNet, NPUGroupedMLP,
             NPUMambaMixer, NPUMLASelfAttention, NPUMLP, NPUSharedExpertMLP, NPURMSNorm,
             NPUSparseAttention, NPUTopKRouter)  # fmt: skip
    return {cls.__name__: cls for cls in found}


def _logits(model) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of a seeded batch ``[2, 16]``."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    return model(ids, torch.arange(16).expand(2, 16), None)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_builds_runs_and_round_trips_a_checkpoint(name, tmp_path):
    from mcore_npu.training import checkpointing

    entry = MODELS[name]
    refusal = entry.refusal()
    if refusal is not None:  # a model this megatron-core cannot have: refused in one line
        with pytest.raises(ValueError, match=refusal) as caught:
            entry.build(seed=1)
        assert "\n" not in str(caught.value)
        return
    model = entry.build(seed=1)
    classes = _npu_classes()
    for part in entry.parts:
        cls = classes[part]
        assert any(isinstance(m, cls) for m in model.modules()), f"{name}: no {part} in the model"

    logits = _logits(model)
    labels = torch.randint(0, VOCAB, logits.shape[:2], generator=torch.Generator().manual_seed(3))
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    assert torch.isfinite(loss), loss
    missing = [n for n, p in model.named_parameters()
               if p.grad is None or not torch.isfinite(p.grad).all()]  # fmt: skip
    assert not missing, f"{name}: parameters without a finite gradient: {missing}"

    path = checkpointing.save({"model": model.sharded_state_dict()}, tmp_path, 1)
    # written in this process: megatron-core 0.18+ swaps a strategy it does not take for its
    # own, whose writer starts a spawned Manager process that outlives the save (and held
    # pytest at exit on 0.17 / 0.18)
    assert not multiprocessing.active_children(), multiprocessing.active_children()
    other = entry.build(seed=2)
    with torch.no_grad():
        want = _logits(model)
        assert not torch.equal(_logits(other), want), "the second model must start different"
        loaded = checkpointing.load({"model": other.sharded_state_dict()}, path)["model"]
        other.load_state_dict(loaded)
        torch.testing.assert_close(_logits(other), want, rtol=0, atol=0)
