"""``NPUSpecProvider``: this package's modules for Megatron's ``*_for_backend`` spec builders.

A Megatron ``BackendSpecProvider`` (``get_mlp_module_spec_for_backend``,
``get_moe_module_spec_for_backend``, ``get_mtp_layer_spec_for_backend``) answering with the NPU
spec's modules: core attention (``TELayoutNPUFusionAttention`` in the te layout, else
``NPUFusionAttention``), ``SequenceParallelNorm``, ``NormColumnParallelLinear`` (te only),
``NPUMLP`` / ``NPUGroupedMLP`` / ``NPUSharedExpertMLP``, Megatron's column/row-parallel linears, and
the self-attention classes. Parts that carry ``kernel``, the shared cu_seqlens memo or
``extra_state`` are returned as ``ModuleSpec`` s. A fused operator's kernel ``"off"`` keeps
Megatron's module for that part. See docs/specs.md."""

from __future__ import annotations

import copy
import dataclasses
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
from mcore_npu.transformer.backends import check_param_layout
from mcore_npu.transformer.dsa import SPEC_KEYWORDS as DSA_SPEC_KEYWORDS
from mcore_npu.transformer.dsa import NPUDSASelfAttention, NPUSparseAttention
from mcore_npu.transformer.dsa.settings import check_spec_keywords as check_dsa_keywords
from mcore_npu.transformer.dsa.share import TopKShare
from mcore_npu.transformer.experts import NPUGroupedMLP
from mcore_npu.transformer.mla import NPUMLASelfAttention
from mcore_npu.transformer.mlp import NPUMLP, NPUSharedExpertMLP
from mcore_npu.transformer.norm_linear import NormColumnParallelLinear
from mcore_npu.transformer.norms import SequenceParallelNorm, check_epsilon
from mcore_npu.transformer.rope import NPURotarySelfAttention, RopeCosSinCache
from mcore_npu.transformer.self_attention import NPUSelfAttention

DSA_KERNELS = ("lightning_indexer_kernel", "sparse_attention_kernel", "indexer_loss_kernel")
FUSED_KERNELS = (*KERNELS, "off")
"""Values of the fused operators' kernels (``rms_norm_kernel``, ...); None = ``kernel``."""


