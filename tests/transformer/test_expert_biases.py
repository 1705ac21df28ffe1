"""Expert biases (``add_bias_linear=True``, Megatron's default) in ``NPUGroupedMLP``: a tiny MoE
GPT equals Megatron's ``SequentialMLP`` with biases (logits and every gradient, the biases'
included), in both parameter layouts and with ``moe_grouped_gemm`` on and off, and dist
checkpoints move between the two modules both ways.

Real megatron-core (one gloo process, CPU) and real dist_checkpointing. The Megatron twin's
expert ``linear_fc2`` returns a copy of its output (``CopiedOutputRowParallelLinear`` in
tests/transformer/moe_models.py): megatron-core 0.16.1's ``SequentialMLP`` otherwise refuses
expert biases in one process (an in-place add on an autograd view).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_npu.training import checkpointing
from tests.transformer.megatron_models import batch, gpt
from tests.transformer.moe_models import local_moe_spec, moe_config, npu_moe_spec, twin_moe_models

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

LAYOUTS = [("local", False), ("te", False), ("te", True)]


def _logits_and_grads(model, ids, pos):
    model.zero_grad()
    logits = model(ids, pos, None)
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _expert_biases(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".experts." in n and ".bias" in n}


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("param_layout,grouped_gemm", LAYOUTS)
@pytest.mark.parametrize(
    "activation",
    [
        dict(),  # SwiGLU, the bias added before npu_swiglu
        dict(gated_linear_unit=False, activation_func=F.gelu),
    ],
    ids=["swiglu", "gelu"],
)
def test_expert_biases_match_megatrons_sequential_mlp(
    dispatcher, param_layout, grouped_gemm, activation
):
    config = moe_config(dispatcher=dispatcher, moe_grouped_gemm=grouped_gemm,
                        add_bias_linear=True, **activation)  # fmt: skip
    local, npu, names = twin_moe_models(config, param_layout=param_layout)
    biases = _expert_biases(npu)
    assert len(biases) == 2 * 2 * 4  # 2 layers x 2 linears x 4 experts
    assert all(b.abs().sum() > 0 for b in biases.values())  # drawn, not Megatron's zeros
    ids, pos = batch(b=2, s=16)
    want, want_grads = _logits_and_grads(local, ids, pos)
    got, got_grads = _logits_and_grads(npu, ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert {names[n] for n in want_grads} == set(got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[names[name]], grad, rtol=1e-5, atol=1e-5, msg=name)
    for layer in (0, 1):  # each layer's fc1 and fc2 biases get gradients (an expert may get
        for fc in ("linear_fc1", "linear_fc2"):  # no token: its gradient is zero)
            grads = [got_grads[n] for n in biases if f"layers.{layer}." in n and fc in n]
            assert len(grads) == 4 and any(g.abs().sum() > 0 for g in grads), (layer, fc)


def test_bias_activation_fusion_gives_the_same_numbers():
    """Megatron's experts raise with ``bias_activation_fusion`` and biases (megatron-core
    0.16.1: "Bias is not supported for weighted swiglu fusion"); NPUGroupedMLP computes what
    the fusion stands for, swiglu(y + b) * probs, the numbers of the unfused path."""
    ids, pos = batch(b=2, s=16)
    outs = []
    for fused in (False, True):
        config = moe_config(add_bias_linear=True, bias_activation_fusion=fused)
        _, npu, _ = twin_moe_models(config, param_layout="te")
        outs.append(npu(ids, pos, None).detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_expert_biases_change_the_logits():
    """The comparison above can fail: zeroing one expert's fc2 bias moves the logits."""
    config = moe_config(add_bias_linear=True)
    local, npu, _ = twin_moe_models(config, param_layout="te")
    ids, pos = batch(b=2, s=16)
    before = npu(ids, pos, None).detach()
    with torch.no_grad():
        npu.decoder.layers[0].mlp.experts.local_experts[1].linear_fc2.bias.zero_()
    assert (npu(ids, pos, None).detach() - before).abs().max() > 1e-4


