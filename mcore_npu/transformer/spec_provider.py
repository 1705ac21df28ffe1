"""``NPUSpecProvider``: this package's modules for Megatron's ``*_for_backend`` spec builders.

Megatron-Core builds MLP, MoE and multi-token-prediction specs from a ``BackendSpecProvider``
(``megatron/core/models/backends.py``): ``get_mlp_module_spec_for_backend``,
``get_moe_module_spec_for_backend``, ``get_mtp_layer_spec_for_backend``. This provider answers
with the NPU spec's modules in either parameter layout:

| slot | ``param_layout="te"`` | ``"local"`` |
|---|---|---|
| ``core_attention()`` | ``TELayoutNPUFusionAttention`` | ``NPUFusionAttention`` |
| ``layer_norm()`` | ``SequenceParallelNorm`` (with ``_extra_state``) | ``SequenceParallelNorm`` |
| ``fuse_layernorm_and_linear()`` | True | False |
| ``column_parallel_layer_norm_linear()`` | ``NormColumnParallelLinear`` | None |
| ``dense_mlp(mlp)`` / ``experts(...)`` / ``shared_experts(...)`` | ``NPUMLP`` / ``NPUGroupedMLP`` / ``NPUSharedExpertMLP`` | the same |
| linears | Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` | the same |
| ``grouped_mlp_modules(False)`` | ``SequentialMLP`` of those linears | the same |
| ``activation_func()`` | None (the MLP applies ``config.activation_func``) | the same |

Core attention, norms and the fused norm-linear are returned as ``ModuleSpec`` s (they carry
``kernel``, the shared cu_seqlens memo, ``extra_state``); Megatron's ``build_module`` takes a
spec wherever a class goes. The fused operators (``npu_rms_norm`` in every RMSNorm,
``npu_swiglu`` in the MLPs, ``npu_grouped_matmul`` in the experts) follow ``kernel`` unless
``rms_norm_kernel`` / ``swiglu_kernel`` / ``grouped_matmul_kernel`` say otherwise; ``"off"``
keeps Megatron's own module for that part. ``rope_kernel`` (default ``"off"``: Megatron's own
RoPE; None = ``kernel``) puts ``NPURotarySelfAttention`` (``npu_rotary_mul``) in the
``self_attention`` slot (``self_attention(spec)``), sharing one cos/sin cache per provider;
with ``"off"`` the slot holds ``NPUSelfAttention`` (Megatron's, its output gate eager).
Multi-latent attention layers get ``NPUMLASelfAttention`` (``mla_self_attention(spec)``, fused
RoPE on the rope slice with ``rope_kernel``); ``mla_value_padding`` reaches every core attention.
The experts' form follows the installed protocol (``megatron_features``: ``experts_builder``).
"""

from __future__ import annotations

import functools

from megatron.core.models.backends import BackendSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_npu.masks import SeqLengthsMemo
from mcore_npu.ops import value_padding
from mcore_npu.ops.registry import KERNELS, check_kernel
from mcore_npu.transformer import megatron_features
from mcore_npu.transformer.attention import NPUFusionAttention, TELayoutNPUFusionAttention
from mcore_npu.transformer.backends import PARAM_LAYOUTS
from mcore_npu.transformer.experts import NPUGroupedMLP
from mcore_npu.transformer.mla import NPUMLASelfAttention
from mcore_npu.transformer.mlp import NPUMLP, NPUSharedExpertMLP
from mcore_npu.transformer.norm_linear import NormColumnParallelLinear
from mcore_npu.transformer.norms import SequenceParallelNorm
from mcore_npu.transformer.rope import NPURotarySelfAttention, RopeCosSinCache
from mcore_npu.transformer.self_attention import NPUSelfAttention

FUSED_KERNELS = (*KERNELS, "off")
"""Values of ``rms_norm_kernel`` / ``swiglu_kernel`` / ``grouped_matmul_kernel`` /
``rope_kernel``; None = ``kernel``."""


