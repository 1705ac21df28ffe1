"""Megatron-LM's ``--spec MODULE NAME``, done as Megatron-LM does it.

``pretrain_gpt.py`` passes argparse's ``[MODULE, NAME]`` to megatron-core's own
``spec_utils.import_module`` (``vars(import_module(MODULE))[NAME]``, never called) and hands the
object to ``GPTModel`` as ``transformer_layer_spec``. Here: the same lookup on the installed
megatron-core, a tiny GPTModel built from what it returns on CPU, one training step (loss
finite, every parameter gets a gradient and changes).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from tests.transformer.megatron_models import VOCAB, batch, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

MODULE = "mcore_npu.transformer.megatron_lm"
CASES = {  # NAME -> (qk norm, MoE)
    "npu_layer_spec": (False, False),
    "npu_layer_spec_qk_norm": (True, False),
    "npu_moe_layer_spec": (False, True),
    "npu_moe_layer_spec_qk_norm": (True, True),
}
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
           moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
           moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss")  # fmt: skip


def test_the_module_lists_exactly_the_documented_specs():
    from megatron.core.transformer.spec_utils import ModuleSpec

    module = importlib.import_module(MODULE)
    assert set(module.SPECS) == set(CASES)
    found = {name for name, value in vars(module).items() if isinstance(value, ModuleSpec)}
    assert found == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_lms_lookup_builds_a_gpt_that_trains_a_step(name):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mcore_npu.transformer.attention import NPUFusionAttention
    from mcore_npu.transformer.experts import NPUGroupedMLP

    spec = import_module([MODULE, name])  # argparse's nargs list, as pretrain_gpt.py passes it
    assert spec is vars(importlib.import_module(MODULE))[name]
    assert isinstance(spec, ModuleSpec) and spec.module is TransformerLayer  # Megatron's layer
    qk_norm, moe = CASES[name]
    config = tiny_config(qk_layernorm=qk_norm, **(MOE if moe else {}))
    torch.manual_seed(0)
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="rope")  # fmt: skip

    modules = list(model.modules())
    assert any(isinstance(m, NPUFusionAttention) for m in modules)
    assert any(isinstance(m, NPUGroupedMLP) for m in modules) == moe
    names = set(model.state_dict())
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names  # TE names
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in names) == qk_norm
    if moe:
        assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in names  # TEGroupedMLP's

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, pos = batch()
    loss = model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean()
    loss.backward()
    optimizer.step()
    assert math.isfinite(loss.item())
    with_grad = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()]
    assert set(with_grad) == set(before), sorted(set(before) - set(with_grad))
    unchanged = [n for n in with_grad if torch.equal(before[n], dict(model.named_parameters())[n])]
    assert not unchanged, unchanged
