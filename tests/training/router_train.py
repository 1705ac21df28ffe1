"""Test-only entry point: the real trainer, printing what Megatron's expert-bias update saw.

    python -m tests.training.router_train --config ... overrides

After the model is built: ``mtp layers: K``. After every optimizer step, one line
``router step N: {json}``: for each router with an expert bias (module name), the token counts
``local_tokens_per_expert`` and ``expert_bias`` as ``finalize_model_grads`` receives them, and
``expert_bias`` after the step; and ``mtp step N: [loss, ...]``, each MTP layer's loss averaged
over the step's micro-batches (Megatron's ``MTPLossLoggingHelper`` tracker, cleared after). The counts are read by a wrapper that then calls the trainer's
own ``config.finalize_model_grads_func`` (Megatron's ``finalize_model_grads``) unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys

from mcore_npu.training import train


class RouterTrainer(train.Trainer):
    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        from megatron.core.utils import unwrap_model

        model = unwrap_model(self.model)
        self._routers = {name: module for name, module in model.named_modules()
                         if getattr(module, "expert_bias", None) is not None}  # fmt: skip
        print(f"mtp layers: {len(model.mtp.layers) if model.mtp_process else 0}", flush=True)
        finalize, self._seen = self.config.finalize_model_grads_func, {}

        def recording_finalize(*args, **kwargs):
            self._seen = {name: (router.local_tokens_per_expert.tolist(),
                                 router.expert_bias.tolist())
                          for name, router in self._routers.items()}  # fmt: skip
            return finalize(*args, **kwargs)

        self.config.finalize_model_grads_func = recording_finalize

    def train_step(self):
        result = super().train_step()
        line = {name: {"counts": counts, "before": before,
                       "after": self._routers[name].expert_bias.tolist()}
                for name, (counts, before) in self._seen.items()}  # fmt: skip
        print(f"router step {result.step}: {json.dumps(line)}", flush=True)
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker  # key "values" (<= 0.18), "loss_values" (0.19+)
        values = tracker.get("values", tracker.get("loss_values"))
        if values is not None:
            t = self.cfg.train
            micro_batches = t.global_batch_size // t.micro_batch_size
            print(f"mtp step {result.step}: {(values / micro_batches).tolist()}", flush=True)
            # clean_loss_in_tracker (<= 0.18) / clean_metrics_in_tracker (0.19+)
            clean = getattr(MTPLossLoggingHelper, "clean_loss_in_tracker", None)
            (clean or MTPLossLoggingHelper.clean_metrics_in_tracker)()
        return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    sys.exit(train.run(parser.parse_args(), trainer_class=RouterTrainer))
