"""The recipe vocabulary (``specs/recipe_keys.yaml``): MindSpeed-style recipe keys -> a plan.

verl's Ascend recipes put MindSpeed's keys (``use_flash_attn``, ``use_fused_rmsnorm``,
``context_parallel_algo``, ...) and Megatron keys that need Transformer Engine
(``apply_rope_fusion``, ``moe_permute_fusion``) into ``override_transformer_config``; without
MindSpeed, ``TransformerConfig(**kwargs)`` raises on them. :func:`translate` reads the table and
splits a recipe's keys into what Megatron gets, what the NPU spec gets, what verl's optimizer
side gets, and one log line per key accepted with no effect. A refusal is one ``ValueError``
line: key, value, why, what to do instead. Pure: no verl import, no global state, the input
mapping is not changed.

``python -m mcore_npu.transformer.recipe_keys`` prints the table of docs/mindspeed.md.
"""

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

__all__ = [
    "RecipeContext",
    "RecipePlan",
    "load_table",
    "render_table",
    "translate",
]

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
        config_class: the model's Megatron config class (``TransformerConfig`` or a subclass such
            as ``MLATransformerConfig``); its fields pass through unchanged.
        num_layers: the model's decoder layers (for the stage layout).
        tensor_parallel_size, pipeline_parallel_size, context_parallel_size: verl's sizes.
        virtual_pipeline_size: verl's virtual pipeline size (None = 1).
        sequence_parallel: the value verl gives Megatron.
        use_distributed_optimizer: verl's engine setting (before the recipe).
        gated_delta_net: the model has gated-delta-net (linear-attention) layers (Qwen3.5,
            Qwen3-Next); the table's ``gdn`` outcomes depend on it.
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
        megatron: kwargs for ``TransformerConfig(**kwargs)`` (every key a field of the class).
        spec: keywords for ``get_gpt_decoder_block_npu_spec`` (``rope_kernel``, ...).
        optimizer: verl engine-config fields read by its DDP / optimizer
            (``use_distributed_optimizer``).
        optimizer_keys: Megatron ``OptimizerConfig`` keys a recipe key maps to
            (``swap_optimizer`` -> the CPU optimizer offload); the recipe's own
            ``override_optimizer_config`` keys win over them.
        log: one line per key that was accepted with no effect, switched off or translated.
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
    return {"do": "refuse", "why": f"the plugin accepts only {_listed(values)}",
            "instead": f"use one of {_listed(values)}"}  # fmt: skip


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
    return _refusal(
        key, value, f"not a field of Megatron's {context.config_class.__name__} and not in the "
        "plugin's recipe vocabulary (specs/recipe_keys.yaml)", hint
    )  # fmt: skip