@dataclasses.dataclass(frozen=True)
class NPUSpecOptions:
    """The NPU spec's own keywords, beside Megatron's, checked once (here, ValueError naming the
    keyword); the spec builders and :class:`NPUSpecProvider` take them.

    kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"``: attention, and the fused operators
        unless given below. param_layout: ``"te"`` | ``"local"`` parameter names.
    rms_norm_kernel, swiglu_kernel, grouped_matmul_kernel: ``"off"`` = Megatron's own module,
        None = ``kernel``. moe_permute_kernel, rope_kernel: the fused MoE permute
        (``NPUMoELayer``) and RoPE; ``"off"`` (default) = Megatron's, None = ``kernel``.
    mla_value_padding: ``"auto"`` | ``"on"`` | ``"off"``: pad MLA's smaller value head to D.
    batch_invariant: batch-invariant (true on-policy) mode: core attention through
        ``mcore_npu.ops.batch_invariant_attention``, the mode's limits checked when a layer is
        built (docs/true_on_policy.md).
    mla_latent_norm_epsilon: MLA's (and DSA's) q / kv latent norms' epsilon; None =
        ``layernorm_epsilon`` (the DeepSeek-V3 family's and GLM-5's checkpoints: 1e-6 whatever
        ``rms_norm_eps`` says, docs/hf_weights.md).
    dsa_indexer_rope_interleaved, dsa_indexer_k_norm_epsilon: DSA layers' indexer RoPE on
        interleaved pairs (GLM-5) or halves, and its key norm's epsilon; None = the config's
        0.19 field, else False / ``layernorm_epsilon`` (docs/dsa.md).
    dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset: DSA layers' top-k sharing (GLM-5's
        ``shared`` layers); None = the config's 0.19 field, else 1 / 0.
    lightning_indexer_kernel, sparse_attention_kernel, indexer_loss_kernel: DSA layers'
        operators (``lightning_indexer``, ``sparse_flash_attention``, the indexer KL loss);
        None = ``kernel``.
    """

    kernel: str = "auto"
    param_layout: str = "te"
    rms_norm_kernel: str | None = None
    swiglu_kernel: str | None = None
    grouped_matmul_kernel: str | None = None
    moe_permute_kernel: str | None = "off"
    rope_kernel: str | None = "off"
    mla_value_padding: str = "auto"
    batch_invariant: bool = False
    mla_latent_norm_epsilon: float | None = None
    dsa_indexer_rope_interleaved: bool | None = None
    dsa_indexer_k_norm_epsilon: float | None = None
    dsa_indexer_topk_freq: int | None = None
    dsa_indexer_skip_topk_offset: int | None = None
    lightning_indexer_kernel: str | None = None
    sparse_attention_kernel: str | None = None
    indexer_loss_kernel: str | None = None

    def __post_init__(self) -> None:
        check_param_layout(self.param_layout)
        check_kernel(self.kernel)
        for name in DSA_KERNELS:
            if getattr(self, name) is not None:
                check_kernel(getattr(self, name), what=name)
        check_dsa_keywords(*(getattr(self, name) for name in DSA_SPEC_KEYWORDS))
        check_epsilon("mla_latent_norm_epsilon", self.mla_latent_norm_epsilon)
        self.fused()
        value_padding.check_mode(self.mla_value_padding)
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant: pass True or False, got {self.batch_invariant!r}")

    def fused(self) -> dict[str, str]:
        """Each fused operator's kernel, None resolved to ``kernel`` (``"off"``: Megatron's)."""
        names = ("rms_norm", "swiglu", "grouped_matmul", "rope", "moe_permute")
        return {n: _fused_kernel(n, getattr(self, f"{n}_kernel"), self.kernel) for n in names}

    @classmethod
    def take(cls, kwargs: dict) -> NPUSpecOptions:
        """The options among ``kwargs``, removed from it, checked."""
        return cls(**{name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs})


OPTION_NAMES = tuple(field.name for field in dataclasses.fields(NPUSpecOptions))


