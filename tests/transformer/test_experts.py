"""NPUGroupedMLP on its own: weights independent of the expert/tensor-parallel layout, the
activation choices, and refusals.

The layout tests give the module ``pg_collection`` stand-ins that only answer ``rank()`` and
``size()`` (no process group is needed to draw weights); everything else is real megatron-core.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mcore_npu.transformer.experts import NPUGroupedMLP
from tests.transformer.megatron_models import tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


class _Group:
    """Answers what NPUGroupedMLP asks of a process group: its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _experts(ep=(0, 1), tp=(0, 1), num_experts=4, param_layout="local", **overrides):
    fields = dict(num_moe_experts=num_experts, moe_router_topk=2, moe_ffn_hidden_size=32)
    config = tiny_config(**{**fields, **overrides})
    groups = SimpleNamespace(ep=_Group(*ep), expt_tp=_Group(*tp), expt_dp=_Group(0, 1))
    torch.manual_seed(11)
    return NPUGroupedMLP(num_experts // ep[1], config, pg_collection=groups, kernel="reference",
                         param_layout=param_layout)  # fmt: skip


def test_expert_parallel_ranks_hold_the_one_process_experts():
    whole = _experts()
    for rank in (0, 1):
        part = _experts(ep=(rank, 2))
        for e in range(2):
            g = 2 * rank + e
            assert torch.equal(part.fc1_weights()[e], whole.fc1_weights()[g])
            assert torch.equal(part.fc2_weights()[e], whole.fc2_weights()[g])


def test_tensor_parallel_ranks_hold_gate_and_up_shards():
    whole = _experts()
    f = 32
    for rank in (0, 1):
        part = _experts(tp=(rank, 2))
        gate, up = whole.fc1_weights()[1][:f], whole.fc1_weights()[1][f:]
        half = slice(rank * f // 2, (rank + 1) * f // 2)
        assert torch.equal(part.fc1_weights()[1], torch.cat([gate[half], up[half]]))
        assert torch.equal(part.fc2_weights()[1], whole.fc2_weights()[1][:, half])


@pytest.mark.parametrize("gated, activation", [(True, F.silu), (False, F.gelu), (True, F.gelu)])
def test_forward_matches_a_per_expert_loop(gated, activation):
    experts = _experts(gated_linear_unit=gated, activation_func=activation)
    counts = torch.tensor([3, 0, 4, 1])
    x = torch.randn(8, 64)
    probs = torch.rand(8)
    out, bias = experts(x, counts, probs)
    assert bias is None
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = x[start : start + n] @ experts.fc1_weights()[e].t()
        if gated:
            a, b = h.chunk(2, dim=-1)
            h = activation(a) * b
        else:
            h = activation(h)
        rows.append((h * probs[start : start + n, None]) @ experts.fc2_weights()[e].t())
        start += n
    torch.testing.assert_close(out, torch.cat(rows), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [True, False])
def test_expert_biases_follow_megatrons_expert_mlp(gated):
    """fc1's bias before the activation, fc2's scaled by each row's probability (Megatron's
    ``MLP.forward`` with ``per_token_scale``)."""
    activation = F.silu if gated else F.gelu
    experts = _experts(gated_linear_unit=gated, activation_func=activation, add_bias_linear=True)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in experts.fc1_biases())  # as Megatron
    with torch.no_grad():
        for b in [*experts.fc1_biases(), *experts.fc2_biases()]:
            b.normal_()
    counts = torch.tensor([3, 0, 4, 1])
    x, probs = torch.randn(8, 64), torch.rand(8)
    out, bias = experts(x, counts, probs)
    assert bias is None
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = x[start : start + n] @ experts.fc1_weights()[e].t() + experts.fc1_biases()[e]
        if gated:
            a, b = h.chunk(2, dim=-1)
            h = activation(a) * b
        else:
            h = activation(h)
        p = probs[start : start + n, None]
        rows.append((h * p) @ experts.fc2_weights()[e].t() + experts.fc2_biases()[e] * p)
        start += n
    torch.testing.assert_close(out, torch.cat(rows), rtol=1e-5, atol=1e-5)


def test_expert_bias_attributes_are_megatrons():
    """fc1's bias is marked split over expert TP (rows, like ColumnParallelLinear's), fc2's is
    not (RowParallelLinear's, with its ``sequence_parallel`` flag); neither is all-reduced over
    the dense data-parallel group. (Megatron's config refuses MoE biases with expert TP > 1.)"""
    experts = _experts(add_bias_linear=True, gated_linear_unit=False, activation_func=F.gelu,
                       sequence_parallel=True, tensor_model_parallel_size=2,
                       expert_tensor_parallel_size=1)  # fmt: skip
    b1, b2 = experts.fc1_biases()[0], experts.fc2_biases()[0]
    assert b1.shape == (32,) and b2.shape == (64,)
    assert (b1.tensor_model_parallel, b1.partition_dim, b1.allreduce) == (True, 0, False)
    assert not getattr(b2, "tensor_model_parallel", False) and b2.allreduce is False
    assert b2.sequence_parallel is True


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="param_layout: unknown layout 'mcore'"):
        NPUGroupedMLP(4, tiny_config(num_moe_experts=4, moe_ffn_hidden_size=32),
                      pg_collection=SimpleNamespace(ep=_Group(0, 1), expt_tp=_Group(0, 1),
                                                    expt_dp=_Group(0, 1)),
                      param_layout="mcore")  # fmt: skip
    with pytest.raises(ValueError, match="moe_ffn_hidden_size"):
        _experts(tp=(0, 3))


def test_te_layout_loads_transformer_engines_grouped_state_dicts():
    """TEGroupedLinear's state dict (one ``_extra_state`` per linear: TE's byte tensor) and what
    a dist-checkpoint load hands back for TEGroupedMLP (``_extra_state1`` .. ``_extra_state3``
    besides) both load with ``strict=True``; the weights arrive, the FP8 metadata is ignored."""
    source, target = _experts(param_layout="te"), _experts(param_layout="te", init_method_std=0.5)
    weights = {n: t for n, t in source.state_dict().items() if "_extra_state" not in n}
    assert set(source.state_dict()) - set(weights) == {
        "linear_fc1._extra_state", "linear_fc2._extra_state"}  # fmt: skip
    te_bytes = torch.frombuffer(bytearray(b"fp8 metadata"), dtype=torch.uint8)
    torch_native = {**weights, "linear_fc1._extra_state": te_bytes,
                    "linear_fc2._extra_state": torch.empty(0, dtype=torch.uint8)}  # fmt: skip
    dist_ckpt = {**torch_native, **{f"linear_fc{k}._extra_state{e}": te_bytes
                                    for k in (1, 2) for e in (1, 2, 3)}}  # fmt: skip
    for state in (torch_native, dist_ckpt, weights):
        target.load_state_dict(state, strict=True)
        for name, tensor in weights.items():
            assert torch.equal(target.state_dict()[name], tensor), name
        assert target.state_dict()["linear_fc1._extra_state"] is None
        with torch.no_grad():
            target.linear_fc1.weight0.zero_()
    with pytest.raises(RuntimeError, match="linear_fc1._extra_state4"):  # only E - 1 splits
        target.load_state_dict({**dist_ckpt, "linear_fc1._extra_state4": te_bytes})
