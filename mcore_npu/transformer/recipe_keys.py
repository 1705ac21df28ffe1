"""The recipe vocabulary (``specs/recipe_keys.yaml``): MindSpeed-style recipe keys -> a plan.

verl's Ascend recipes put MindSpeed's keys and TE-only Megatron keys into
``override_transformer_config``. :func:`translate` splits them into what Megatron, the NPU spec and
verl's optimizer side get, with one log line per key accepted with no effect; a refusal is one
``ValueError`` line: key, value, why, what to do instead. Pure: no verl import, no global state.
``python -m mcore_npu.transformer.recipe_keys`` prints the table of docs/mindspeed.md."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from mcore_npu.transformer.megatron_features import install_hint

__all__ = ["RecipeContext", "RecipePlan", "load_table", "render_table", "translate"]

TABLE = Path(str(resources.files("mcore_npu").joinpath("specs/recipe_keys.yaml")))
"""``specs/recipe_keys.yaml`` (``mcore_npu/specs`` links to the top-level ``specs/``)."""

PREFIX = "override_transformer_config"
GDN_CP_NOTE = (
    "the full-attention layers; the gated-delta-net layers run context parallelism by "
    "all-to-all (sequence <-> heads) whatever the key says"
)


@dataclass(frozen=True)
class RecipeContext:
    """What the translation needs to know about the run (verl's side of it).

    Attributes:
        config_class: the model's Megatron config class; its fields pass through unchanged.
        num_layers: the model's decoder layers (for the stage layout).
        virtual_pipeline_size: None = 1.
        use_distributed_optimizer: verl's engine setting (before the recipe).
        gated_delta_net: the model has gated-delta-net layers; the table's ``gdn`` outcomes depend
            on it.
    """

    config_class: type
    num_layers: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    virtual_pipeline_size: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    gated_delta_net: bool = False


@dataclass
class RecipePlan:
    """The translated recipe.

    Attributes:
        megatron: kwargs for ``TransformerConfig(**kwargs)``.
        spec: keywords for ``get_gpt_decoder_block_npu_spec``.
        optimizer: verl engine-config fields (``use_distributed_optimizer``).
        optimizer_keys: Megatron ``OptimizerConfig`` keys a recipe key maps to; the recipe's own
            ``override_optimizer_config`` keys win.
        log: one line per key accepted with no effect, switched off or translated.
    """

    megatron: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    optimizer_keys: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    stage_list: tuple | None = None  # (key, MindSpeed's per-stage list) until every key is read


@lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict:
    """``{key: {"from": ..., "values": {...}, "any": {...}}}`` from the YAML table."""
    data = yaml.safe_load(Path(path or TABLE).read_text())
    return data["keys"]


def _value_key(value) -> object:
    """The table's spelling of a value: YAML booleans stay booleans; strings as they are."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _outcome(entry: dict, value) -> dict:
    values = entry.get("values") or {}
    want = _value_key(value)
    for spelled, outcome in values.items():
        if _value_key(spelled) == want and type(_value_key(spelled)) is type(want):
            return outcome
    if "any" in entry:
        return entry["any"]
    listed = _listed(values)
    return {
        "do": "refuse",
        "why": f"the plugin accepts only {listed}",
        "instead": f"use one of {listed}",
    }


def _listed(values: Mapping) -> str:
    return ", ".join(_spell(v) for v in values)


def _spell(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _refusal(key: str, value, why: str, instead: str) -> ValueError:
    return ValueError(f"{PREFIX}.{key}={_spell(value)}: refused: {why}; {instead}")


def _fields(config_class: type) -> set[str]:
    return {f.name for f in dataclasses.fields(config_class) if f.init}


def _unknown(key: str, value, context: RecipeContext, table: dict) -> ValueError:
    known = sorted(_fields(context.config_class) | set(table))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else "remove the key"
    hint = install_hint(key) or hint  # a field of another megatron-core: name that version
    why = (
        f"not a field of Megatron's {context.config_class.__name__} and not in the "
        "plugin's recipe vocabulary (specs/recipe_keys.yaml)"
    )
    return _refusal(key, value, why, hint)


def translate(
    overrides: Mapping, context: RecipeContext, *, table: dict | None = None
) -> RecipePlan:
    """Split ``override_transformer_config`` into a :class:`RecipePlan`: a table key follows the
    table, a field of ``context.config_class`` passes unchanged, anything else is refused.

    Raises:
        ValueError: the first refused key, as one line (key, value, why, what to use instead).
    """
    table = load_table() if table is None else table
    plan, fields = RecipePlan(), _fields(context.config_class)
    for key, value in overrides.items():
        if key in table:
            _apply(plan, key, value, _outcome(table[key], value), context, fields)
        elif key in fields:
            plan.megatron[key] = value
        else:
            raise _unknown(key, value, context, table)
    _place_stage_list(plan, context)
    _check_switch_keys_agree(plan, overrides, table)
    _check_batch_invariant(plan, overrides, context)
    _check_sparse_attention_cp(plan, overrides)
    _check_context_parallel(plan.megatron, context)
    return plan


def _check_switch_keys_agree(plan: RecipePlan, overrides: Mapping, table: dict) -> None:
    """A key set false whose ``true`` turns on a spec switch another key turned on (the three
    batch-invariant keys): refused, the mode is one switch."""
    for key, value in overrides.items():
        on = ((table.get(key) or {}).get("values") or {}).get(True) or {}
        if on.get("do") != "spec" or _value_key(value) is not False:
            continue
        if on["keyword"] in plan.spec and plan.spec[on["keyword"]] == on["set"]:
            why = f"another key of the recipe turned {on['keyword']} on, and it is one switch"
            raise _refusal(key, value, why, "give the keys of one switch the same value")


def _check_batch_invariant(plan: RecipePlan, overrides: Mapping, context: RecipeContext) -> None:
    """Batch-invariant mode's limits that the recipe itself shows (context parallelism,
    attention dropout, a sliding window), before any model is built; the layers check the rest
    (head dim, mask type, the NPU kernel) when they are built."""
    if not plan.spec.get("batch_invariant"):
        return
    from mcore_npu.ops.batch_invariant import check_limits

    key = next(k for k in overrides if k in _BATCH_INVARIANT_KEYS and _value_key(overrides[k]))
    megatron = plan.megatron
    try:
        check_limits(
            context_parallel_size=context.context_parallel_size,
            dropout=megatron.get("attention_dropout") or 0.0,
            window=megatron.get("window_size"),
        )
    except ValueError as error:  # one line: "batch-invariant mode does not support ...: use ..."
        raise _refusal(key, overrides[key], str(error), "or turn the mode off") from None


_BATCH_INVARIANT_KEYS = (
    "use_flash_attn_npu_batch_invariant",
    "batch_invariant_mode",
    "use_batch_invariant_ops",
)


DSA_CP_NOTE = "DSA layers run context parallelism by K/V all-gather only"


def _check_sparse_attention_cp(plan: RecipePlan, overrides: Mapping) -> None:
    """With DSA layers (``experimental_attention_variant=dsa``): a CP algorithm the DSA layer
    refuses (anything but all-gather) is refused here, at any CP size, naming the recipe key that
    chose it; all-gather's log line says it is DSA's one algorithm."""
    from mcore_npu.transformer.dsa.settings import check_cp_comm_type, is_dsa

    megatron = plan.megatron
    chosen = megatron.get("cp_comm_type")
    if not is_dsa(megatron) or chosen is None:
        return
    key = "context_parallel_algo" if "context_parallel_algo" in overrides else "cp_comm_type"
    for comm_type in [chosen] if isinstance(chosen, str) else chosen:
        try:
            check_cp_comm_type(comm_type)
        except ValueError:
            why = f"it selects cp_comm_type={comm_type!r}, and {DSA_CP_NOTE}"
            raise _refusal(
                key, overrides[key], why, "use kvallgather_cp_algo (all_gather)"
            ) from None
    start = f"{PREFIX}.{key}="
    plan.log = [f"{line} ({DSA_CP_NOTE})" if line.startswith(start) else line for line in plan.log]


def _check_context_parallel(megatron: dict, context: RecipeContext) -> None:
    """The recipe's CP keys as ``context_parallel.rules`` judges them."""
    from mcore_npu.transformer.context_parallel import rules

    if context.context_parallel_size <= 1:
        return
    size = context.context_parallel_size
    hierarchical = megatron.get("hierarchical_context_parallel_sizes")
    if hierarchical:  # Megatron's a2a+p2p
        _, problem, fix = rules.not_supported_reasons("a2a+p2p", size)[0].render()
        raise _refusal("hierarchical_context_parallel_sizes", hierarchical, problem, fix)
    comm_types = megatron.get("cp_comm_type") or "p2p"
    facts = dict(
        dropout=megatron.get("attention_dropout") or 0.0, window=megatron.get("window_size")
    )
    for comm_type in [comm_types] if isinstance(comm_types, str) else comm_types:
        reasons = rules.not_supported_reasons(comm_type, size, **facts)
        if reasons:
            key, problem, fix = reasons[0].render()
            raise _refusal(key, reasons[0].value, problem, fix)


def _apply(plan: RecipePlan, key, value, outcome: dict, context: RecipeContext, fields) -> None:
    """One table key's outcome into ``plan`` (see the header of ``specs/recipe_keys.yaml``)."""
    do = outcome["do"]
    if do == "gdn":
        _gdn(plan, key, value, outcome, context, fields)
    elif do == "refuse":
        raise _refusal(key, value, outcome["why"], outcome["instead"])
    elif do == "megatron":
        _to_megatron(plan, key, value, outcome, context, fields)
    elif do == "spec":
        _check_same_switch(plan, key, value, outcome)
        plan.spec[outcome["keyword"]] = outcome["set"]
        setting = f"{outcome['keyword']}={outcome['set']!r}"
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: NPU spec {setting}")
    elif do == "cp":
        plan.megatron["cp_comm_type"] = outcome["set"]
        note = f" ({GDN_CP_NOTE})" if context.gated_delta_net else ""
        plan.log.append(f"{PREFIX}.{key}={value}: cp_comm_type={outcome['set']!r}{note}")
    elif do == "optimizer":
        plan.optimizer[outcome["field"]] = bool(_value_key(value))
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: verl's engine config {outcome['field']}")
    elif do == "offload":
        plan.optimizer_keys.update(outcome["set"])
        keys = ", ".join(f"{k}={_spell(v)}" for k, v in outcome["set"].items())
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: {keys} ({outcome['why']})")
    elif do == "verl":
        _agree_with_verl(plan, key, value, outcome["field"], context)
    elif do == "stages":
        _stages(plan, key, value, context)
    elif do == "layout":
        _layout(plan, key, value, context)
    elif do in ("off", "ignore", "honour"):
        if do == "off":
            plan.megatron[key] = False
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: {outcome['why']}")
    else:  # the table's own error: say which entry
        raise ValueError(f"specs/recipe_keys.yaml: {key}: unknown outcome do={do!r}")


def _gdn(plan: RecipePlan, key, value, outcome: dict, context: RecipeContext, fields) -> None:
    """A key whose outcome depends on gated-delta-net layers: ``then`` on such a model,
    ``otherwise`` (or one log line, ``why``) on any other."""
    if context.gated_delta_net:
        _apply(plan, key, value, outcome["then"], context, fields)
    elif "otherwise" in outcome:
        _apply(plan, key, value, outcome["otherwise"], context, fields)
    else:
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: no effect: {outcome['why']}")


def _check_same_switch(plan: RecipePlan, key, value, outcome: dict) -> None:
    """Two spellings of one switch must not disagree."""
    keyword = outcome["keyword"]
    if keyword in plan.spec and plan.spec[keyword] != outcome["set"]:
        why = f"an earlier key of the recipe set the same switch ({keyword}) the other way"
        raise _refusal(key, value, why, "give the keys of one operator the same value")


def _to_megatron(plan, key, value, outcome, context, fields) -> None:
    name = outcome.get("as", key)
    if name not in fields:
        instead = install_hint(name) or outcome.get("instead", "remove the key")
        why = (
            f"it maps to Megatron's {name}, which this model's config class "
            f"{context.config_class.__name__} does not have"
        )
        raise _refusal(key, value, why, instead)
    plan.megatron[name] = value
    if name != key:
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: Megatron's {name}")


def _agree_with_verl(plan, key, value, verl_field: str, context: RecipeContext) -> None:
    """``context_parallel_size`` / ``sequence_parallel``: verl sets them; the recipe must agree."""
    ours = getattr(context, verl_field)
    theirs = _value_key(value)
    if verl_field == "sequence_parallel" and theirs is True and context.tensor_parallel_size == 1:
        why = "no effect at tensor-parallel size 1 (verl turns sequence parallelism off there)"
        plan.log.append(f"{PREFIX}.{key}=true: {why}")
        return
    if theirs != ours:
        why = f"verl's own megatron.{verl_field} is {_spell(ours)} and the two must agree"
        instead = f"set megatron.{verl_field}={_spell(theirs)} or drop the override key"
        raise _refusal(key, value, why, instead)
    plan.log.append(f"{PREFIX}.{key}={_spell(value)}: agrees with verl's megatron.{verl_field}")


def _stages(plan, key, value, context: RecipeContext) -> None:
    if context.pipeline_parallel_size == 1:
        why = "no effect at pipeline-parallel size 1 (one stage holds every layer)"
        plan.log.append(f"{PREFIX}.{key}={value}: {why}")
        return
    plan.megatron[key] = value


def _layout(plan, key, value, context: RecipeContext) -> None:
    """Keep the per-stage list; :func:`_place_stage_list` places it once every key is read."""
    if isinstance(value, str):
        value = yaml.safe_load(value)  # "[[6],[8]]" from a command line
    plan.stage_list = (key, _plain(value))  # OmegaConf's ListConfig -> lists


def _place_stage_list(plan, context: RecipeContext) -> None:
    """The per-stage list as Megatron's keys; first / last stage counts beside it must be the list's
    own."""
    if plan.stage_list is None:
        return
    from mcore_npu.transformer.pipeline_layout import resolve_stage_keys

    key, value = plan.stage_list
    first = plan.megatron.pop("num_layers_in_first_pipeline_stage", None)
    last = plan.megatron.pop("num_layers_in_last_pipeline_stage", None)
    try:
        sizes = dict(num_layers=context.num_layers, pipeline_size=context.pipeline_parallel_size)
        kwargs = resolve_stage_keys(
            value, **sizes, vpp_size=context.virtual_pipeline_size, first=first, last=last
        )
    except ValueError as error:  # one line: the recipe key, its value, the layout's reason
        named = getattr(error, "key", key)
        why = getattr(error, "problem", str(error))
        instead = getattr(error, "fix", "fix the list")
        raise _refusal(named, getattr(error, "value", value), why, instead) from None
    plan.megatron.update(kwargs)
    plan.log.append(f"{PREFIX}.{key}={value}: Megatron's stage layout {kwargs or '(one stage)'}")


def _plain(value):
    """Nested sequences (OmegaConf ``ListConfig`` included) as plain lists; the rest unchanged."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(item) for item in value]
    return value


def render_table(table: dict | None = None) -> str:
    """The markdown table of docs/mindspeed.md: one row per key and value."""
    table = load_table() if table is None else table
    rows = ["| key | value | what the plugin does |", "|---|---|---|"]
    for key, entry in table.items():
        for value, outcome in (entry.get("values") or {}).items():
            rows.append(f"| `{key}` | `{_spell(value)}` | {_describe(key, outcome)} |")
        if "any" in entry:
            label = "any other" if entry.get("values") else "any"
            rows.append(f"| `{key}` | {label} | {_describe(key, entry['any'])} |")
    return "\n".join(rows) + "\n"


def _describe(key: str, outcome: dict) -> str:
    do = outcome["do"]
    text = {
        "megatron": lambda: (
            "Megatron's `{}`".format(outcome.get("as", key))
            + (" (refused where the model's config class lacks it)" if "as" in outcome else "")
        ),
        "spec": lambda: (
            f"NPU spec `{outcome['keyword']}={outcome['set']!r}`"
            + _KEYWORD_NOTES.get(outcome["keyword"], _SPEC_NOTES.get(outcome["set"], ""))
        ),
        "cp": lambda: _describe_cp(outcome["set"]),
        "optimizer": lambda: f"verl's `megatron.{outcome['field']}` (DDP and optimizer)",
        "offload": lambda: (
            "the CPU optimizer offload, one log line: "
            + ", ".join(f"`{k}={_spell(v)}`" for k, v in outcome["set"].items())
        ),
        "verl": lambda: f"must equal verl's `megatron.{outcome['field']}`; refused otherwise",
        "stages": lambda: "Megatron's uneven stages; no effect at pipeline size 1",
        "layout": lambda: (
            "Megatron's stage layout (`megatron_stage_layout`); refused unless "
            "it adds up to `num_layers`"
        ),
        "off": lambda: "set to false, one log line: " + outcome["why"],
        "honour": lambda: "honoured, one log line: " + outcome["why"],
        "ignore": lambda: "no effect, one log line: " + outcome["why"],
        "refuse": lambda: f"**refused**: {outcome['why']}; {outcome['instead']}",
        "gdn": lambda: _describe_gdn(key, outcome),
    }[do]()
    return text.replace("|", "\\|")


_SPEC_NOTES = {
    None: " (= the spec's `kernel`)",
    "off": " (Megatron's own module)",
    "auto": " (the torch_npu kernel where it runs, the registry's fallback elsewhere)",
    "reference": " (the PyTorch reference)",
}
_KEYWORD_NOTES = {
    "batch_invariant": (
        " (batch-invariant mode: flash_attn_npu's fixed-split attention and vllm-ascend's "
        "batch_invariant_ops matmuls and sums on an NPU, fixed-block references elsewhere; "
        "docs/true_on_policy.md)"
    )
}


def _describe_cp(comm_type: str) -> str:
    from mcore_npu.transformer.dsa.settings import check_cp_comm_type

    text = f"Megatron's `cp_comm_type={comm_type!r}`"
    try:
        check_cp_comm_type(comm_type)
    except ValueError:
        text += "; refused with DSA layers (all-gather only)"
    return text


def _describe_gdn(key: str, outcome: dict) -> str:
    if "otherwise" in outcome:
        other = _describe(key, outcome["otherwise"])
    else:
        other = f"no effect, one log line: {outcome['why']}"
    then = _describe(key, outcome["then"])
    return f"models with gated-delta-net layers: {then}; other models: {other}"


if __name__ == "__main__":
    print(render_table(), end="")
