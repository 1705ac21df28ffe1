"""``NPUTopKRouter``: Megatron's TopKRouter with TE-free gating.

Which megatron-core releases need it (read from each release's wheel, moe_utils.py and
moe_layer.py; checked against the installed release below):

| release | ``te_general_gemm`` without TE | effect on ``TopKRouter`` without TE | router spec slot |
|---|---|---|---|
| 0.14.0 | never bound (``except ImportError: HAVE_TE = False``) | ``NameError`` in gating | no (MoELayer builds ``TopKRouter`` itself) |
| 0.15.0 | never bound | ``NameError`` | no |
| 0.16.1 | never bound | ``NameError`` | ``MoESubmodules.router`` |
| 0.17.0 | bound to ``None`` (``if HAVE_TE: ... else: (...) = (None, ...)``) | works | ``MoESubmodules.router`` |

So 0.16.x is where both hold: the bug is there and the slot exists for this fix. On 0.17+ the
router is not needed but harmless (same numbers as Megatron's own fallback branch); on 0.14/0.15
only patching would help, which this package does not do.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from packaging.version import Version

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

NEEDS_ROUTER = {"0.14.0": True, "0.15.0": True, "0.15.3": True, "0.16.1": True, "0.17.0": False,
                "0.17.1": False, "0.18.2": False, "0.19.2": False}  # fmt: skip
HAS_ROUTER_SLOT = {"0.14.0": False, "0.15.0": False, "0.15.3": False, "0.16.1": True,
                   "0.17.0": True, "0.17.1": True, "0.18.2": True, "0.19.2": True}  # fmt: skip


def _config(**overrides):
    from tests.transformer.megatron_models import tiny_config

    fields = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                  moe_router_dtype="fp32", moe_aux_loss_coeff=0.0,
                  moe_router_load_balancing_type="none")  # fmt: skip
    fields.update(overrides)
    return tiny_config(**fields)


def _routers(config):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from mcore_npu.transformer.router import NPUTopKRouter

    torch.manual_seed(0)
    ours = NPUTopKRouter(config=config, pg_collection=get_default_pg_collection())
    theirs = TopKRouter(config=config, pg_collection=get_default_pg_collection())
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _installed() -> str:
    import megatron.core

    return Version(megatron.core.__version__).public  # 0.18+ may add a local "+<commit>"


def test_the_installed_release_has_the_te_general_gemm_bug_as_the_table_says():
    from megatron.core.transformer.moe import moe_layer, moe_utils

    version = _installed()
    if version not in NEEDS_ROUTER:
        pytest.fail(f"megatron-core {version} is not in this test's table; read its moe_utils.py "
                    "and add a row")  # fmt: skip
    unbound = not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm")
    assert unbound == NEEDS_ROUTER[version]
    slots = {field.name for field in dataclasses.fields(moe_layer.MoESubmodules)}
    assert ("router" in slots) == HAS_ROUTER_SLOT[version]


def test_megatrons_router_fails_without_te_where_the_table_says_and_ours_runs():
    config = _config()
    ours, theirs = _routers(config)
    x = torch.randn(6, 2, config.hidden_size)
    if NEEDS_ROUTER[_installed()]:
        with pytest.raises(NameError, match="te_general_gemm"):
            theirs(x)
    else:  # 0.17+: Megatron's own fallback runs, with our numbers
        want_probs, want_map = theirs(x)[:2]
        got_probs, got_map = ours(x)[:2]
        torch.testing.assert_close(got_probs, want_probs, rtol=0, atol=0)
        assert torch.equal(got_map, want_map)
    probs, routing_map = ours(x)[:2]
    assert probs.shape == routing_map.shape == (12, 4)
    assert routing_map.sum(-1).eq(2).all()  # top-2


@pytest.mark.parametrize("router_dtype, want", [("fp32", torch.float32), ("fp64", torch.float64),
                                                (None, torch.float32)])  # fmt: skip
def test_gating_computes_in_moe_router_dtype_with_a_plain_matmul(router_dtype, want):
    config = _config(moe_router_dtype=router_dtype)
    ours, _ = _routers(config)
    x = torch.randn(5, 2, config.hidden_size, requires_grad=True)
    logits = ours.gating(x)
    assert logits.dtype == want and logits.shape == (5, 2, 4)
    expect = x.detach().to(want) @ ours.weight.detach().to(want).t()
    torch.testing.assert_close(logits, expect, rtol=0, atol=0)
    logits.sum().backward()
    assert x.grad.dtype == x.dtype and ours.weight.grad.dtype == ours.weight.dtype
    torch.testing.assert_close(x.grad, ours.weight.detach().sum(0).expand_as(x))


def test_routing_is_megatrons_same_as_its_fallback_branch():
    """Megatron's own non-TE branch (what 0.17 runs) gives the same probabilities and map."""
    from megatron.core.transformer.moe import moe_utils

    config = _config(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.0)
    ours, theirs = _routers(config)
    x = torch.randn(7, 2, config.hidden_size)
    logits = torch.mm(x.view(-1, config.hidden_size), theirs.weight.t()).view(7, 2, 4)
    want_probs, want_map = theirs.routing(logits)
    probs, routing_map = ours(x)[:2]
    # we did not patch Megatron: unbound (<= 0.16) or Megatron's own None (0.17+)
    assert getattr(moe_utils, "te_general_gemm", None) is None
    torch.testing.assert_close(probs, want_probs, rtol=0, atol=0)
    assert torch.equal(routing_map, want_map)


# -- the DeepSeek-V3 router: sigmoid scores, expert bias, group-limited top-k, scaling ---------

