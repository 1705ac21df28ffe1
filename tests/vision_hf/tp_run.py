"""``torchrun --nproc-per-node=2 -m tests.vision_hf.tp_run <checkpoint>``: the tiny Qwen3-VL at
TP = 2 (sequence parallel, as mbridge sets it) through the plugin's bridge, with two images and
deepstack (``tests/bridge_tp2.py`` prints what the test reads)."""

from __future__ import annotations

import sys

import torch

from tests.bridge_tp2 import check
from tests.vision_hf.qwen3_vl_models import CPU_ARGS, EVEN_TEXT, GRIDS, image_prompt, pixels


def logits(model):
    return model(image_prompt(GRIDS, EVEN_TEXT), pixel_values=pixels(GRIDS),
                 image_grid_thw=torch.tensor(GRIDS))  # fmt: skip


if __name__ == "__main__":
    check(sys.argv[1], CPU_ARGS, logits)
