"""``torchrun --nproc-per-node=2 -m tests.dsa_hf.tp_export <checkpoint>``: a tiny DSA checkpoint
(GLM-5 or DeepSeek-V3.2) loaded at TP = 2 with sequence parallelism through the plugin's bridge
and exported back; rank 0 prints ``TP_EXPORT <tensors> <names equal> <all torch.equal>`` against
the checkpoint's safetensors, and ``TP_LOGITS <max |logit diff|>`` against ``tp1_logits.pt``
(the file the test wrote, TP = 1), through ``tests/bridge_tp2.py``."""

from __future__ import annotations

import sys

from tests.bridge_tp2 import check
from tests.hf_model_checks import CPU_ARGS, tp1_ids_logits

if __name__ == "__main__":
    check(sys.argv[1], CPU_ARGS, tp1_ids_logits)