DEEPSEEK = dict(num_moe_experts=16, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True)  # fmt: skip
DEEPSEEK_CASES = {  # DeepSeek-V3 itself: 256 experts, 8 groups of 32, 4 of them, top-8, 2.5
    "groups": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                   moe_router_topk_scaling_factor=2.5),  # 16 experts, 4 groups of 4, 2 of them
    "no_groups": dict(moe_router_topk=2, moe_router_topk_scaling_factor=None),
}  # fmt: skip
BIAS = 0.2 * torch.randn(16, generator=torch.Generator().manual_seed(2))


def deepseek_v3_gate(logits, bias, topk, groups, group_topk, scale):
    """DeepSeek-V3's gate, written from its description (not Megatron's code): sigmoid scores;
    the experts are chosen on score + bias, within the ``group_topk`` groups whose two best
    (score + bias) are largest; the weights are the chosen *scores* (no bias), normalised to sum
    1, times ``scale``. ``logits [T, E]`` -> dense weights ``[T, E]`` (0 = not chosen)."""
    scores = logits.float().sigmoid()
    choice = scores + bias if bias is not None else scores
    if groups:
        per_group = choice.view(len(choice), groups, -1)
        best_groups = per_group.topk(2, dim=-1).values.sum(-1).topk(group_topk, dim=-1).indices
        keep = torch.zeros_like(per_group[..., 0], dtype=torch.bool)
        keep.scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], 1), -torch.inf)
    chosen = choice.topk(topk, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * (scale or 1.0)
    return torch.zeros_like(scores).scatter(1, chosen, weights)


@pytest.mark.parametrize("case", list(DEEPSEEK_CASES))
def test_deepseek_routing_equals_megatrons_and_the_gates_definition(case):
    """Probabilities, routing map and the router weight's gradient of ``NPUTopKRouter`` against
    Megatron's ``TopKRouter.routing`` (on the logits its non-TE branch computes) and against an
    independent DeepSeek-V3 gate; the expert bias changes the choice, so a dropped one shows."""
    from megatron.core.transformer.moe import moe_utils

    fields = DEEPSEEK_CASES[case]
    config = _config(**DEEPSEEK, **fields)
    ours, theirs = _routers(config)
    with torch.no_grad():
        for router in (ours, theirs):
            router.expert_bias.copy_(BIAS)
    x = torch.randn(16, 2, config.hidden_size, generator=torch.Generator().manual_seed(3))

    probs, routing_map = ours(x)[:2]
    logits = torch.mm(x.view(-1, config.hidden_size), theirs.weight.t())
    with torch.compiler.set_stance("force_eager"):  # its @jit_fuser count: no compile here
        want_probs, want_map = theirs.routing(logits.view(16, 2, 16))
    assert getattr(moe_utils, "te_general_gemm", None) is None  # Megatron not patched
    torch.testing.assert_close(probs, want_probs, rtol=0, atol=0)
    assert torch.equal(routing_map, want_map)

    args = (fields["moe_router_topk"], fields.get("moe_router_num_groups"),
            fields.get("moe_router_group_topk"), fields["moe_router_topk_scaling_factor"])  # fmt: skip
    reference = deepseek_v3_gate(logits, BIAS, *args)
    torch.testing.assert_close(probs, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(routing_map, reference > 0)
    assert routing_map.sum(-1).eq(fields["moe_router_topk"]).all()
    assert not torch.equal(reference > 0, deepseek_v3_gate(logits, None, *args) > 0)
    if args[1]:  # the groups limit the choice
        assert not torch.equal(reference > 0, deepseek_v3_gate(logits, BIAS, args[0], None, None,
                                                               args[3]) > 0)  # fmt: skip

    upstream = torch.randn(probs.shape, generator=torch.Generator().manual_seed(4))
    (probs * upstream).sum().backward()
    weight = theirs.weight.detach().clone().requires_grad_(True)
    logits = torch.mm(x.view(-1, config.hidden_size), weight.t())
    (deepseek_v3_gate(logits, BIAS, *args) * upstream).sum().backward()
    torch.testing.assert_close(ours.weight.grad, weight.grad, rtol=1e-5, atol=1e-6)


def test_expert_bias_counts_are_megatrons_and_run_eagerly():
    """``local_tokens_per_expert`` (what Megatron's ``finalize_model_grads`` turns into the
    expert-bias update) counts every routed token in training forwards, none under no_grad; the
    count runs Megatron's own function without its torch.compile wrapper (no dynamo frame)."""
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter
    from torch._dynamo.utils import counters

    config = _config(**DEEPSEEK, **DEEPSEEK_CASES["groups"])
    ours, _ = _routers(config)
    if hasattr(TopKRouter, "_apply_expert_bias"):  # 0.16+: a @jit_fuser method (0.15: inline)
        assert inspect.unwrap(TopKRouter._apply_expert_bias) is not TopKRouter._apply_expert_bias
    frames = sum(counters["frames"].values())
    total = torch.zeros(16)
    for seed in (5, 6):
        x = torch.randn(9, 2, config.hidden_size, generator=torch.Generator().manual_seed(seed))
        routing_map = ours(x)[1]
        total += routing_map.sum(0)
    torch.testing.assert_close(ours.local_tokens_per_expert, total, rtol=0, atol=0)
    assert total.sum() == 2 * 18 * 4
    with torch.no_grad():
        ours(torch.randn(4, 2, config.hidden_size))
    torch.testing.assert_close(ours.local_tokens_per_expert, total, rtol=0, atol=0)
    assert sum(counters["frames"].values()) == frames