class NPUSpecProvider(BackendSpecProvider):
    """The NPU spec's modules for Megatron's ``BackendSpecProvider`` slots.

    Args:
        kernel: the attention kernel (``"auto"`` | ``"torch_npu"`` | ``"reference"``), and the
            fused operators' unless given below.
        param_layout: ``"te"`` (Transformer Engine names) | ``"local"``.
        seq_lengths_memo: shared by every attention built from this provider; a new one if None.
        rms_norm_kernel, swiglu_kernel, grouped_matmul_kernel: a kernel for that fused
            operator, ``"off"`` for Megatron's own module, None (default) = ``kernel``.
        moe_permute_kernel: the fused MoE token permute in the alltoall / allgather
            dispatchers (``NPUMoELayer``); ``"off"`` (the default, as Megatron's
            ``moe_permute_fusion=False``) keeps Megatron's ``MoELayer``, None = ``kernel``.
        rope_kernel: fused RoPE (``npu_rotary_mul``) in self-attention; ``"off"`` (default, as
            Megatron's ``apply_rope_fusion=False``) = Megatron's own RoPE, None = ``kernel``.
        mla_value_padding: ``"auto"`` | ``"on"`` | ``"off"``: whether multi-latent attention's
            smaller value head (Dv < D) is padded to D for the operator
            (``mcore_npu.ops.value_padding``; auto: where the installed torch_npu needs it).
    """

    def __init__(
        self,
        *,
        kernel: str = "auto",
        param_layout: str = "te",
        seq_lengths_memo: SeqLengthsMemo | None = None,
        rms_norm_kernel: str | None = None,
        swiglu_kernel: str | None = None,
        grouped_matmul_kernel: str | None = None,
        moe_permute_kernel: str | None = "off",
        rope_kernel: str | None = "off",
        mla_value_padding: str = "auto",
    ):
        if param_layout not in PARAM_LAYOUTS:
            raise ValueError(
                f"param_layout: unknown layout {param_layout!r}; pass one of "
                f"{', '.join(PARAM_LAYOUTS)}"
            )
        check_kernel(kernel)
        fused = {"rms_norm": rms_norm_kernel, "swiglu": swiglu_kernel,
                 "grouped_matmul": grouped_matmul_kernel, "rope": rope_kernel,
                 "moe_permute": moe_permute_kernel}  # fmt: skip
        self.fused = {name: _fused_kernel(name, value, kernel) for name, value in fused.items()}
        self.rope_cache = RopeCosSinCache()  # cos/sin once per step for every layer
        self.mla_value_padding = value_padding.check_mode(mla_value_padding)
        self.kernel = kernel
        self.param_layout = param_layout
        self.seq_lengths_memo = (
            seq_lengths_memo if seq_lengths_memo is not None else SeqLengthsMemo()
        )

    @property
    def te_layout(self) -> bool:
        return self.param_layout == "te"

    def linear(self) -> type:
        """A plain (not fused) linear, as the local spec uses for MLA's down projections."""
        return ColumnParallelLinear

    def column_parallel_linear(self) -> type:
        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return self.te_layout

    def column_parallel_layer_norm_linear(self) -> ModuleSpec | None:
        if not self.te_layout:
            return None
        return ModuleSpec(
            module=NormColumnParallelLinear, params={"norm_kernel": self._on("rms_norm")}
        )

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> ModuleSpec:
        """``config.normalization`` decides LayerNorm / RMSNorm (``rms_norm`` is not needed)."""
        params = {"extra_state": self.te_layout, "kernel": self._on("rms_norm")}
        return ModuleSpec(module=SequenceParallelNorm, params=params)

    def dense_mlp(self, mlp: ModuleSpec) -> ModuleSpec:
        """Megatron's ``MLP`` spec with its SwiGLU through ``npu_swiglu`` (unless ``"off"``)."""
        if self._on("swiglu") is None:
            return mlp
        params = {**mlp.params, "kernel": self._on("swiglu")}
        return ModuleSpec(module=NPUMLP, params=params, submodules=mlp.submodules)

    def shared_experts(self, shared: ModuleSpec) -> ModuleSpec:
        """``SharedExpertMLP`` spec -> ``NPUSharedExpertMLP`` (same names; ``npu_swiglu``)."""
        if self._on("swiglu") is None:
            return shared
        params = {**shared.params, "kernel": self._on("swiglu")}
        return ModuleSpec(module=NPUSharedExpertMLP, params=params, submodules=shared.submodules)

    def experts(self, experts: ModuleSpec, grouped_gemm: bool) -> ModuleSpec:
        """The routed experts as ``NPUGroupedMLP`` (one ``npu_grouped_matmul`` per projection).

        Names follow the spec Megatron would build for the same arguments: ``SequentialMLP``'s
        (``local_experts.{e}.linear_fc1.weight``) without grouped GEMM, in both layouts; with
        ``moe_grouped_gemm=True`` in the te layout ``TEGroupedMLP``'s (``linear_fc1.weight{e}``).
        In the local layout a grouped-GEMM slot keeps Megatron's own ``GroupedMLP``.
        """
        kernel = self._on("grouped_matmul")
        if kernel is None or (grouped_gemm and not self.te_layout):
            if grouped_gemm and self.te_layout:
                raise ValueError(
                    "grouped_matmul_kernel: 'off' with moe_grouped_gemm=True in the te layout "
                    "would need TE's TEGroupedMLP; turn the grouped matmul on, or pass "
                    "moe_grouped_gemm=False (SequentialMLP names)"
                )
            return experts
        names = "te" if grouped_gemm else "local"
        params = {"kernel": kernel, "param_layout": names}
        return ModuleSpec(module=NPUGroupedMLP, params=params, submodules=experts.submodules)

    def moe_layer(self, moe: ModuleSpec) -> ModuleSpec:
        """Megatron's ``MoELayer`` spec -> ``NPUMoELayer`` (fused permute) unless ``"off"``."""
        kernel = self._on("moe_permute")
        if kernel is None:
            return moe
        from mcore_npu.transformer.token_permute import NPUMoELayer

        params = {**moe.params, "permute_kernel": kernel}
        return ModuleSpec(module=NPUMoELayer, params=params, submodules=moe.submodules)

    def _on(self, operator: str) -> str | None:
        """The kernel of a fused operator, or None when it is ``"off"``."""
        kernel = self.fused[operator]
        return None if kernel == "off" else kernel

    def self_attention(self, attention: ModuleSpec) -> ModuleSpec:
        """Megatron's ``SelfAttention`` spec -> ``NPURotarySelfAttention`` (fused RoPE), or
        ``NPUSelfAttention`` with ``rope_kernel="off"``; both compute ``attention_output_gate``
        eagerly (``mcore_npu.transformer.self_attention``)."""
        kernel = self._on("rope")
        if kernel is None:
            return ModuleSpec(module=NPUSelfAttention, params=dict(attention.params),
                              submodules=attention.submodules)  # fmt: skip
        params = {**attention.params, "rope_kernel": kernel, "rope_cache": self.rope_cache,
                  "seq_lengths_memo": self.seq_lengths_memo}  # fmt: skip
        return ModuleSpec(module=NPURotarySelfAttention, params=params,
                          submodules=attention.submodules)  # fmt: skip

    def mla_self_attention(self, attention: ModuleSpec) -> ModuleSpec:
        """Megatron's ``MLASelfAttention`` spec -> ``NPUMLASelfAttention`` (buildable without
        TE; ``rope_kernel`` on the rope slice unless ``"off"``)."""
        params = {**attention.params, "rope_kernel": self._on("rope"),
                  "seq_lengths_memo": self.seq_lengths_memo}  # fmt: skip
        return ModuleSpec(module=NPUMLASelfAttention, params=params,
                          submodules=attention.submodules)  # fmt: skip

    def core_attention(self) -> ModuleSpec:
        module = TELayoutNPUFusionAttention if self.te_layout else NPUFusionAttention
        params = {"kernel": self.kernel, "seq_lengths_memo": self.seq_lengths_memo,
                  "value_padding": self.mla_value_padding}  # fmt: skip
        return ModuleSpec(module=module, params=params)

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool,
                            moe_use_legacy_grouped_gemm: bool = False):  # fmt: skip
        """``SequentialMLP`` of the column/row-parallel linears (the same names in both layouts),
        in the form the installed Megatron's builders take: ``(SequentialMLP, MLPSubmodules)``
        where its protocol has ``moe_use_legacy_grouped_gemm`` (<= 0.16), else the
        ``functools.partial(SequentialMLP, submodules=...)`` it builds experts from (0.17+,
        one argument).

        Raises:
            ValueError: ``moe_use_grouped_gemm=True`` (no torch twin of TE's grouped linears).
        """
        from megatron.core.transformer.moe.experts import SequentialMLP

        if moe_use_grouped_gemm:
            raise ValueError(
                "moe_grouped_gemm: NPUSpecProvider has no grouped experts; pass "
                "moe_grouped_gemm=False (SequentialMLP)"
            )
        submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        if megatron_features.has("experts_builder"):
            return functools.partial(SequentialMLP, submodules=submodules)
        return SequentialMLP, submodules

    def activation_func(self) -> None:
        return None


def _fused_kernel(name: str, value: str | None, kernel: str) -> str:
    value = kernel if value is None else value
    if value not in FUSED_KERNELS:
        raise ValueError(
            f"{name}_kernel: unknown value {value!r}; pass one of {', '.join(FUSED_KERNELS)} "
            "or None (= kernel)"
        )
    return value