@pytest.mark.parametrize("param_layout,grouped_gemm", LAYOUTS)
def test_bias_names_are_sequential_mlps_or_te_grouped_linears(param_layout, grouped_gemm):
    config = moe_config(add_bias_linear=True, moe_grouped_gemm=grouped_gemm)
    _, npu, _ = twin_moe_models(config, param_layout=param_layout)
    experts = npu.decoder.layers[0].mlp.experts
    names = {n for n, _ in experts.named_parameters() if "bias" in n}
    if grouped_gemm:
        want = {f"linear_fc{k}.bias{e}" for k in (1, 2) for e in range(4)}
    else:
        want = {f"local_experts.{e}.linear_fc{k}.bias" for k in (1, 2) for e in range(4)}
    assert names == want
    sharded = experts.sharded_state_dict(prefix="experts.")
    for name in want:
        key = sharded[f"experts.{name}"].key
        assert key == f"experts.experts.linear_fc{name.split('linear_fc')[1][0]}.bias", key


def _sequential(seed: int):
    """Megatron's local MoE GPT (SequentialMLP) with drawn biases."""
    config = moe_config(add_bias_linear=True)
    model = gpt(config, local_moe_spec(config), seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    return model


def _grouped(seed: int, layout: str):
    """The NPU spec's MoE GPT (NPUGroupedMLP): "local" | "te" | "te-grouped"."""
    grouped = layout == "te-grouped"
    config = moe_config(add_bias_linear=True, moe_grouped_gemm=grouped)
    model = gpt(config, npu_moe_spec(config, param_layout=layout.removesuffix("-grouped")),
                seed=seed)  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or ".bias" in name.rsplit(".", 1)[-1]:
                param.normal_(0, 0.1)
    return model


def _through_checkpoint(source, target, path):
    saved = checkpointing.save({"model": source.sharded_state_dict()}, path, 1)
    state = checkpointing.match_layout(target.sharded_state_dict(), saved)
    target.load_state_dict(checkpointing.load({"model": state}, saved)["model"])


@pytest.mark.parametrize("layout", ["local", "te", "te-grouped"])
@pytest.mark.parametrize("direction", ["sequential-to-grouped", "grouped-to-sequential"])
def test_checkpoints_interchange_with_sequential_mlp(tmp_path, layout, direction):
    """Saved from one module, loaded into the other: every expert weight and bias arrives
    (compared by value through the twin-name map), and the two models then compute the same
    logits."""
    sequential, grouped = _sequential(seed=1), _grouped(seed=2, layout=layout)
    source, target = (
        (sequential, grouped) if direction == "sequential-to-grouped" else (grouped, sequential)
    )
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    _through_checkpoint(source, target, tmp_path)
    ids, pos = batch(b=2, s=16)
    with torch.no_grad():
        torch.testing.assert_close(
            grouped(ids, pos, None), sequential(ids, pos, None), rtol=1e-5, atol=1e-5
        )
    local_names = _names_in_sequential(grouped)
    seq_params = dict(sequential.named_parameters())
    for name, param in grouped.named_parameters():
        if ".experts." in name:
            torch.testing.assert_close(param, seq_params[local_names[name]], rtol=0, atol=0)
    changed = [n for n, p in target.named_parameters() if not torch.equal(p, before[n])]
    assert any(".experts." in n and "bias" in n for n in changed)


def _names_in_sequential(grouped) -> dict[str, str]:
    """NPUGroupedMLP expert names -> SequentialMLP's (``linear_fc1.bias3`` ->
    ``local_experts.3.linear_fc1.bias``; the local layout's are the same)."""
    out = {}
    for name, _ in grouped.named_parameters():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            continue
        if not tail.startswith("local_experts."):
            which, leaf_e = tail.split(".")
            leaf = "bias" if leaf_e.startswith("bias") else "weight"
            tail = f"local_experts.{leaf_e.removeprefix(leaf)}.{which}.{leaf}"
        out[name] = f"{head}.experts.{tail}"
    return out


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_expert_names_are_the_te_specs(grouped_gemm):
    """The experts' parameters, state_dict, sharded_state_dict and disk keys with biases, as
    specs/param_names_te.yaml lists them (the attention's biases are outside this test)."""
    from tests.transformer.te_names import disk_key, expected_names

    config = moe_config(add_bias_linear=True, moe_grouped_gemm=grouped_gemm,
                        moe_layer_freq=[0, 1])  # fmt: skip
    model = gpt(config, npu_moe_spec(config, param_layout="te"))

    def experts(names):
        return {n for n in names if ".mlp.experts." in n}

    assert experts(n for n, _ in model.named_parameters()) == experts(
        expected_names(config, "parameters")
    )
    assert experts(model.state_dict()) == experts(expected_names(config, "state_dict"))
    sharded = model.sharded_state_dict()
    assert experts(sharded) == experts(expected_names(config, "sharded"))
    for name in experts(sharded):
        assert sharded[name].key == disk_key(name, config), name
