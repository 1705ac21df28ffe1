"""What the engine tests feed verl's engine and what they compare its log-probs with.

``packed_batch``: the seeded rows as verl's ``forward_backward_batch`` takes them (nested
tensors, thd); ``mean_negative_log_prob``: a loss of verl's signature; ``hf_log_probs``: the
same rows through ``transformers``, fp32 compute on the bf16-rounded weights.
"""

from __future__ import annotations

import torch

from tests.integrations.conftest import VOCAB


def packed_batch(lengths: tuple[int, ...]):
    """``(TensorDict, ids)``: one row of ``n`` seeded tokens per length (``ids[i]``: ``[n]``),
    every position in the loss (``loss_mask`` all ones), temperature 1, one micro-batch."""
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    tensors = {
        "input_ids": tu.nested_tensor_from_tensor_list(ids),
        "loss_mask": tu.nested_tensor_from_tensor_list(
            [torch.ones(n, dtype=torch.int64) for n in lengths]
        ),
        "temperature": torch.ones(len(lengths)),
    }
    meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": len(lengths)}
    return tu.get_tensordict(tensors, meta), ids


def mean_negative_log_prob(model_output, data, dp_group=None):
    """The loss verl calls per micro-batch: the mean of -log p over every real position."""
    log_probs = model_output["log_probs"]
    values = log_probs.values() if log_probs.is_nested else log_probs
    return -values.float().mean(), {}


def hf_log_probs(
    path: str, lengths: tuple[int, ...], model_class=None, **config
) -> list[torch.Tensor]:
    """``transformers`` (``model_class``, default ``AutoModelForCausalLM``) in fp32 on the
    bf16-rounded weights, one row of :func:`packed_batch` at a time: ``[n - 1]`` each,
    log p(token t+1). ``config``: config fields ``from_pretrained`` overrides."""
    import transformers

    model_class = model_class or transformers.AutoModelForCausalLM
    model = model_class.from_pretrained(path, dtype=torch.float32, **config).eval()
    _, ids = packed_batch(lengths)
    out = []
    with torch.no_grad():
        # parameters only: buffers (RoPE's inv_freq, DeepSeek-V3's expert bias) stay fp32
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
        for row in ids:
            logits = model(input_ids=row.unsqueeze(0)).logits[0].float()
            log_probs = torch.log_softmax(logits, -1)[:-1].gather(-1, row[1:].unsqueeze(-1))
            out.append(log_probs[:, 0])
    return out


def infer_log_probs(worker, ids: torch.Tensor) -> torch.Tensor:
    """``[S]``: verl's ``infer_batch`` log-probs of one sequence (``compute_loss=False``); the
    last position has no next token (its value is the engine's, not a prediction)."""
    from verl.utils import tensordict_utils as tu

    data = tu.get_tensordict(
        {"input_ids": tu.nested_tensor_from_tensor_list([ids]),
         "loss_mask": tu.nested_tensor_from_tensor_list([torch.ones_like(ids)])},
        {"temperature": 1.0, "compute_loss": False, "micro_batch_size_per_gpu": 1},
    )  # fmt: skip
    (row,) = tu.get(worker.infer_batch(data), "log_probs").unbind()
    return row.float()
