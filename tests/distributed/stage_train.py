"""Test-only entry point: the real trainer, each pipeline stage printing the layers it built.

    torchrun --standalone --nproc-per-node 4 -m tests.distributed.stage_train --config ...

Prints ``pipeline stage R: decoder layers [n, ...]`` (Megatron's 1-based ``layer_number`` s) once
per rank after the model is built, so a test can see where the layers went.
"""

from __future__ import annotations

import argparse
import sys

from mcore_npu.training import train


class StageTrainer(train.Trainer):
    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        from megatron.core import parallel_state
        from megatron.core.utils import unwrap_model

        model = unwrap_model(self.model)
        numbers = [layer.layer_number for layer in model.decoder.layers]
        rank = parallel_state.get_pipeline_model_parallel_rank()
        print(f"pipeline stage {rank}: decoder layers {numbers}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    sys.exit(train.run(parser.parse_args(), trainer_class=StageTrainer))
