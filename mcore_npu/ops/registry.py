"""Every operator of ``mcore_npu.ops`` and which kernel runs a call of it: one table, one policy
(docs/ops.md). A kernel named by ``kernel=`` that cannot run the call raises; ``auto`` on NPU
tensors takes the first Ascend kernel that can, else the reference with one warning per process;
off an NPU ``auto`` is the reference. Imports no torch: probes are named by path.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass

from mcore_npu._optional import load
from mcore_npu._warnings import warn_once

REFERENCE = "reference"


@dataclass(frozen=True)
class Kernel:
    """An Ascend kernel: ``module`` holding every one of ``attributes``; ``probe``
    (``"module:function"``, called ``probe(kernel, **facts)``) returns why it cannot take a call;
    ``min_soc``: the lowest ``torch_npu.npu.get_soc_version()`` it runs on (260: Ascend 950)."""

    name: str
    module: str
    attributes: tuple[str, ...]
    probe: str | None = None
    min_soc: int | None = None


@dataclass(frozen=True)
class Operator:
    """One public operator: where it lives, its Ascend kernels (``auto`` tries them in order),
    its pure-PyTorch reference and its validator (``"module:function"`` each)."""

    name: str
    function: str
    reference: str
    validator: str | None
    kernels: tuple[Kernel, ...] = ()

    @property
    def kernel_names(self) -> tuple[str, ...]:
        """What ``kernel=`` takes for this operator."""
        return ("auto", *dict.fromkeys(k.name for k in self.kernels), REFERENCE)


@dataclass(frozen=True)
class Resolution:
    """The kernel that runs a call, and why the kernels before it in ``auto``'s order did not."""

    kernel: str
    reasons: tuple[str, ...] = ()

    @property
    def fell_back(self) -> bool:
        """``auto`` on an NPU ended at the reference."""
        return self.kernel == REFERENCE and bool(self.reasons)


def _npu(*attributes: str, probe: str | None = None) -> tuple[Kernel, ...]:
    return (Kernel("torch_npu", "torch_npu", attributes, probe),)


_OPS, _GDN, _MAMBA = "mcore_npu.ops", "mcore_npu.ops.gated_delta", "mcore_npu.ops.mamba"
_PROBES = "mcore_npu.ops.probes"

