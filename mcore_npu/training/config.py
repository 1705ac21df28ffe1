"""The YAML schema of ``mcore-npu train``: structured OmegaConf configs, loading, validation.

Eight sections (``model``, ``attention``, ``fused``, ``memory``, ``parallel``, ``train``,
``data``, ``optimizer``; docs/train.md lists their keys). ``load_config(path, overrides)`` reads
YAML, applies dotlist overrides and validates every value before any process group starts; a
bad value raises ``ConfigError`` naming the key path, the value and the fix. ``model`` also
takes any other field of the installed ``TransformerConfig`` (or ``MLATransformerConfig`` with
``multi_latent_attention: true``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mcore_npu.ops.registry import KERNELS
from mcore_npu.transformer.backends import BACKENDS, PARAM_LAYOUTS, resolve_backend
from mcore_npu.transformer.megatron_features import install_hint

DTYPES = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("cosine", "linear", "constant")
ACTIVATIONS = ("swiglu", "gelu", "relu", "squared_relu")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
BYTE_VOCAB = 256
"""Byte-level tokens 0..255; ids from 256 up are reserved specials (256 = end of document)."""


class ConfigError(ValueError):
    """A config value that cannot work, with its key path and the fix."""

    def __init__(self, key: str, value: Any, problem: str, fix: str) -> None:
        self.key = key
        super().__init__(f"config {key}={value!r}: {problem}; {fix}")


@dataclass
class ModelSection:
    """GPT shape. Any other ``TransformerConfig`` field may be added; it lands in ``extra``."""

    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = 2
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size (swiglu: 8/3, rounded to 64)
    normalization: str = "RMSNorm"
    activation: str = "swiglu"
    qk_layernorm: bool = False
    add_bias_linear: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    window_size: list[int] | None = None  # [left, right]; -1 = unbounded
    init_method_std: float = 0.02
    vocab_size: int = 264
    max_sequence_length: int = 256
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # share of each head's dims RoPE rotates (Qwen3.5: 0.25)
    share_embeddings_and_output_weights: bool = False
    param_layout: str = "te"  # npu_fusion parameter names: te (TE spec's) | local (local spec's)
    hybrid_pattern: str | None = None  # Megatron's hybrid model: "M*-E...", one symbol per layer
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class AttentionSection:
    backend: str = "auto"  # npu_fusion on NPU, te where transformer-engine imports, else local
    kernel: str = "auto"  # npu_fusion only: auto = torch_npu on NPU tensors, reference elsewhere


@dataclass
class FusedSection:
    """The npu_fusion spec's fused-operator kernels (null = attention.kernel; off = Megatron's)."""

    rms_norm: str | None = None  # npu_rms_norm in the input / pre-MLP / q-k / final norms
    swiglu: str | None = None  # npu_swiglu as the SwiGLU activation (dense MLP and experts)
    grouped_matmul: str | None = None  # npu_grouped_matmul experts (MoE layers)
    moe_permute: str | None = "off"  # fused MoE token permute; off = Megatron's (default)
    rope: str | None = "off"  # npu_rotary_mul RoPE in self-attention (off = Megatron's own)


@dataclass
class MemorySection:
    expandable_segments: bool = True
    strict: bool = False  # raise when expandable segments cannot take effect on an accelerator


@dataclass
class ParallelSection:
    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False
    context: int = 1  # data parallel = world size / (tensor * pipeline * context)
    cp_comm_type: str = "p2p"  # context > 1: "p2p" (ring), "all_gather" or "a2a" (Ulysses)
    expert: int = 1  # expert parallel (MoE): experts split over this many data x context ranks
    expert_tensor: int | None = None  # expert layers' tensor parallel; null = parallel.tensor
    # uneven pipeline stages (null: num_layers split evenly); either first/last stage counts ...
    first_stage_layers: int | None = None  # decoder layers of the first stage
    last_stage_layers: int | None = None  # decoder layers of the last stage
    # ... or MindSpeed's per-stage list: [[1], [2], [2], [1]] or [1, 2, 2, 1]
    pipeline_num_transformer_layers: list[Any] | None = None


@dataclass
class TrainSection:
    steps: int = 60
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seq_length: int = 128
    lr: float = 3.0e-3
    min_lr: float = 3.0e-4
    lr_schedule: str = "cosine"
    warmup_steps: int = 5
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "fp32"
    log_interval: int = 1
    metrics_file: str | None = "runs/metrics.jsonl"
    checkpoint_dir: str | None = None
    save_interval: int = 0  # 0: save only at the end (when checkpoint_dir is set)
    exit_interval: int = 0  # stop (after saving) at a multiple of this step; 0 = run to the end
    resume: bool = False  # continue from the newest readable checkpoint in checkpoint_dir
    overwrite: bool = False  # delete the checkpoints already in checkpoint_dir and start again
    init_from: str | None = None  # load model weights (any parallel layout) before step 1
    progress: bool = True
    timeout_s: float = 300.0


@dataclass
class DataSection:
    path: str | None = None  # a UTF-8 text file (only UTF-8); None = the embedded corpus
    pack_sequences: bool = False  # micro-batch rows as one packed (thd) sequence


@dataclass
class OptimizerSection:
    """Megatron's ``OptimizerConfig`` keys, with their names and meanings (docs/optimizer.md)."""

    use_distributed_optimizer: bool = False
    use_precision_aware_optimizer: bool = False  # the plugin's Adam without TE
    main_grads_dtype: str = "fp32"  # fp32 | bf16 | fp16 (precision-aware only)
    main_params_dtype: str = "fp32"  # fp32 | fp16 (precision-aware only)
    exp_avg_dtype: str = "fp32"  # fp32 | bf16 | fp16 (precision-aware only)
    exp_avg_sq_dtype: str = "fp32"  # fp32 | bf16 | fp16 (precision-aware only)
    store_param_remainders: bool = True  # bf16 model, fp32 master: keep its low 16 bits only
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0  # share of the parameters whose state is on host
    overlap_cpu_optimizer_d2h_h2d: bool = False


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    attention: AttentionSection = field(default_factory=AttentionSection)
    fused: FusedSection = field(default_factory=FusedSection)
    memory: MemorySection = field(default_factory=MemorySection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)


