"""``NPUHybridStack``: the installed Megatron's hybrid stack (``HybridStack`` from 0.18,
``MambaStack`` before) with its final norm from the spec instead of the hard-coded ``TENorm``.

Megatron's own constructor builds the stack with ``post_layer_norm=False`` (so no ``TENorm``);
the final norm is then built from ``final_norm`` under Megatron's name, ``final_norm``, and the
stack's forward applies it as before. Nothing of Megatron's is patched."""

from __future__ import annotations

from megatron.core.transformer.spec_utils import build_module

from mcore_npu.transformer import megatron_features

if megatron_features.has("hybrid_model"):
    from megatron.core.models.hybrid.hybrid_block import HybridStack as _Stack
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules as StackSubmodules
else:
    from megatron.core.ssm.mamba_block import MambaStack as _Stack
    from megatron.core.ssm.mamba_block import MambaStackSubmodules as StackSubmodules

__all__ = ["NPUHybridStack", "StackSubmodules", "hybrid_model_class"]


class NPUHybridStack(_Stack):
    """The installed hybrid stack whose ``final_norm`` is built from the ``final_norm`` spec."""

    def __init__(self, config, submodules, *args, final_norm=None, post_layer_norm=True, **kwargs):
        if final_norm is None:
            raise ValueError(
                "final_norm: None; NPUHybridStack builds its final norm from this spec (Megatron's "
                "is TENorm): build the stack spec with get_hybrid_stack_npu_spec()"
            )
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(
                final_norm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )


def hybrid_model_class():
    """``(class, spec keyword, pattern keyword)`` of the installed Megatron's hybrid model:
    ``HybridModel`` (0.18+) or ``MambaModel``."""
    if megatron_features.has("hybrid_model"):
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel, "hybrid_stack_spec", "hybrid_layer_pattern"
    from megatron.core.models.mamba.mamba_model import MambaModel

    return MambaModel, "mamba_stack_spec", "hybrid_override_pattern"