OPERATORS: dict[str, Operator] = {
    op.name: op
    for op in (
        Operator("fusion_attention", f"{_OPS}.attention:fusion_attention",
                 f"{_OPS}.reference:npu_fusion_attention", f"{_OPS}.validation:validate_call",
                 _npu("npu_fusion_attention")),
        Operator("fusion_attention_grad", f"{_OPS}.attention:fusion_attention_grad",
                 f"{_OPS}.reference:npu_fusion_attention_grad", None,
                 _npu("npu_fusion_attention_grad")),
        Operator("rms_norm", f"{_OPS}.fused:rms_norm", f"{_OPS}.npu_rms_norm:npu_rms_norm",
                 f"{_OPS}.npu_rms_norm:validate_rms_norm", _npu("npu_rms_norm")),
        Operator("swiglu", f"{_OPS}.fused:swiglu", f"{_OPS}.npu_swiglu:npu_swiglu",
                 f"{_OPS}.npu_swiglu:validate_swiglu", _npu("npu_swiglu")),
        Operator("rotary_mul", f"{_OPS}.fused_rotary:rotary_mul", f"{_OPS}.rotary:npu_rotary_mul",
                 f"{_OPS}.rotary:validate_rotary_mul",
                 _npu("npu_rotary_mul", probe=f"{_PROBES}:rotary_mul")),
        Operator("mrope_angles", f"{_OPS}.mrope:mrope_angles", f"{_OPS}.mrope:mrope_angles",
                 f"{_OPS}.mrope:validate_mrope_angles"),
        Operator("grouped_matmul", f"{_OPS}.fused:grouped_matmul",
                 f"{_OPS}.npu_grouped_matmul:npu_grouped_matmul",
                 f"{_OPS}.npu_grouped_matmul:validate_grouped_matmul",
                 _npu("npu_grouped_matmul", probe=f"{_PROBES}:grouped_matmul")),
        Operator("moe_token_permute_with_routing_map",
                 f"{_OPS}.permute_dispatch:moe_token_permute_with_routing_map",
                 f"{_OPS}.moe_permute:npu_moe_token_permute_with_routing_map",
                 f"{_OPS}.moe_permute:validate_permute_with_routing_map",
                 _npu("npu_moe_token_permute_with_routing_map",
                      "npu_moe_token_unpermute_with_routing_map")),
        Operator("moe_token_unpermute_with_routing_map",
                 f"{_OPS}.permute_dispatch:moe_token_unpermute_with_routing_map",
                 f"{_OPS}.moe_permute:npu_moe_token_unpermute_with_routing_map",
                 f"{_OPS}.moe_permute:validate_unpermute_with_routing_map",
                 _npu("npu_moe_token_unpermute_with_routing_map",
                      "npu_moe_token_permute_with_routing_map")),
        Operator("moe_token_permute", f"{_OPS}.permute_dispatch:moe_token_permute",
                 f"{_OPS}.moe_permute:npu_moe_token_permute",
                 f"{_OPS}.moe_permute:validate_token_permute",
                 _npu("npu_moe_token_permute", "npu_moe_token_unpermute")),
        Operator("moe_token_unpermute", f"{_OPS}.permute_dispatch:moe_token_unpermute",
                 f"{_OPS}.moe_permute:npu_moe_token_unpermute",
                 f"{_OPS}.moe_permute:validate_token_unpermute",
                 _npu("npu_moe_token_unpermute", "npu_moe_token_permute")),
        Operator("chunk_gated_delta_rule", f"{_GDN}.rule:chunk_gated_delta_rule",
                 f"{_GDN}.chunked:chunked_gated_delta_rule", f"{_GDN}.checks:validate_rule", (
                     Kernel("torch_npu", "torch_npu", ("npu_chunk_gated_delta_rule",),
                            f"{_PROBES}:gated_delta_torch_npu"),
                     Kernel("fla_npu", "fla_npu.ops.ascendc", (), f"{_PROBES}:gated_delta_fla_npu"),
                     Kernel("fla", "fla.ops.gated_delta_rule", ("chunk_gated_delta_rule",)),
                 )),
        Operator("causal_conv1d", f"{_GDN}.conv:causal_conv1d", f"{_GDN}.conv:causal_conv1d",
                 f"{_GDN}.checks:validate_conv",
                 (Kernel("torch_npu", "torch_npu", ("npu_masked_causal_conv1d",),
                         f"{_PROBES}:masked_causal_conv1d", min_soc=260),)),
        Operator("l2norm", f"{_GDN}.norms:l2norm", f"{_GDN}.norms:l2norm", None),
        Operator("gated_rms_norm", f"{_GDN}.norms:gated_rms_norm", f"{_GDN}.norms:gated_rms_norm",
                 None),
        Operator("mamba_chunk_scan_combined", f"{_MAMBA}.scan:mamba_chunk_scan_combined",
                 f"{_MAMBA}.scan:ssd_reference", f"{_MAMBA}.checks:validate_scan",
                 (Kernel("mamba_ssm", "mamba_ssm.ops.triton.ssd_combined",
                         ("mamba_chunk_scan_combined",)),)),
        Operator("rms_norm_gated", f"{_MAMBA}.norm:rms_norm_gated", f"{_MAMBA}.norm:rms_norm_gated",
                 f"{_MAMBA}.norm:validate_rms_norm_gated"),
        Operator("batch_invariant_attention", f"{_OPS}.batch_invariant:batch_invariant_attention",
                 f"{_OPS}.batch_invariant:fixed_block_attention",
                 f"{_OPS}.batch_invariant:validate_batch_invariant_attention",
                 (Kernel("flash_attn_npu", "flash_attn_npu",
                         ("flash_attn_func", "flash_attn_varlen_func")),)),
        *(Operator(name, f"{_OPS}.batch_invariant_rows:{name}",
                   f"{_OPS}.batch_invariant_rows:{reference}",
                   f"{_OPS}.batch_invariant_rows:validate_{name}",
                   (Kernel("batch_invariant_ops", "batch_invariant_ops", (),
                           f"{_PROBES}:batch_invariant_library"),))
          for name, reference in (("batch_invariant_linear", "fixed_block_linear"),
                                  ("batch_invariant_sum", "fixed_block_sum"))),
        Operator("lightning_indexer", f"{_OPS}.dsa.indexer:lightning_indexer",
                 f"{_OPS}.dsa.indexer:indexer_reference", f"{_OPS}.dsa.indexer:validate_lightning_indexer",
                 _npu("npu_lightning_indexer", probe=f"{_PROBES}:lightning_indexer")),
        Operator("sparse_flash_attention", f"{_OPS}.dsa.attention:sparse_flash_attention",
                 f"{_OPS}.dsa.attention_reference:sparse_attention_reference",
                 f"{_OPS}.dsa.attention:validate_sparse_flash_attention",
                 _npu("npu_sparse_flash_attention", "npu_sparse_flash_attention_grad",
                      probe=f"{_PROBES}:sparse_flash_attention")),
        Operator("sparse_lightning_indexer_grad_kl_loss",
                 f"{_OPS}.dsa.kl_loss:sparse_lightning_indexer_grad_kl_loss",
                 f"{_OPS}.dsa.kl_loss:indexer_kl_loss_reference", f"{_OPS}.dsa.kl_loss:validate_indexer_kl_loss",
                 _npu("npu_sparse_lightning_indexer_grad_kl_loss",
                      probe=f"{_PROBES}:sparse_lightning_indexer_grad_kl_loss")),
    )
}  # fmt: skip

KERNELS = ("auto", "torch_npu", REFERENCE)
"""What ``kernel=`` takes for the operators whose one Ascend kernel is torch_npu's."""