_SECTIONS = {
    "model": ModelSection,
    "attention": AttentionSection,
    "fused": FusedSection,
    "memory": MemorySection,
    "parallel": ParallelSection,
    "train": TrainSection,
    "data": DataSection,
    "optimizer": OptimizerSection,
}


def load_config(
    path: str | os.PathLike | None = None,
    overrides: typing.Sequence[str] = (),
    *,
    world_size: int | None = None,
) -> DictConfig:
    """YAML file (optional; ``base: other.yaml`` extends another) + dotlist overrides
    (``train.steps=50``) -> a validated config; ``world_size`` defaults to ``WORLD_SIZE`` or 1."""
    raw = _read_yaml(path) if path is not None else {}
    raw = _deep_merge(raw, _parse_overrides(overrides))
    _check_sections(raw)
    raw.setdefault("model", {})
    raw["model"] = _route_model_keys(raw["model"])
    cfg = OmegaConf.structured(Config)
    try:
        cfg = OmegaConf.merge(cfg, raw)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        fix = "fix the type or spelling of that key"
        raise ConfigError(key, _value_at(raw, key), _omegaconf_problem(err), fix) from None
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    validate(cfg, world_size)
    return cfg


def _read_yaml(path, _depth: int = 0) -> dict:
    """A YAML mapping, merged over its ``base: other.yaml`` (relative to this file) if any."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--config", str(path), "no such file", "pass the path of a YAML file")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(
            "--config", str(path), f"not valid YAML ({err})", "fix the syntax"
        ) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        fix = "write sections such as 'model:' and 'train:'"
        raise ConfigError("--config", str(path), "the top level is not a mapping", fix)
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if _depth > 8:
        fix = "point 'base' at a file that does not lead back here"
        raise ConfigError(f"{path}: base", base, "bases nest too deeply (a cycle?)", fix)
    return _deep_merge(_read_yaml(path.parent / base, _depth + 1), loaded)


def _parse_overrides(overrides) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            problem = "an override must look like key.path=value"
            raise ConfigError(item, item, problem, "e.g. train.steps=50")
    return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides))) if overrides else {}


def _deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _check_sections(raw: dict) -> None:
    sections = list(_SECTIONS)
    for key, value in raw.items():
        if key not in sections:
            raise ConfigError(key, value, "unknown section", _suggest(key, sections))
        if not isinstance(value, dict):
            raise ConfigError(key, value, "a section must be a mapping", f"write '{key}:' keys")
        if key == "model":
            continue
        names = [f.name for f in dataclasses.fields(_SECTIONS[key])]
        for name in value:
            if name not in names:
                raise ConfigError(
                    f"{key}.{name}", value[name], "unknown key", _suggest(name, names)
                )


def _suggest(name: str, candidates) -> str:
    close = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(candidates)}"


def _route_model_keys(model: dict) -> dict:
    """Keys of ``ModelSection`` stay; other ``TransformerConfig`` fields move into ``extra``."""
    own = {f.name for f in dataclasses.fields(ModelSection)} - {"extra"}
    given_extra = dict(model.get("extra") or {})
    passthrough = [(k, v) for k, v in model.items() if k not in own and k != "extra"]
    if not passthrough and not given_extra:
        return dict(model)  # no need to import megatron
    hints = _transformer_config_hints()
    extra = {}
    for key, value in [*passthrough, *given_extra.items()]:
        if key in own:
            fix = f"set model.{key} directly"
            raise ConfigError(f"model.extra.{key}", value, "is a model key", fix)
        if key in _SET_ELSEWHERE:
            problem, fix = (
                "is set from another part of this config",
                f"set {_SET_ELSEWHERE[key]} instead",
            )
            raise ConfigError(f"model.{key}", value, problem, fix)
        if key not in hints:
            raise ConfigError(
                f"model.{key}",
                value,
                "not a model key nor a field of the installed megatron-core TransformerConfig",
                install_hint(key) or _suggest(key, sorted(own | set(hints))),
            )
        if not (value is None and key in _NULL_MEANS_SOMETHING):
            _check_annotation(f"model.{key}", value, hints[key])
        extra[key] = value
    return {**{k: v for k, v in model.items() if k in own}, "extra": extra}


_NULL_MEANS_SOMETHING = {  # fields annotated without None where Megatron reads None
    "q_lora_rank": "MLA without a q latent (linear_q_proj), as Moonlight and DeepSeek-V2-Lite",
}

_SET_ELSEWHERE = {  # TransformerConfig fields this schema sets itself, and where
    "tensor_model_parallel_size": "parallel.tensor",
    "pipeline_model_parallel_size": "parallel.pipeline",
    "virtual_pipeline_model_parallel_size": "parallel.pipeline (no virtual stages)",
    "context_parallel_size": "parallel.context",
    "cp_comm_type": "parallel.cp_comm_type",
    "sequence_parallel": "parallel.sequence_parallel",
    "expert_model_parallel_size": "parallel.expert",
    "expert_tensor_parallel_size": "parallel.expert_tensor",
    "num_layers_in_first_pipeline_stage": "parallel.first_stage_layers",
    "num_layers_in_last_pipeline_stage": "parallel.last_stage_layers",
    "pipeline_model_parallel_layout": "parallel.pipeline_num_transformer_layers",
    "bf16": "train.dtype",
    "fp16": "train.dtype",
    "params_dtype": "train.dtype",
    "pipeline_dtype": "train.dtype",
    "activation_func": "model.activation",
    "gated_linear_unit": "model.activation",
}


def _transformer_config_hints() -> dict[str, Any]:
    """Field -> annotation of ``MLATransformerConfig`` (``TransformerConfig`` + the MLA fields)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    try:
        hints = typing.get_type_hints(MLATransformerConfig)
    except Exception:  # unresolvable forward references: fall back to "any value"
        hints = {}
    return {name: hints.get(name, Any) for name in names}


