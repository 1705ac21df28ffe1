"""Megatron's dense ``MLP`` with ``npu_swiglu`` as the SwiGLU activation.

When the config's activation is exactly what ``npu_swiglu`` computes (``is_plain_swiglu``),
``NPUMLP.forward`` is::

    x [S, B, H] --fc1--> [S, B, 2F] (+ fc1 bias) --npu_swiglu--> [S, B, F]
      (* per_token_scale) --fc2--> [S, B, H]

(the fc1 bias first, as Megatron's ``bias_swiglu_impl``); any other activation runs Megatron's
``MLP.forward``. Parameter names are ``MLP``'s. ``NPUSharedExpertMLP`` does the same for the shared
experts, also on their overlapped path (``linear_fc1_forward_and_act``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from mcore_npu.ops import swiglu
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer import megatron_features


def is_plain_swiglu(config) -> bool:
    """SwiGLU exactly as ``npu_swiglu`` computes it: silu(first half) * second half."""
    return (
        bool(config.gated_linear_unit)
        and config.activation_func is F.silu
        and getattr(config, "activation_func_clamp_value", None) is None
        and not getattr(config, "glu_linear_offset", 0.0)
        and not getattr(config, "use_te_activation_func", False)
    )


class NPUMLP(MLP):
    """``MLP`` whose SwiGLU runs through ``mcore_npu.ops.swiglu``."""

    def __init__(
        self,
        config,
        submodules,
        *args,
        kernel: str = "auto",
        pg_collection=None,
        is_mtp_layer: bool = False,
        **kwargs,
    ) -> None:
        """``pg_collection`` / ``is_mtp_layer`` / ``name``: what megatron-core 0.18+'s
        ``TransformerLayer`` passes when it calls the slot: the MLP runs on ``pg_collection.tp``
        unless ``tp_group`` is given."""
        check_kernel(kernel)
        del is_mtp_layer  # as Megatron's as_mlp_submodule: no difference for a dense MLP
        if pg_collection is not None:
            kwargs.setdefault("tp_group", pg_collection.tp)
        if not megatron_features.has("mlp_takes_name"):
            kwargs.pop("name", None)  # megatron-core <= 0.17
        if not args and not kwargs.get("is_expert", False):
            kwargs.setdefault("ffn_hidden_size", config.ffn_hidden_size)  # the dense MLP's width
        super().__init__(config, submodules, *args, **kwargs)
        self.kernel = kernel

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        """``(output [S, B, H], output_bias [H] or None)``, as ``MLP.forward``."""
        if not is_plain_swiglu(self.config):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)  # [S, B, 2F/tp]
        if bias is not None:
            intermediate = intermediate + bias
        intermediate = swiglu(intermediate, -1, kernel=self.kernel)  # [S, B, F/tp]
        if per_token_scale is not None:
            dtype = intermediate.dtype
            intermediate = (intermediate * per_token_scale.unsqueeze(-1)).to(dtype)
        output, output_bias = self.linear_fc2(intermediate)
        if per_token_scale is not None and output_bias is not None:
            output = output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
            output_bias = None
        return output, output_bias


def _steps_overlap_state(method):
    """``method`` under megatron-core 0.18+'s ``overlap_state_check`` (PRE_FORWARD_COMM_DONE ->
    FC1_FORWARD_DONE), as Megatron decorates ``linear_fc1_forward_and_act``; else ``method`` itself.
    """
    from megatron.core.transformer.moe import shared_experts

    if not megatron_features.has("shared_expert_overlap_state"):
        return method
    states = shared_experts.SharedExpertState
    check = shared_experts.overlap_state_check
    return check(states.PRE_FORWARD_COMM_DONE, states.FC1_FORWARD_DONE)(method)


class NPUSharedExpertMLP(SharedExpertMLP, NPUMLP):
    """Megatron's ``SharedExpertMLP`` (gate, overlap, names unchanged) whose MLP part is
    :class:`NPUMLP` (by the method order)."""

    def __init__(self, *args, kernel: str = "auto", **kwargs) -> None:
        config = kwargs.get("config", args[0] if args else None)
        if getattr(config, "use_grouped_gemm_for_shared_expert", False):
            raise ValueError(
                "use_grouped_gemm_for_shared_expert=True: megatron-core's FusedSharedExpertMLP "
                "needs Transformer Engine's grouped linears, which NPUSharedExpertMLP does not "
                "have; set it False, or pass swiglu_kernel='off' to keep Megatron's shared experts"
            )
        super().__init__(*args, **kwargs)
        self.kernel = check_kernel(kernel)

    def linear_fc1_forward_and_act(self, overlapped_comm_output=None):
        """The overlapped path's fc1 and SwiGLU through ``mcore_npu.ops.swiglu`` (Megatron's runs a
        ``torch.compile``'d function): cached fc1 input ``[S, B, H]`` -> cached fc2 input
        ``[S, B, F/tp]``. Other activations: Megatron's."""
        if not is_plain_swiglu(self.config):
            return super().linear_fc1_forward_and_act(overlapped_comm_output)
        return self._fc1_and_swiglu(overlapped_comm_output)

    @_steps_overlap_state
    def _fc1_and_swiglu(self, overlapped_comm_output):
        from megatron.core.transformer.moe.shared_experts import set_tensor_grad_fn_sequence_sr

        assert self.config.moe_shared_expert_overlap and self.cached_fc1_input is not None
        if overlapped_comm_output is not None:
            set_tensor_grad_fn_sequence_sr(overlapped_comm_output, torch.iinfo(torch.int).max)
        with torch.cuda.stream(self.stream):
            intermediate, bias = self.linear_fc1(self.cached_fc1_input)  # [S, B, 2F/tp]
            self.cached_fc1_input = None
            if bias is not None:
                intermediate = intermediate + bias
            self.cached_fc2_input = swiglu(intermediate, -1, kernel=self.kernel)
