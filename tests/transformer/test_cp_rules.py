"""The context-parallel rules (``context_parallel.rules``): one answer, asked by every site.

- Each rule refuses exactly its case and names the argument; everything else passes.
- A refusal is both a ValueError and a NotImplementedError; its reasons render in a caller's
  words (the YAML keys of ``mcore-npu train``).
- The YAML validator, the verl recipe translator and the attention module give the same
  problem for the same case (the per-call cases, through the algorithms, are checked under
  torchrun in ``tests/distributed/test_context_parallel.py``).
"""

from __future__ import annotations

import types

import pytest
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from mcore_npu.training.config import ConfigError, load_config
from mcore_npu.transformer.attention import NPUFusionAttention
from mcore_npu.transformer.context_parallel import rules
from mcore_npu.transformer.recipe_keys import RecipeContext, translate
from tests.launch import ROOT

TINY = ROOT / "configs" / "gpt_tiny.yaml"

CASES = [  # (comm type, facts, the refused argument or None)
    ("p2p", {}, None),
    ("p2p", {"causal": False}, "cp_comm_type"),
    ("p2p", {"dropout": 0.1}, "attention_dropout"),
    ("p2p", {"window": (4, 0)}, None),  # sbhd windows run on the ring
    ("p2p", {"window": (4, 0), "packed": True}, "window_size"),
    ("p2p", {"window": (-1, 0), "packed": True}, None),  # (-1, 0) is plain causal
    ("all_gather", {"causal": False, "dropout": 0.1}, None),
    ("all_gather", {"window": (4, 2), "packed": True}, "window_size"),
    ("all_gather", {"window": (4, 0), "packed": True, "causal": False}, "window_size"),
    ("all_gather", {"window": (4, 0), "packed": True}, None),
    ("a2a", {"heads": 4, "groups": 2}, None),
    ("a2a", {"heads": 4, "groups": 1}, "num_query_groups"),
    ("a2a", {"heads": 6, "groups": 4, "tp": 2}, "num_attention_heads"),  # 3 per TP rank
    ("a2a", {"heads": 8, "groups": 4, "tp": 2}, None),
    ("a2a+p2p", {}, "cp_comm_type"),
    ("ring", {}, "cp_comm_type"),
]


@pytest.mark.parametrize(("comm_type", "facts", "refused"), CASES)
def test_each_rule_refuses_its_case_and_names_the_argument(comm_type, facts, refused):
    reasons = rules.not_supported_reasons(comm_type, 2, **facts)
    assert [r.fact for r in reasons] == ([refused] if refused else [])
    for reason in reasons:
        assert "fix: " in str(reason) and str(reason).startswith(f"{refused}=")


def test_a_refusal_is_both_a_value_error_and_not_implemented():
    for error in (ValueError, NotImplementedError):
        with pytest.raises(error, match="layer 3: cp_comm_type='a2a\\+p2p'"):
            rules.check("a2a+p2p", 2, where="layer 3")
    rules.check("p2p", 2, window=(4, 0))  # passes: returns None


def test_reasons_render_in_the_callers_words():
    (reason,) = rules.not_supported_reasons("p2p", 2, dropout=0.1)
    key, problem, fix = reason.render({"attention_dropout": "model.attention_dropout",
                                       "cp_comm_type": "parallel.cp_comm_type"})  # fmt: skip
    assert key == "model.attention_dropout" and "parallel.cp_comm_type='all_gather'" in fix
    assert "{" not in problem + fix
    assert "cp_comm_type='all_gather'" in str(reason) and "parallel." not in str(reason)


def _config(groups: int) -> TransformerConfig:
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               num_query_groups=groups, context_parallel_size=1)  # fmt: skip
    object.__setattr__(config, "context_parallel_size", 2)  # no CP group needed to be refused
    object.__setattr__(config, "cp_comm_type", "a2a")
    return config


def test_the_validator_the_translator_and_the_module_give_the_same_answer():
    """One case each site can see: Ulysses with one KV group over two CP ranks; and p2p with
    dropout, which the module refuses per call (the validator and translator up front)."""
    (heads,) = rules.not_supported_reasons("a2a", 2, heads=4, groups=1)
    groups = types.SimpleNamespace(cp="the CP group", tp=types.SimpleNamespace(size=lambda: 1))
    with pytest.raises(ConfigError) as yaml_error:
        load_config(TINY, ["parallel.context=2", "parallel.cp_comm_type=a2a",
                           "model.num_query_groups=1"], world_size=2)  # fmt: skip
    with pytest.raises(rules.ContextParallelUnsupported) as module_error:
        NPUFusionAttention(_config(groups=1), 1, AttnMaskType.causal, pg_collection=groups)
    assert heads.problem in str(yaml_error.value) and heads.problem in str(module_error.value)
    built = NPUFusionAttention(_config(groups=2), 1, AttnMaskType.causal, pg_collection=groups)
    assert (built.cp_comm_type, built.cp_group) == ("a2a", "the CP group")

    (dropout,) = rules.not_supported_reasons("p2p", 2, dropout=0.1)
    with pytest.raises(ConfigError) as yaml_error:
        load_config(TINY, ["parallel.context=2", "model.attention_dropout=0.1"], world_size=2)
    context = RecipeContext(TransformerConfig, num_layers=2, context_parallel_size=2)
    with pytest.raises(ValueError) as recipe_error:
        translate({"context_parallel_algo": "megatron_cp_algo", "attention_dropout": 0.1}, context)
    assert dropout.problem in str(yaml_error.value) and dropout.problem in str(recipe_error.value)