def mla_only_fields() -> set[str]:
    """The ``MLATransformerConfig`` fields ``TransformerConfig`` lacks (``q_lora_rank``, ...)."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    return {f.name for f in dataclasses.fields(MLATransformerConfig)} - base


_SIMPLE = (bool, int, float, str)


def _check_annotation(key: str, value: Any, annotation: Any) -> None:
    """Accept YAML scalars/lists where the TransformerConfig field's type allows them."""
    allowed = _simple_types(annotation)
    if allowed is None:
        problem = f"this field has type {annotation} and cannot be set from YAML"
        fix = "leave it out (mcore_npu sets it) or set it from Python"
        raise ConfigError(key, value, problem, fix)
    if value is None and type(None) in allowed:
        return
    if isinstance(value, bool) and bool not in allowed:
        raise ConfigError(key, value, f"expected {_names(allowed)}", "write a value of that type")
    plain = tuple(t for t in allowed if t is not type(None))
    int_for_float = isinstance(value, int) and float in allowed
    if not isinstance(value, plain) and not int_for_float:
        raise ConfigError(key, value, f"expected {_names(allowed)}", "write a value of that type")


def _simple_types(annotation) -> tuple | None:
    if annotation is Any:
        return (object,)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = []
        for arg in typing.get_args(annotation):
            sub = _simple_types(arg)
            if sub is not None:
                parts.extend(sub)
        return tuple(parts) or None
    if origin is typing.Literal:
        return tuple({type(a) for a in typing.get_args(annotation)})
    if origin in (list, tuple):
        return (list, tuple)
    if annotation is type(None) or annotation in _SIMPLE:
        return (annotation,)
    return None


def _names(types_) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types_)


def _omegaconf_problem(err: OmegaConfBaseException) -> str:
    message = str(err).splitlines()[0]
    return message.replace("\n", " ")


def _value_at(raw: dict, dotted: str):
    node: Any = raw
    for part in str(dotted).split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _fail(key: str, value: Any, problem: str, fix: str) -> typing.NoReturn:
    raise ConfigError(key, value, problem, fix)


