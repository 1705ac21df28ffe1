"""The LM-head engine in batch-invariant (true on-policy) mode: the output layer and the log-probs.

The layers come batch-invariant from the spec (``batch_invariant=True``); two matmul-bearing
steps lie outside it. GPTModel builds its output layer itself: in the mode the engine makes that
one module a :class:`~mcore_npu.transformer.batch_invariant.BatchInvariantColumnParallelLinear`
(:func:`~mcore_npu.transformer.batch_invariant.make_batch_invariant`: a subclass adding no state,
the same parameters and names). verl computes log-probs with Megatron's vocab-parallel cross
entropy: in the mode the engine computes them with
:func:`~mcore_npu.transformer.vocab_parallel.vocab_parallel_log_probs` and lets verl compute the
rest (entropy, distillation) as before. The value-head engine is not changed: its values are
not compared with the rollout's. See docs/true_on_policy.md.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from verl.utils.megatron_utils import unwrap_model

from mcore_npu.transformer.batch_invariant import KERNEL, make_batch_invariant
from mcore_npu.transformer.vocab_parallel import vocab_parallel_log_probs

__all__ = ["BatchInvariantLMHead"]


class BatchInvariantLMHead:
    """The LM-head engine's output layer and log-probs in the mode (``npu_spec_keywords``'
    ``batch_invariant``); verl's own otherwise."""

    @property
    def batch_invariant_kernel(self) -> str | None:
        """The mode's matmul kernel, or None when the mode is off."""
        keywords = self.npu_spec_keywords
        return KERNEL[keywords.get("kernel", "auto")] if keywords.get("batch_invariant") else None

    def _build_megatron_module(self):
        module = super()._build_megatron_module()
        if self.batch_invariant_kernel is not None:
            for chunk in module:
                model = unwrap_model(chunk)
                if getattr(model, "post_process", False):
                    make_batch_invariant(model.output_layer, self.batch_invariant_kernel)
        return module

    def _lm_head_logits_processor(self, logits, label, temperature, *, distillation_only, **kw):
        if self.batch_invariant_kernel is None or distillation_only:  # no log-probs asked for
            return super()._lm_head_logits_processor(
                logits, label, temperature, distillation_only=distillation_only, **kw
            )
        # before verl's in-place temperature division and entropy: a scaled copy of the logits
        positive = torch.where(temperature > 0, temperature, torch.full_like(temperature, 1e-8))
        scaled = logits / positive.unsqueeze(-1).to(logits.dtype)
        tp = parallel_state.get_tensor_model_parallel_group()
        log_probs = vocab_parallel_log_probs(
            scaled, label, group=tp if tp.size() > 1 else None, kernel=self.batch_invariant_kernel
        )
        ret = super()._lm_head_logits_processor(
            logits, label, temperature, distillation_only=True, **kw
        )
        return {**ret, "log_probs": log_probs}
