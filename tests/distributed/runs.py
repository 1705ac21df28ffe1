"""What the one-process reference run and every parallel run of ``gpt_tiny.yaml`` share.

6 steps of 4 samples of 128 tokens in micro-batches of 1: 4 micro-batches per step in one
process, 2 per rank under DP=2, 4 per rank under TP/CP (DP=1). Every run starts from the same
step-0 checkpoint (``train.init_from``): Megatron initialises each pipeline stage from the seed
independently, so a 2-stage model does not start from the weights of a 1-stage one unless both
load them.
"""

STEPS = 6
BATCH = ["train.micro_batch_size=1", "train.global_batch_size=4", f"train.steps={STEPS}"]