def validate(cfg: DictConfig, world_size: int = 1) -> None:
    """Every cross-field rule of the schema; raises ``ConfigError`` on the first violation."""
    _validate_choices(cfg)
    _validate_sizes(cfg)
    _validate_heads(cfg)
    _validate_parallel(cfg, world_size)
    _validate_experts(cfg, world_size)
    _validate_mla(cfg)
    _validate_gdn(cfg)
    _validate_hybrid(cfg)
    _validate_rotary_percent(cfg)
    _validate_train(cfg)
    _validate_optimizer(cfg)


def optimizer_keys(cfg) -> dict:
    """The ``optimizer`` section as Megatron ``OptimizerConfig`` keys (dtypes still names)."""
    return dict(OmegaConf.to_container(cfg.optimizer))


def _validate_optimizer(cfg) -> None:
    from mcore_npu.optimizer.settings import AdamSettings

    keys = optimizer_keys(cfg)
    try:
        AdamSettings.from_keys(keys).check_against(
            optimizer="adam", use_distributed_optimizer=keys["use_distributed_optimizer"]
        )
    except (TypeError, ValueError) as err:
        raise ConfigError("optimizer", keys, str(err), "see docs/optimizer.md") from None


def is_gdn(cfg) -> bool:
    """Whether the model has Gated DeltaNet layers (``experimental_attention_variant``)."""
    return cfg.model.extra.get("experimental_attention_variant") == "gated_delta_net"


def _validate_rotary_percent(cfg) -> None:
    value = cfg.model.rotary_percent
    if not 0 < value <= 1:
        fix = "use 1.0 (full RoPE) or the rotated share, e.g. 0.25"
        _fail("model.rotary_percent", value, "must be in (0, 1]", fix)


_GDN_DEFAULTS = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_attention_freq": None,
}


def _validate_gdn(cfg) -> None:
    """Gated DeltaNet: npu_fusion only; ``linear_*`` fields as ``GDNTransformerConfig`` checks."""
    if not is_gdn(cfg):
        return
    from types import SimpleNamespace

    from mcore_npu.transformer.gated_delta_net.config import check_gdn_fields

    if _resolved_backend(cfg) != "npu_fusion":
        problem = (
            f"is built by the npu_fusion spec only (attention.backend={cfg.attention.backend})"
        )
        fix = "use attention.backend=npu_fusion"
        _fail("model.experimental_attention_variant", "gated_delta_net", problem, fix)
    extra, p = dict(cfg.model.extra), cfg.parallel
    parallel = {"tensor_model_parallel_size": p.tensor, "context_parallel_size": p.context}
    fields = SimpleNamespace(**{**_GDN_DEFAULTS, **extra, **parallel})
    if OmegaConf.is_config(fields.linear_attention_freq):
        fields.linear_attention_freq = OmegaConf.to_container(fields.linear_attention_freq)
    try:
        check_gdn_fields(fields)
    except ValueError as err:
        key, _, problem = str(err).partition(": ")
        fix = problem.partition("; ")[2] or "see docs/gdn_layer.md"
        _fail(f"model.{key}", getattr(fields, key, None), problem.split(";")[0], fix)


def is_hybrid(cfg) -> bool:
    """Whether the model is Megatron's hybrid model (``model.hybrid_pattern``)."""
    return cfg.model.hybrid_pattern is not None


def _validate_hybrid(cfg) -> None:
    """``model.hybrid_pattern``: symbols the installed stack builds, one per layer; npu_fusion,
    te names, no MTP; ``E`` needs experts. See docs/mamba_layer.md."""
    if not is_hybrid(cfg):
        return
    from mcore_npu.transformer.hybrid_pattern import check_pattern

    m, pattern = cfg.model, cfg.model.hybrid_pattern
    try:
        check_pattern(pattern, m.num_layers)
    except ValueError as err:
        problem, _, fix = str(err).partition(": ")[2].rpartition("; ")
        _fail("model.hybrid_pattern", pattern, problem, fix)
    if _resolved_backend(cfg) != "npu_fusion" or m.param_layout != "te":
        problem = "is built by the npu_fusion spec in the te layout only"
        _fail(
            "model.hybrid_pattern",
            pattern,
            problem,
            "use attention.backend=npu_fusion, model.param_layout=te",
        )
    if m.extra.get("mtp_num_layers"):
        problem = "multi-token prediction in a hybrid model is not built"
        _fail("model.mtp_num_layers", m.extra["mtp_num_layers"], problem, "remove it")
    _validate_mamba_sizes(cfg)
    if "E" in pattern and not m.extra.get("num_moe_experts"):
        _fail(
            "model.hybrid_pattern",
            pattern,
            "has MoE layers (E) without experts",
            "set model.num_moe_experts",
        )