class NPUSpecProvider(BackendSpecProvider):
    """The NPU spec's modules for Megatron's ``BackendSpecProvider`` slots.

    Takes an :class:`NPUSpecOptions`, or its fields as keywords; ``seq_lengths_memo`` is shared
    by every attention built from this provider (a new one if None).
    """

    def __init__(
        self,
        options: NPUSpecOptions | None = None,
        *,
        seq_lengths_memo: SeqLengthsMemo | None = None,
        **keywords,
    ):
        if options is None:
            options = NPUSpecOptions(**keywords)
        elif keywords:
            raise TypeError(f"{next(iter(keywords))}: pass options or keywords, not both")
        self.options = options
        self.kernel, self.param_layout = options.kernel, options.param_layout
        self.fused = options.fused()
        self.mla_value_padding = options.mla_value_padding
        self.batch_invariant = options.batch_invariant
        self.rope_cache = RopeCosSinCache()  # cos/sin once per step for every layer
        self.seq_lengths_memo = (
            seq_lengths_memo if seq_lengths_memo is not None else SeqLengthsMemo()
        )
        self.topk_share = TopKShare()  # DSA layers that reuse an earlier layer's top-k

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

    def column_parallel_layer_norm_linear(self, epsilon: float | None = None) -> ModuleSpec | None:
        """The te layout's norm-and-linear (``epsilon``: its norm's, None = the config's)."""
        if not self.te_layout:
            return None
        params = {"norm_kernel": self._on("rms_norm")}
        if epsilon is not None:
            params["norm_epsilon"] = epsilon
        return ModuleSpec(module=NormColumnParallelLinear, params=params)

    def layer_norm(
        self, rms_norm: bool = False, for_qk: bool = False, epsilon: float | None = None
    ) -> ModuleSpec:
        """``config.normalization`` decides LayerNorm / RMSNorm (``rms_norm`` is not needed);
        ``epsilon``: None = the ``eps`` Megatron passes."""
        params = {"extra_state": self.te_layout, "kernel": self._on("rms_norm")}
        if epsilon is not None:
            params["epsilon"] = epsilon
        return ModuleSpec(module=SequenceParallelNorm, params=params)

    def latent_norm_epsilon(self) -> float | None:
        """MLA's latent norms' epsilon (``mla_latent_norm_epsilon``; None: the config's)."""
        return self.options.mla_latent_norm_epsilon

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
        """The routed experts as ``NPUGroupedMLP``: ``SequentialMLP``'s names without grouped GEMM,
        ``TEGroupedMLP``'s with it in the te layout; in the local layout a grouped-GEMM slot keeps
        Megatron's ``GroupedMLP``."""
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
        """``SelfAttention`` spec -> ``NPURotarySelfAttention`` (fused RoPE), or
        ``NPUSelfAttention`` with ``rope_kernel="off"``."""
        kernel = self._on("rope")
        if kernel is None:
            params = dict(attention.params)
            return ModuleSpec(
                module=NPUSelfAttention, params=params, submodules=attention.submodules
            )
        params = {**attention.params, "rope_kernel": kernel, "rope_cache": self.rope_cache}
        params["seq_lengths_memo"] = self.seq_lengths_memo
        submodules = attention.submodules
        return ModuleSpec(module=NPURotarySelfAttention, params=params, submodules=submodules)

    def mla_self_attention(self, attention: ModuleSpec) -> ModuleSpec:
        """``MLASelfAttention`` spec -> ``NPUMLASelfAttention`` (``rope_kernel`` on the rope slice)."""
        params = {
            **attention.params,
            "rope_kernel": self._on("rope"),
            "seq_lengths_memo": self.seq_lengths_memo,
        }
        return ModuleSpec(
            module=NPUMLASelfAttention, params=params, submodules=attention.submodules
        )

    def dsa_self_attention(self, attention: ModuleSpec) -> ModuleSpec:
        """``MLASelfAttention`` spec -> ``NPUDSASelfAttention`` with ``NPUSparseAttention`` as
        core attention (DSA configs); refused in batch-invariant mode."""
        if self.batch_invariant:
            raise ValueError(
                "batch-invariant mode does not support DeepSeek Sparse Attention layers (no "
                "batch-invariant kernel of the indexer and the sparse attention): use a model "
                "without DSA, or turn the mode off"
            )
        mla = self.mla_self_attention(attention)
        subs = copy.copy(mla.submodules)
        params = {"kernel": self.kernel, "seq_lengths_memo": self.seq_lengths_memo,
                  "topk_share": self.topk_share}  # fmt: skip
        for name in (*DSA_SPEC_KEYWORDS, *DSA_KERNELS):
            params[name] = getattr(self.options, name)
        subs.core_attention = ModuleSpec(module=NPUSparseAttention, params=params)
        return ModuleSpec(module=NPUDSASelfAttention, params=mla.params, submodules=subs)

    def core_attention(self) -> ModuleSpec:
        module = TELayoutNPUFusionAttention if self.te_layout else NPUFusionAttention
        params = {
            "kernel": self.kernel,
            "seq_lengths_memo": self.seq_lengths_memo,
            "value_padding": self.mla_value_padding,
        }
        if self.batch_invariant:
            params["batch_invariant"] = True
        return ModuleSpec(module=module, params=params)

    def grouped_mlp_modules(
        self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool = False
    ):
        """``SequentialMLP`` of the column/row-parallel linears, in the installed builders' form:
        ``(SequentialMLP, MLPSubmodules)`` (<= 0.16), else
        ``functools.partial(SequentialMLP, ...)``.

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