def operator(name: str) -> Operator:
    """The registered operator ``name``, or ValueError listing the registered ones."""
    if name not in OPERATORS:
        close = difflib.get_close_matches(name, OPERATORS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"operator: {name!r} is not registered{hint} ({', '.join(OPERATORS)})")
    return OPERATORS[name]


def check_kernel(kernel, *, op: str | None = None, what: str = "kernel", off: bool = False):
    """``kernel`` itself, or ValueError naming ``what``, the value and the accepted ones: ``op``'s
    kernels (default: torch_npu's ones), and ``"off"`` (Megatron's own module) where ``off``."""
    accepted = operator(op).kernel_names if op else KERNELS
    if kernel in accepted or (off and kernel == "off"):
        return kernel
    allowed = ", ".join((*accepted, "off") if off else accepted)
    raise ValueError(
        f"{what}: unknown kernel {kernel!r}; pass one of {allowed} ('auto' picks the Ascend "
        "kernel for NPU tensors and the reference elsewhere)"
    )


def resolve(op: str, kernel: str = "auto", device=None, **facts) -> Resolution:
    """The kernel that runs a call of ``op`` on ``device`` (a ``torch.device`` or its type name),
    ``facts`` being what the kernels' probes read. ValueError for an unknown operator or kernel;
    ImportError or ValueError for a kernel asked for by name that cannot run the call."""
    spec = operator(op)
    check_kernel(kernel, op=op)
    if kernel == REFERENCE:
        return Resolution(REFERENCE)
    if kernel != "auto":
        candidates = [k for k in spec.kernels if k.name == kernel]
        reasons = [r for r in (_why_not(k, facts, strict=True) for k in candidates) if r]
        if len(reasons) < len(candidates):
            return Resolution(kernel)
        raise ValueError(f"{op}: kernel {kernel!r} cannot run this call: {'; '.join(reasons)}")
    if getattr(device, "type", device) != "npu":
        return Resolution(REFERENCE)
    reasons = []
    for candidate in spec.kernels:
        reason = _why_not(candidate, facts, strict=False)
        if reason is None:
            return Resolution(candidate.name, tuple(reasons))
        reasons.append(f"{candidate.name}: {reason}")
    if not reasons:
        reasons.append("no Ascend kernel is registered for it")
    message = f"{op}: using the PyTorch reference on the NPU ({'; '.join(reasons)})"
    warn_once(f"registry-fallback:{op}:{reasons}", message)
    return Resolution(REFERENCE, tuple(reasons))


def ascend(op: str, kernel: str = "torch_npu", attribute: str | None = None):
    """The Ascend kernel's callable (``attribute``: default its first), or its module when it
    names no attribute (``fla_npu``'s building blocks). Imports the module now."""
    found = next((k for k in operator(op).kernels if k.name == kernel), None)
    if found is None:
        raise ValueError(f"{op}: no Ascend kernel {kernel!r} ({operator(op).kernel_names})")
    module = load(found.module)
    name = attribute or (found.attributes[0] if found.attributes else None)
    return module if name is None else getattr(module, name)


def by_attribute(attribute: str):
    """torch_npu's ``attribute`` (``"npu_rms_norm"``, ...) for the tools that call a registered
    kernel by its torch_npu name; ValueError for a name no registered kernel has."""
    for spec in OPERATORS.values():
        for kernel in spec.kernels:
            if kernel.module == "torch_npu" and attribute in kernel.attributes:
                return ascend(spec.name, kernel.name, attribute)
    raise ValueError(f"attribute: {attribute!r} is not a registered torch_npu kernel")


def reference(op: str):
    """The operator's pure-PyTorch reference."""
    return _resolve_path(operator(op).reference)


def why_not(kernel: Kernel, **facts) -> str | None:
    """Why ``kernel`` cannot run a call with ``facts`` on this machine (not installed, an attribute
    missing, its probe refusing); None when it can."""
    return _why_not(kernel, facts, strict=False)


def _why_not(kernel: Kernel, facts: dict, *, strict: bool) -> str | None:
    """Why ``kernel`` cannot run a call with ``facts`` (None: it can). ``strict``: an import
    failure raises (a kernel asked for by name), else it is a reason."""
    try:
        module = load(kernel.module)
    except ImportError as err:
        if strict:
            raise
        return str(err).split("\n")[0].split(": ", 1)[-1]  # "failed to import (...)"
    missing = [name for name in kernel.attributes if not callable(getattr(module, name, None))]
    if missing:
        return f"the installed {kernel.module} has no {', '.join(missing)}"
    if kernel.min_soc is not None:
        soc = int(load("torch_npu").npu.get_soc_version())
        if soc < kernel.min_soc:
            return f"it runs on SoC {kernel.min_soc}+ only (Ascend 950), this NPU is SoC {soc}"
    if kernel.probe is None:
        return None
    target = getattr(module, kernel.attributes[0]) if kernel.attributes else module
    return _resolve_path(kernel.probe)(target, **facts)


def _resolve_path(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