def translate(
    overrides: Mapping, context: RecipeContext, *, table: dict | None = None
) -> RecipePlan:
    """Split ``override_transformer_config`` into a :class:`RecipePlan`.

    A key of the table follows the table; any other key that is a field of
    ``context.config_class`` passes to Megatron unchanged; anything else is refused with the
    closest known key suggested.

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
    _check_context_parallel(plan.megatron, context)
    return plan


def _check_context_parallel(megatron: dict, context: RecipeContext) -> None:
    """The recipe's context-parallel keys as the NPU attention will judge them
    (``context_parallel.rules``), refused here before a model is built."""
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
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: NPU spec {outcome['keyword']}="
                        f"{outcome['set']!r}")  # fmt: skip
    elif do == "cp":
        plan.megatron["cp_comm_type"] = outcome["set"]
        note = f" ({GDN_CP_NOTE})" if context.gated_delta_net else ""
        plan.log.append(f"{PREFIX}.{key}={value}: cp_comm_type={outcome['set']!r}{note}")
    elif do == "optimizer":
        plan.optimizer[outcome["field"]] = bool(_value_key(value))
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: verl's engine config "
                        f"{outcome['field']}")  # fmt: skip
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
    """A key whose outcome depends on gated-delta-net layers in the model: ``then`` on such a
    model, ``otherwise`` (or no effect and one log line, ``why``) on any other."""
    if context.gated_delta_net:
        _apply(plan, key, value, outcome["then"], context, fields)
    elif "otherwise" in outcome:
        _apply(plan, key, value, outcome["otherwise"], context, fields)
    else:
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: no effect: {outcome['why']}")


def _check_same_switch(plan: RecipePlan, key, value, outcome: dict) -> None:
    """Two spellings of one switch (``apply_rope_fusion`` / ``use_fused_rotary_pos_emb``) must
    not disagree."""
    keyword = outcome["keyword"]
    if keyword in plan.spec and plan.spec[keyword] != outcome["set"]:
        raise _refusal(
            key, value, f"an earlier key of the recipe set the same switch ({keyword}) the other "
            "way", "give the keys of one operator the same value"
        )  # fmt: skip


def _to_megatron(plan, key, value, outcome, context, fields) -> None:
    name = outcome.get("as", key)
    if name not in fields:
        instead = install_hint(name) or outcome.get("instead", "remove the key")
        why = (f"it maps to Megatron's {name}, which this model's config class "
               f"{context.config_class.__name__} does not have")  # fmt: skip
        raise _refusal(key, value, why, instead)
    plan.megatron[name] = value
    if name != key:
        plan.log.append(f"{PREFIX}.{key}={_spell(value)}: Megatron's {name}")


def _agree_with_verl(plan, key, value, verl_field: str, context: RecipeContext) -> None:
    """``context_parallel_size`` / ``sequence_parallel``: verl sets them; the recipe must agree."""
    ours = getattr(context, verl_field)
    theirs = _value_key(value)
    if verl_field == "sequence_parallel" and theirs is True and context.tensor_parallel_size == 1:
        plan.log.append(f"{PREFIX}.{key}=true: no effect at tensor-parallel size 1 (verl turns "
                        "sequence parallelism off there)")  # fmt: skip
        return
    if theirs != ours:
        raise _refusal(
            key, value, f"verl's own megatron.{verl_field} is {_spell(ours)} and the two must "
            "agree", f"set megatron.{verl_field}={_spell(theirs)} or drop the override key"
        )  # fmt: skip
    plan.log.append(f"{PREFIX}.{key}={_spell(value)}: agrees with verl's megatron.{verl_field}")


def _stages(plan, key, value, context: RecipeContext) -> None:
    if context.pipeline_parallel_size == 1:
        plan.log.append(f"{PREFIX}.{key}={value}: no effect at pipeline-parallel size 1 (one "
                        "stage holds every layer)")  # fmt: skip
        return
    plan.megatron[key] = value


def _layout(plan, key, value, context: RecipeContext) -> None:
    """Keep the per-stage list; :func:`_place_stage_list` places it once every key is read."""
    if isinstance(value, str):
        value = yaml.safe_load(value)  # "[[6],[8]]" from a command line
    plan.stage_list = (key, _plain(value))  # OmegaConf's ListConfig -> lists


def _place_stage_list(plan, context: RecipeContext) -> None:
    """The per-stage list as Megatron's keys. verl's Ascend recipes set the first / last stage
    counts beside it: they must be the list's own, and the list's keys replace all three."""
    if plan.stage_list is None:
        return
    from mcore_npu.transformer.pipeline_layout import resolve_stage_keys

    key, value = plan.stage_list
    first = plan.megatron.pop("num_layers_in_first_pipeline_stage", None)
    last = plan.megatron.pop("num_layers_in_last_pipeline_stage", None)
    try:
        kwargs = resolve_stage_keys(
            value, num_layers=context.num_layers, pipeline_size=context.pipeline_parallel_size,
            vpp_size=context.virtual_pipeline_size, first=first, last=last,
        )  # fmt: skip
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
        "megatron": lambda: "Megatron's `{}`".format(outcome.get("as", key)) + (
            " (refused where the model's config class lacks it)" if "as" in outcome else ""),
        "spec": lambda: f"NPU spec `{outcome['keyword']}={outcome['set']!r}`"
        + _SPEC_NOTES.get(outcome["set"], ""),
        "cp": lambda: f"Megatron's `cp_comm_type={outcome['set']!r}`",
        "optimizer": lambda: f"verl's `megatron.{outcome['field']}` (DDP and optimizer)",
        "offload": lambda: "the CPU optimizer offload, one log line: "
        + ", ".join(f"`{k}={_spell(v)}`" for k, v in outcome["set"].items()),
        "verl": lambda: f"must equal verl's `megatron.{outcome['field']}`; refused otherwise",
        "stages": lambda: "Megatron's uneven stages; no effect at pipeline size 1",
        "layout": lambda: "Megatron's stage layout (`megatron_stage_layout`); refused unless "
        "it adds up to `num_layers`",
        "off": lambda: "set to false, one log line: " + outcome["why"],
        "honour": lambda: "honoured, one log line: " + outcome["why"],
        "ignore": lambda: "no effect, one log line: " + outcome["why"],
        "refuse": lambda: f"**refused**: {outcome['why']}; {outcome['instead']}",
        "gdn": lambda: _describe_gdn(key, outcome),
    }[do]()  # fmt: skip
    return text.replace("|", "\\|")


_SPEC_NOTES = {None: " (= the spec's `kernel`)", "off": " (Megatron's own module)"}


def _describe_gdn(key: str, outcome: dict) -> str:
    other = (_describe(key, outcome["otherwise"]) if "otherwise" in outcome
             else f"no effect, one log line: {outcome['why']}")  # fmt: skip
    return (f"models with gated-delta-net layers: {_describe(key, outcome['then'])}; "
            f"other models: {other}")  # fmt: skip


if __name__ == "__main__":
    print(render_table(), end="")
