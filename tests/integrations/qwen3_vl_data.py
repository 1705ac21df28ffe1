"""The tiny Qwen3-VL as verl's tests feed it: the checkpoint (tests/vision_hf/qwen3_vl_models.py's,
weights rounded to bf16 and saved fp32, a 160-token word-level tokenizer) and four rows (two
images of different grids; text only; one image; another) with their ``multi_modal_inputs``, as verl's
``forward_backward_batch`` and the SFT trainer's ``train_batch`` take them."""

from __future__ import annotations

import torch

from tests.integrations.conftest import _save_word_level_tokenizer
from tests.vision_hf.qwen3_vl_models import GRIDS, VOCAB, image_prompt, pixels, tiny_model

ONE_IMAGE = ((1, 4, 6),)
ROWS = (  # (ids, image grids, pixel seed)
    (image_prompt(GRIDS)[0], GRIDS, 2),
    (torch.tensor([5, 9, 11, 4, 7, 3, 8]), (), 0),
    (image_prompt(ONE_IMAGE, text=((7,), (3, 4)))[0], ONE_IMAGE, 5),
    (image_prompt(((1, 2, 8),), text=((12, 13, 14), (15,)))[0], ((1, 2, 8),), 7),
)


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


def train_batch(dp_rank: int = 0, dp_size: int = 1):
    """This data-parallel rank's share of :data:`ROWS` (:func:`image_batch`) with the meta data
    verl's SFT trainer attaches for the whole global batch."""
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu

    share = len(ROWS) // dp_size
    data = image_batch(ROWS[dp_rank * share : (dp_rank + 1) * share])
    lengths = NonTensorData([len(ids) for ids, _, _ in ROWS])
    tu.assign_non_tensor(data, temperature=1.0, global_batch_size=len(ROWS),
                         pad_mode="no_padding", pad_token_id=0, update_lr_scheduler=True,
                         global_token_num=lengths)  # fmt: skip
    return data


def train(worker, steps: int) -> list[dict | None]:
    """``steps`` ``train_batch`` calls on the worker's data-parallel share of :func:`train_batch`:
    each one's metrics (None on ranks without outputs)."""
    from verl.utils import tensordict_utils as tu

    rank, size = worker.engine.get_data_parallel_rank(), worker.engine.get_data_parallel_size()
    outputs = [worker.train_batch(train_batch(rank, size)) for _ in range(steps)]
    return [None if out is None else tu.get(out, "metrics") for out in outputs]
