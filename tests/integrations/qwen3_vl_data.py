"""The tiny Qwen3-VL as verl's tests feed it: the checkpoint (tests/vision_hf/qwen3_vl_models.py's,
weights rounded to bf16 and saved fp32, a 160-token word-level tokenizer) and four rows (two
images of different grids; text only; one image; another) with their ``multi_modal_inputs``, as verl's
``forward_backward_batch`` and the SFT trainer's ``train_batch`` take them."""

from __future__ import annotations

import torch

from tests.integrations.conftest import _save_word_level_tokenizer
from tests.integrations.qwen3_5_models import IMAGE_IDS
from tests.vision_hf.qwen3_vl_models import (
    END,
    GRIDS,
    IMAGE,
    START,
    VOCAB,
    image_prompt,
    pixels,
    tiny_model,
)

ONE_IMAGE = ((1, 4, 6),)


def rows(tokens=(START, IMAGE, END)) -> tuple:
    """The four rows ``(ids, image grids, pixel seed)`` with ``tokens`` (vision start, image,
    vision end) as the checkpoint's config numbers them."""
    return (
        (image_prompt(GRIDS, tokens=tokens)[0], GRIDS, 2),
        (torch.tensor([5, 9, 11, 4, 7, 3, 8]), (), 0),
        (image_prompt(ONE_IMAGE, text=((7,), (3, 4)), tokens=tokens)[0], ONE_IMAGE, 5),
        (image_prompt(((1, 2, 8),), text=((12, 13, 14), (15,)), tokens=tokens)[0],
         ((1, 2, 8),), 7),
    )  # fmt: skip


ROWS = rows()
# the same rows in the ids of tests/integrations/qwen3_5_models.py's Qwen3.5 hub checkpoint
QWEN3_5_HUB_ROWS = rows(tuple(IMAGE_IDS[k] for k in ("vision_start_token_id", "image_token_id",
                                                     "vision_end_token_id")))  # fmt: skip


def family_rows(family: str) -> tuple:
    """The rows of ``family`` (``"qwen3_5_hub"``: :data:`QWEN3_5_HUB_ROWS`; else :data:`ROWS`)."""
    return QWEN3_5_HUB_ROWS if family == "qwen3_5_hub" else ROWS


def save_checkpoint(path, *, moe: bool = False) -> str:
    """The tiny Qwen3-VL (``moe``: Qwen3-VL-MoE), bf16-rounded weights saved fp32, and its
    tokenizer at ``path``."""
    model = tiny_model(moe=moe)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    model.save_pretrained(path, safe_serialization=True)
    _save_word_level_tokenizer(path, VOCAB)
    return str(path)


def image_batch(rows=ROWS):
    """``rows`` as nested tensors, images in ``multi_modal_inputs`` (one dict a row), one
    micro-batch. ``loss_mask`` is 0 on the first token (a one-token prompt): verl's SFT loss
    rolls it by one, so the last position, which has no next token, stays out of the loss."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    ids = [row for row, _, _ in rows]
    images = [
        NonTensorData(
            {"pixel_values": pixels(grids, seed), "image_grid_thw": torch.tensor(grids)}
            if grids
            else {}
        )
        for _, grids, seed in rows
    ]
    tensors = {
        "input_ids": tu.nested_tensor_from_tensor_list(ids),
        "loss_mask": tu.nested_tensor_from_tensor_list([_after_first(r) for r in ids]),
        "temperature": torch.ones(len(ids)),
    }
    meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": len(rows)}
    data = tu.get_tensordict(tensors, meta)
    data["multi_modal_inputs"] = NonTensorStack(*images)
    return data


def _after_first(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[0] = 0
    return mask


def train_batch(dp_rank: int = 0, dp_size: int = 1, rows=ROWS):
    """This data-parallel rank's share of ``rows`` (:func:`image_batch`) with the meta data
    verl's SFT trainer attaches for the whole global batch."""
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu

    share = len(rows) // dp_size
    data = image_batch(rows[dp_rank * share : (dp_rank + 1) * share])
    lengths = NonTensorData([len(ids) for ids, _, _ in rows])
    tu.assign_non_tensor(data, temperature=1.0, global_batch_size=len(rows),
                         pad_mode="no_padding", pad_token_id=0, update_lr_scheduler=True,
                         global_token_num=lengths)  # fmt: skip
    return data


def train(worker, steps: int, rows=ROWS) -> list[dict | None]:
    """``steps`` ``train_batch`` calls on the worker's data-parallel share of :func:`train_batch`:
    each one's metrics (None on ranks without outputs)."""
    from verl.utils import tensordict_utils as tu

    rank, size = worker.engine.get_data_parallel_rank(), worker.engine.get_data_parallel_size()
    outputs = [worker.train_batch(train_batch(rank, size, rows)) for _ in range(steps)]
    return [None if out is None else tu.get(out, "metrics") for out in outputs]
