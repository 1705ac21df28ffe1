"""Batch-invariant (true on-policy) mode through verl 0.9.1's ``TrainingWorker`` with the
plugin's engine, on CPU: the three keys of verl's true-on-policy Ascend recipes in
``override_transformer_config``, and the log-probs of one sequence have the same bits alone,
first or last in a packed (thd) batch of sequences of other lengths, or right-padded in a bshd
batch; for a dense and an MoE model, within 0.1 of transformers. In the mode every matmul
(the layers', the output layer's) and the log-probs' sum are the batch-invariant operators.

Without the mode the CPU path keeps the bits of packed (thd) placements but not of right
padding: the MoE model's padded log-probs move by about 2e-4 (the regression test below keeps
both facts). With the mode, attention is the fixed-block reference
(``mcore_npu.ops.batch_invariant``), whose invariance does not depend on PyTorch's fused kernel
(tests/ops/test_batch_invariant.py shows that kernel's bits change with the padded length).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from verl.workers.engine_workers import TrainingWorker

from mcore_npu.integrations.verl.engine import NPUMegatronEngineWithLMHead
from mcore_npu.transformer.attention import NPUFusionAttention
from mcore_npu.transformer.batch_invariant import BatchInvariantColumnParallelLinear
from mcore_npu.transformer.vocab_parallel import vocab_parallel_log_probs
from tests.integrations.conftest import engine_model, training_worker_config
from tests.integrations.verl_loop import npu_engine

pytestmark = pytest.mark.usefixtures("cpu_runtime")

TRUE_ON_POLICY = {"use_flash_attn_npu_batch_invariant": True, "batch_invariant_mode": True,
                  "use_batch_invariant_ops": True}  # fmt: skip
TARGET, OTHERS = 21, (9, 40)  # the sequence looked at; its neighbours are shorter and longer


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed))


TARGET_IDS = _ids(TARGET, 0)
OTHER_IDS = [_ids(n, 1 + i) for i, n in enumerate(OTHERS)]


def _engine(path: str, *, thd: bool, mode: bool):
    config = training_worker_config(
        path, remove_padding=thd, override_transformer_config=TRUE_ON_POLICY if mode else None
    )
    with npu_engine():
        engine = TrainingWorker(config).engine
    assert type(engine) is NPUMegatronEngineWithLMHead
    engine._build_tf_config()
    engine.module = engine._build_megatron_module()
    return engine


def _no_loss(model_output, data, dp_group=None):
    return torch.zeros(()), {}


def _log_probs(engine, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """verl's forward (``forward_backward_batch``, forward only) of one micro-batch: per row
    ``[n - 1]`` fp32, log p(token t+1)."""
    from verl.utils import tensordict_utils as tu

    tensors = {
        "input_ids": tu.nested_tensor_from_tensor_list(rows),
        "loss_mask": tu.nested_tensor_from_tensor_list([torch.ones_like(r) for r in rows]),
        "temperature": torch.ones(len(rows)),
    }
    meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": len(rows)}
    result = engine.forward_backward_batch(tu.get_tensordict(tensors, meta), _no_loss,
                                           forward_only=True)  # fmt: skip
    got = result["model_output"]["log_probs"].unbind()
    return [g[: len(r) - 1].float() for g, r in zip(got, rows, strict=True)]


def _placements(path: str, mode: bool) -> dict[str, torch.Tensor]:
    """The target's log-probs: alone, first and last in a thd batch, right-padded in bshd."""
    thd = _engine(path, thd=True, mode=mode)
    bshd = _engine(path, thd=False, mode=mode)
    attentions = [m for m in engine_model(thd).modules() if isinstance(m, NPUFusionAttention)]
    assert attentions and all(a.batch_invariant is mode for a in attentions)
    for engine in (thd, bshd):  # GPTModel's own output layer: made batch-invariant in the mode
        head = engine_model(engine).output_layer
        assert isinstance(head, BatchInvariantColumnParallelLinear) is mode
    short, long = OTHER_IDS
    return {
        "alone": _log_probs(thd, [TARGET_IDS])[0],
        "first in thd": _log_probs(thd, [TARGET_IDS, *OTHER_IDS])[0],
        "last in thd": _log_probs(thd, [long, short, TARGET_IDS])[-1],
        "right-padded in bshd": _log_probs(bshd, [long, TARGET_IDS, short])[1],
    }


def _transformers(path: str) -> torch.Tensor:
    """transformers in fp32 on the bf16-rounded weights: ``[n - 1]``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
        logits = model(input_ids=TARGET_IDS[None]).logits[0]
    return torch.log_softmax(logits, -1)[:-1].gather(-1, TARGET_IDS[1:, None])[:, 0]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def checkpoint(request):
    """``(family, path)`` of the tiny Qwen3 / Qwen3-MoE checkpoint."""
    return request.param, request.getfixturevalue(request.param)


def _differences(placements: dict) -> dict[str, float]:
    """Per placement other than alone: the largest difference from the target alone (0.0 only
    where the bits are equal; ``torch.equal`` decides)."""
    alone = placements["alone"]
    return {
        where: 0.0 if torch.equal(got, alone) else float((got - alone).abs().max())
        for where, got in placements.items()
        if where != "alone"
    }


def test_mode_on_a_sequences_log_probs_have_the_same_bits_wherever_it_sits(checkpoint, monkeypatch):
    _, path = checkpoint
    calls = []
    from mcore_npu.integrations.verl import batch_invariant

    def counted(*args, **kwargs):  # the engine's log-probs: the plugin's, once per micro-batch
        calls.append(kwargs["kernel"])
        return vocab_parallel_log_probs(*args, **kwargs)

    monkeypatch.setattr(batch_invariant, "vocab_parallel_log_probs", counted)
    placements = _placements(path, mode=True)
    assert calls == ["auto"] * len(placements)
    alone = placements["alone"]
    assert alone.shape == (TARGET - 1,) and torch.isfinite(alone).all()
    assert _differences(placements) == {"first in thd": 0.0, "last in thd": 0.0,
                                        "right-padded in bshd": 0.0}  # fmt: skip
    error = float((alone - _transformers(path)).abs().max())
    assert error < 0.1, f"max |log p - log p_transformers| = {error:.3f}"


def test_mode_off_packed_sequences_keep_their_bits_and_padding_does_not_always(checkpoint):
    """The regression test of the path without the mode: thd attends segment by segment, so the
    packed placements keep the bits; right padding changes the fused CPU attention's key blocks,
    and the MoE model's log-probs move by about 2e-4 (the dense model's bf16 rounding happens to
    hide it). This is the control: the same comparison the mode passes fails without it."""
    family, path = checkpoint
    placements = _placements(path, mode=False)
    differences = _differences(placements)
    assert differences["first in thd"] == differences["last in thd"] == 0.0
    padded = differences["right-padded in bshd"]
    if family == "qwen3_moe":
        assert padded > 0.0, "the fused CPU attention gave the padded row the same bits"
    error = float((placements["alone"] - _transformers(path)).abs().max())
    assert error < 0.1