def _validate_mamba_sizes(cfg) -> None:
    """Mamba heads and groups as ``NPUMambaMixer`` checks them (Megatron's defaults otherwise)."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_npu.transformer.mamba.mixer import check_sizes

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    names = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")
    fields = SimpleNamespace(**{n: cfg.model.extra.get(n, defaults[n]) for n in names})
    heads = fields.mamba_num_heads or 2 * cfg.model.hidden_size // fields.mamba_head_dim
    p = cfg.parallel
    try:
        check_sizes(heads, fields.mamba_num_groups, p.tensor, fields, p.context)
    except ValueError as err:
        key, _, problem = str(err).partition(": ")
        key = key.removeprefix("config.")
        section = "parallel" if key.endswith("parallel_size") else "model"
        _fail(f"{section}.{key}", getattr(fields, key, None), *problem.rsplit("; ", 1))


def is_mla(cfg) -> bool:
    """Whether the model is multi-latent attention (``model.multi_latent_attention: true``)."""
    return bool(cfg.model.extra.get("multi_latent_attention", False))


def _validate_mla(cfg) -> None:
    """Multi-latent attention: its fields only with it; MHA heads, RoPE, a spec that builds it."""
    m = cfg.model
    if not is_mla(cfg):
        given = sorted(set(m.extra) & mla_only_fields()) if m.extra else []
        if given:
            problem = "is a multi-latent attention field (MLATransformerConfig)"
            fix = "set model.multi_latent_attention=true, or remove it"
            _fail(f"model.{given[0]}", m.extra[given[0]], problem, fix)
        return
    if m.num_query_groups is not None and m.num_query_groups != m.num_attention_heads:
        heads = f"model.num_attention_heads={m.num_attention_heads}"
        problem = f"multi-latent attention has one key and value per head ({heads})"
        fix = "set model.num_query_groups=null"
        _fail("model.num_query_groups", m.num_query_groups, problem, fix)
    if m.position_embedding_type != "rope":
        problem = "multi-latent attention rotates its rope slice itself"
        problem += " (model.rope_type: rope or yarn)"
        fix = "set model.position_embedding_type=rope"
        _fail("model.position_embedding_type", m.position_embedding_type, problem, fix)
    if _resolved_backend(cfg) == "local":
        problem = (
            "Megatron's local spec cannot build it (its DotProductAttention rejects MLA's "
            "k_channels; megatron-core 0.16.1's MLASelfAttention needs TE; "
            f"attention.backend={cfg.attention.backend} resolves to local here)"
        )
        fix = "use attention.backend=npu_fusion (NPUMLASelfAttention)"
        _fail("model.multi_latent_attention", True, problem, fix)


_FUSED_CHOICES = f"use one of {', '.join(KERNELS)}, off, or null (= attention.kernel)"


def _validate_fused_switch(cfg, name: str, what: str) -> None:
    """``fused.<name>``: a kernel, off (Megatron's own module, the default) or null (=
    attention.kernel); only the npu_fusion backend has ``what`` without Transformer Engine."""
    value = cfg.fused[name]
    if value in (False, "False", "false"):  # YAML 1.1 reads an unquoted `off` as false
        value = cfg.fused[name] = "off"
    if value is not None and value not in (*KERNELS, "off"):
        _fail(f"fused.{name}", value, "unknown choice", _FUSED_CHOICES)
    backend = cfg.attention.backend
    if value != "off" and backend not in ("npu_fusion", "auto"):
        problem = f"only the npu_fusion backend has {what} without Transformer Engine"
        problem += f" (backend is {backend})"
        _fail(f"fused.{name}", value, problem, "leave it off")


def _validate_choices(cfg) -> None:
    choices = [
        ("attention.backend", cfg.attention.backend, BACKENDS),
        ("attention.kernel", cfg.attention.kernel, KERNELS),
        ("train.dtype", cfg.train.dtype, DTYPES),
        ("train.lr_schedule", cfg.train.lr_schedule, LR_SCHEDULES),
        ("model.activation", cfg.model.activation, ACTIVATIONS),
        ("model.normalization", cfg.model.normalization, NORMALIZATIONS),
        ("model.position_embedding_type", cfg.model.position_embedding_type, POSITION_EMBEDDINGS),
        ("model.param_layout", cfg.model.param_layout, PARAM_LAYOUTS),
    ]
    for key, value, allowed in choices:
        if value not in allowed:
            _fail(key, value, "unknown choice", f"use one of {', '.join(allowed)}")
    backend = cfg.attention.backend
    for name in ("rms_norm", "swiglu", "grouped_matmul"):
        value = cfg.fused[name]
        if value in ("False", "false"):  # YAML 1.1 reads an unquoted `off` as false
            value = cfg.fused[name] = "off"
        if value is not None and value not in (*KERNELS, "off"):
            _fail(f"fused.{name}", value, "unknown choice", _FUSED_CHOICES)
        if value is not None and backend not in ("npu_fusion", "auto"):
            problem = f"only the npu_fusion backend has fused kernels (backend is {backend})"
            _fail(f"fused.{name}", value, problem, "leave it null")
    _validate_fused_switch(cfg, "moe_permute", "the fused permute")
    _validate_fused_switch(cfg, "rope", "a fused RoPE")
    if cfg.attention.kernel != "auto" and backend not in ("npu_fusion", "auto"):
        problem = f"only the npu_fusion backend has kernels (backend is {backend})"
        fix = "set attention.backend=npu_fusion or leave attention.kernel=auto"
        _fail("attention.kernel", cfg.attention.kernel, problem, fix)


def _validate_sizes(cfg) -> None:
    positive = [
        ("model.num_layers", cfg.model.num_layers),
        ("model.hidden_size", cfg.model.hidden_size),
        ("model.num_attention_heads", cfg.model.num_attention_heads),
        ("model.max_sequence_length", cfg.model.max_sequence_length),
        ("train.steps", cfg.train.steps + 1),  # 0 steps is allowed: save an initial checkpoint
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("train.global_batch_size", cfg.train.global_batch_size),
        ("train.seq_length", cfg.train.seq_length),
        ("train.log_interval", cfg.train.log_interval),
        ("parallel.tensor", cfg.parallel.tensor),
        ("parallel.pipeline", cfg.parallel.pipeline),
        ("parallel.context", cfg.parallel.context),
    ]
    for key, value in positive:
        if value <= 0:
            steps = key == "train.steps"
            problem = "must be positive" + (" or 0" if steps else "")
            _fail(key, value - 1 if steps else value, problem, "use a value >= 1")
    if cfg.model.ffn_hidden_size is not None and cfg.model.ffn_hidden_size <= 0:
        _fail("model.ffn_hidden_size", cfg.model.ffn_hidden_size, "must be positive", "or null")
    for name in ("hidden_dropout", "attention_dropout"):
        value = cfg.model[name]
        if not 0.0 <= value < 1.0:
            problem = "a dropout probability must lie in [0, 1)"
            _fail(f"model.{name}", value, problem, "use e.g. 0.0 or 0.1")
    if cfg.model.vocab_size < BYTE_VOCAB + 1:
        _fail(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"the byte-level data needs {BYTE_VOCAB} byte ids plus the end-of-document id 256",
            "use at least 257 (default 264)",
        )
    max_len = cfg.model.max_sequence_length
    if cfg.train.seq_length > max_len:
        problem = f"exceeds model.max_sequence_length={max_len}"
        fix = "raise model.max_sequence_length or shorten train.seq_length"
        _fail("train.seq_length", cfg.train.seq_length, problem, fix)
    window = cfg.model.window_size
    if window is not None and (len(window) != 2 or any(w < -1 for w in window)):
        problem = "must be [left, right] with -1 = unbounded"
        fix = "e.g. [128, 0] for a causal window of 129 tokens"
        _fail("model.window_size", list(window), problem, fix)


def _validate_heads(cfg) -> None:
    m = cfg.model
    heads = m.num_attention_heads
    if m.hidden_size % heads:
        problem = f"does not divide model.hidden_size={m.hidden_size}"
        _fail("model.num_attention_heads", heads, problem, "pick heads that divide the hidden size")
    groups = m.num_query_groups or heads
    if groups <= 0 or heads % groups:
        problem = f"must divide model.num_attention_heads={heads}"
        fix = "use a divisor (1 = MQA, heads = MHA)"
        _fail("model.num_query_groups", m.num_query_groups, problem, fix)
    tp = cfg.parallel.tensor
    if heads % tp:
        problem = f"does not divide model.num_attention_heads={heads}"
        _fail("parallel.tensor", tp, problem, "pick a tensor-parallel size that divides the heads")
    if groups % tp and tp % groups:
        problem = f"and model.num_query_groups={groups} do not divide one another"
        fix = "pick a tensor-parallel size that divides the query groups"
        _fail("parallel.tensor", tp, problem, fix)
    if m.vocab_size % tp:
        problem = f"is not divisible by parallel.tensor={tp}"
        fix = "round the vocabulary up to a multiple of the tensor-parallel size"
        _fail("model.vocab_size", m.vocab_size, problem, fix)


# Megatron's argument names in this schema's keys, for the context-parallel rules' reasons
_CP_KEYS = {
    "cp_comm_type": "parallel.cp_comm_type",
    "context_parallel_size": "parallel.context",
    "attention_dropout": "model.attention_dropout",
    "window_size": "model.window_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_query_groups",
}


def _validate_context(cfg, p) -> None:
    """``parallel.context > 1``: what the context-parallel rules
    (``mcore_npu.transformer.context_parallel.rules``) allow."""
    from mcore_npu.transformer.context_parallel import rules

    if _resolved_backend(cfg) != "npu_fusion":
        problem = (
            "needs attention.backend=npu_fusion (Megatron's local attention refuses CP; "
            f"attention.backend={cfg.attention.backend})"
        )
        fix = "use attention.backend=npu_fusion, or parallel.context=1"
        _fail("parallel.context", p.context, problem, fix)
    chunks = 2 * p.context
    if cfg.train.seq_length % chunks:
        problem = (
            f"does not divide by 2*parallel.context = {chunks} "
            f"(Megatron cuts each sequence into 2*CP chunks)"
        )
        _fail("train.seq_length", cfg.train.seq_length, problem, f"use a multiple of {chunks}")
    m = cfg.model
    hierarchical = m.extra.get("hierarchical_context_parallel_sizes")
    if hierarchical:  # Megatron's a2a+p2p
        _, problem, fix = rules.not_supported_reasons("a2a+p2p", p.context)[0].render(_CP_KEYS)
        _fail("model.hierarchical_context_parallel_sizes", list(hierarchical), problem, fix)
    comm_type = p.cp_comm_type
    window = None if m.window_size is None else tuple(m.window_size)
    facts = dict(dropout=m.attention_dropout, window=window, packed=bool(cfg.data.pack_sequences))
    groups = m.num_query_groups or m.num_attention_heads
    heads = dict(heads=m.num_attention_heads, groups=groups, tp=p.tensor)
    reasons = rules.not_supported_reasons(comm_type, p.context, **facts, **heads)
    if reasons:
        key, problem, fix = reasons[0].render(_CP_KEYS)
        _fail(key, reasons[0].value, problem, fix)


def _validate_parallel(cfg, world_size: int) -> None:
    p = cfg.parallel
    model_parallel = p.tensor * p.pipeline * p.context
    if world_size % model_parallel:
        problem = f"tensor*pipeline*context = {model_parallel} does not divide the world size"
        fix = "launch a multiple of that many processes"
        _fail("parallel.tensor", p.tensor, f"{problem} {world_size}", fix)
    data_parallel = world_size // model_parallel
    if p.context > 1:
        _validate_context(cfg, p)
    if p.sequence_parallel and p.tensor == 1:
        fix = "set parallel.tensor >= 2 or turn sequence parallelism off"
        _fail("parallel.sequence_parallel", True, "needs parallel.tensor > 1", fix)
    backend = _resolved_backend(cfg)
    here = f"(attention.backend={cfg.attention.backend} resolves to local here)"
    if p.sequence_parallel and backend == "local":
        problem = f"Megatron's local spec norms refuse it {here}"
        fix = "use attention.backend=npu_fusion (its norms support it) or te"
        _fail("parallel.sequence_parallel", True, problem, fix)
    if cfg.data.pack_sequences and backend == "local":
        problem = f"Megatron's local attention takes no packed sequences {here}"
        fix = "use attention.backend=npu_fusion or te, or unpacked batches"
        _fail("data.pack_sequences", True, problem, fix)
    if _uneven_stages(p):
        _validate_stages(cfg)
    elif cfg.model.num_layers % p.pipeline:
        _fail(
            "parallel.pipeline",
            p.pipeline,
            f"does not divide model.num_layers={cfg.model.num_layers}",
            "pick a pipeline size that divides the layer count, or set uneven stages "
            "(parallel.first_stage_layers / last_stage_layers / pipeline_num_transformer_layers)",
        )
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * data_parallel):
        problem = (
            f"is not a multiple of micro_batch_size * data_parallel = "
            f"{t.micro_batch_size} * {data_parallel}"
        )
        _fail("train.global_batch_size", t.global_batch_size, problem, "make it a multiple")
    if p.sequence_parallel and t.seq_length % p.tensor:
        problem = f"is not divisible by parallel.tensor={p.tensor} (sequence parallelism splits it)"
        fix = "use a multiple of the tensor-parallel size"
        _fail("train.seq_length", t.seq_length, problem, fix)


_STAGE_KEYS = {  # pipeline_layout's key -> this schema's
    "pipeline_num_transformer_layers": "parallel.pipeline_num_transformer_layers",
    "num_layers_in_first_pipeline_stage": "parallel.first_stage_layers",
    "num_layers_in_last_pipeline_stage": "parallel.last_stage_layers",
    "num_layers": "model.num_layers",
    "pipeline_size": "parallel.pipeline",
}


def _uneven_stages(p) -> bool:
    stages = (p.first_stage_layers, p.last_stage_layers, p.pipeline_num_transformer_layers)
    return any(value is not None for value in stages)


def _validate_stages(cfg) -> None:
    """Uneven pipeline stages, checked as Megatron will (mcore_npu.transformer.pipeline_layout)."""
    from mcore_npu.transformer import pipeline_layout

    p = cfg.parallel
    per_stage = p.pipeline_num_transformer_layers
    try:
        pipeline_layout.resolve_stage_keys(
            None if per_stage is None else OmegaConf.to_container(per_stage),
            num_layers=cfg.model.num_layers,
            pipeline_size=p.pipeline,
            first=p.first_stage_layers,
            last=p.last_stage_layers,
        )
    except pipeline_layout.StageLayoutError as err:
        _fail(_STAGE_KEYS.get(err.key, err.key), err.value, err.problem, err.fix)


def _validate_experts(cfg, world_size: int) -> None:
    p, experts = cfg.parallel, cfg.model.extra.get("num_moe_experts")
    if p.expert < 1:
        _fail("parallel.expert", p.expert, "must be positive", "use 1 (no expert parallelism)")
    if p.expert_tensor is not None and p.expert_tensor < 1:
        fix = "use null (= parallel.tensor) or 1"
        _fail("parallel.expert_tensor", p.expert_tensor, "must be positive", fix)
    if p.expert == 1:
        return
    if not experts:
        fix = "set model.num_moe_experts or parallel.expert=1"
        _fail("parallel.expert", p.expert, "needs an MoE model (model.num_moe_experts)", fix)
    if experts % p.expert:
        problem = f"does not divide model.num_moe_experts={experts}"
        _fail("parallel.expert", p.expert, problem, "pick a divisor of the expert count")
    data_parallel = world_size // (p.tensor * p.pipeline * p.context)
    etp = p.expert_tensor or p.tensor
    ranks = data_parallel * p.context * p.tensor // etp  # Megatron: world % (ETP*EP*PP) == 0
    if (data_parallel * p.context * p.tensor) % etp or ranks % p.expert:
        problem = (
            f"does not divide the data x context x tensor / expert-tensor parallel size "
            f"{ranks} (experts are split over those ranks)"
        )
        fix = "launch more processes, lower parallel.expert, or set parallel.expert_tensor=1"
        _fail("parallel.expert", p.expert, problem, fix)


def _resolved_backend(cfg) -> str:
    try:
        return resolve_backend(cfg.attention.backend)
    except ImportError as err:
        fix = "install it, or use attention.backend=npu_fusion or local"
        _fail("attention.backend", cfg.attention.backend, str(err).split(";")[0], fix)


def _validate_train(cfg) -> None:
    t = cfg.train
    if t.timeout_s <= 0:
        _fail("train.timeout_s", t.timeout_s, "must be positive", "e.g. 300 (seconds)")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        problem = f"needs 0 <= train.min_lr ({t.min_lr}) <= train.lr and lr > 0"
        _fail("train.lr", t.lr, problem, "e.g. lr=3e-3, min_lr=3e-4")
    if t.warmup_steps < 0:
        _fail("train.warmup_steps", t.warmup_steps, "must be >= 0", "use 0 for no warm-up")
    if t.save_interval < 0:
        _fail("train.save_interval", t.save_interval, "must be >= 0", "0 saves only at the end")
    if t.exit_interval < 0:
        _fail("train.exit_interval", t.exit_interval, "must be >= 0", "0 runs to train.steps")
    if t.grad_clip < 0:
        _fail("train.grad_clip", t.grad_clip, "must be >= 0", "use 0 to disable clipping")
    if t.resume and not t.checkpoint_dir:
        _fail("train.resume", True, "needs train.checkpoint_dir", "set train.checkpoint_dir")
    if t.init_from and t.resume:
        problem = "and train.resume both load weights"
        _fail("train.init_from", t.init_from, problem, "use one of them")
    if t.init_from and not Path(t.init_from).exists():
        _fail("train.init_from", t.init_from, "no such checkpoint", "pass a checkpoint directory")
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        _fail("data.path", cfg.data.path, "no such file", "pass a UTF-8 text file or null")
    if t.overwrite and t.resume:
        problem = "and train.resume=true contradict each other"
        fix = "resume (keep the checkpoints) or overwrite (delete them), not both"
        _fail("train.overwrite", True, problem, fix)
    if t.overwrite and not t.checkpoint_dir:
        _fail("train.overwrite", True, "needs train.checkpoint_dir", "set train.checkpoint_dir")


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML (what a run records next to its checkpoints)."""
    return OmegaConf.to_yaml(cfg)
