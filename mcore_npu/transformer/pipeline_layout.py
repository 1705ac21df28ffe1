"""Uneven pipeline stages: MindSpeed's per-stage layer list -> Megatron-Core's own config keys.

``pipeline_num_transformer_layers`` has one inner list per pipeline stage, one count per virtual
stage (``[[2, 2], [3, 3]]``), or is flat without virtual stages (``[6, 8, 8, 6]``); model order is
Megatron's interleaved order. ``megatron_stage_layout`` gives ``{}`` for an even list,
``num_layers_in_first/last_pipeline_stage`` where they can say it, else
``pipeline_model_parallel_layout`` (``[[1], [3], [0], [2]]`` -> ``"Et|ttt||ttL"``).
``resolve_stage_keys`` also takes the first/last counts a recipe sets beside the list. Pure Python:
nothing here imports Megatron. See docs/distributed.md."""

from __future__ import annotations

KEY = "pipeline_num_transformer_layers"
_FIRST, _LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"


class StageLayoutError(ValueError):
    """A per-stage layer list (or first/last stage count) that cannot work; ``problem`` and ``fix``
    kept apart so a caller can name its own key."""

    def __init__(self, key: str, value, problem: str, fix: str) -> None:
        self.key, self.value, self.problem, self.fix = key, value, problem, fix
        super().__init__(f"{key}={value!r}: {problem}; {fix}")


def megatron_stage_layout(per_stage, *, num_layers, pipeline_size, vpp_size=None) -> dict:
    """``TransformerConfig`` keywords that place ``per_stage`` (``pipeline_size`` inner lists of
    ``vpp_size`` counts, or a flat list) decoder layers: ``{}`` for an even split, else the
    first/last stage counts, else ``pipeline_model_parallel_layout``.

    Raises:
        StageLayoutError (a ValueError): the list's shape, a count, or its sum does not fit.
    """
    sizes = dict(num_layers=num_layers, pipeline_size=pipeline_size, vpp_size=vpp_size)
    stages = normalized_stages(per_stage, **sizes)
    flat = [count for stage in stages for count in stage]
    if len(set(flat)) == 1:
        return {}
    first_last = _first_last(stages)
    if first_last is not None:
        return first_last
    return {"pipeline_model_parallel_layout": layout_string(stages)}


def resolve_stage_keys(
    per_stage, *, num_layers, pipeline_size, vpp_size=None, first=None, last=None
) -> dict:
    """``megatron_stage_layout`` for a recipe that may also set the first/last stage counts.

    Megatron refuses a layout beside first/last counts, so ``first`` / ``last`` must be the list's
    own first and last stage totals; the returned keys replace all three. ``per_stage`` None: only
    ``first`` / ``last``, checked as Megatron checks them."""
    if per_stage is None:
        stages_from_first_last(first, last, num_layers=num_layers, pipeline_size=pipeline_size)
        given = {_FIRST: first, _LAST: last}
        return {key: value for key, value in given.items() if value is not None}
    sizes = dict(num_layers=num_layers, pipeline_size=pipeline_size, vpp_size=vpp_size)
    stages = normalized_stages(per_stage, **sizes)
    for key, count, stage in ((_FIRST, first, stages[0]), (_LAST, last, stages[-1])):
        if count is not None and count != sum(stage):
            problem = f"disagrees with {KEY}={per_stage!r}, whose stage holds {sum(stage)} layers"
            fix = f"make it {sum(stage)}, or leave it out (the list says it)"
            raise StageLayoutError(key, count, problem, fix)
    return megatron_stage_layout(per_stage, **sizes)


def normalized_stages(per_stage, *, num_layers, pipeline_size, vpp_size=None) -> list[list[int]]:
    """``per_stage`` as ``pipeline_size`` lists of ``vpp_size`` counts, checked."""
    _check_sizes(num_layers, pipeline_size, vpp_size)
    virtual = vpp_size or 1
    if isinstance(per_stage, (str, bytes)) or not isinstance(per_stage, (list, tuple)):
        fix = "pass e.g. [[6], [8], [8], [6]] (one inner list per pipeline stage) or [6, 8, 8, 6]"
        raise StageLayoutError(KEY, per_stage, "is not a list of per-stage layer counts", fix)
    if len(per_stage) != pipeline_size:
        problem = f"has {len(per_stage)} stages but the pipeline parallel size is {pipeline_size}"
        fix = f"give one entry per pipeline stage ({pipeline_size}), or change the pipeline parallel size"
        raise StageLayoutError(KEY, per_stage, problem, fix)
    stages = [_stage_counts(per_stage, entry, virtual) for entry in per_stage]
    total = sum(sum(stage) for stage in stages)
    if total != num_layers:
        problem = f"adds up to {total} layers but num_layers is {num_layers}"
        fix = f"make the counts add up to {num_layers}, or set num_layers to {total}"
        raise StageLayoutError(KEY, per_stage, problem, fix)
    return stages


def stages_from_first_last(first, last, *, num_layers, pipeline_size) -> list[int]:
    """Per-stage counts that ``first`` / ``last`` (None: as the middle stages) mean, checked as
    Megatron checks them, with the key named."""
    _check_sizes(num_layers, pipeline_size, None)
    for key, count in {_FIRST: first, _LAST: last}.items():
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            fix = "give a positive count, or null for an even split"
            raise StageLayoutError(key, count, "must be a whole number of layers >= 1", fix)
        if pipeline_size < 2:
            fix = "set a pipeline size of 2 or more, or leave it null"
            raise StageLayoutError(key, count, "needs a pipeline parallel size > 1", fix)
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pipeline_size - (first is not None) - (last is not None)
    key, value = "num_layers", num_layers
    if last is not None:
        key, value = _LAST, last
    if first is not None:
        key, value = _FIRST, first
    if middle_stages == 0 and middle_layers != 0:
        problem = (
            f"the first and last stages ({first} and {last} layers) hold "
            f"{num_layers - middle_layers} of {num_layers} layers and there is no middle stage"
        )
        raise StageLayoutError(key, value, problem, f"make them add up to {num_layers}")
    if middle_stages and (middle_layers < middle_stages or middle_layers % middle_stages):
        problem = (
            f"leaves {middle_layers} of {num_layers} layers for {middle_stages} middle "
            "stage(s), which does not split into equal counts >= 1"
        )
        fix = (
            "choose first/last counts that leave a multiple of the middle stages, or use "
            "pipeline_num_transformer_layers"
        )
        raise StageLayoutError(key, value, problem, fix)
    middle = [middle_layers // middle_stages] * middle_stages if middle_stages else []
    return [*([first] if first is not None else []), *middle, *([last] if last is not None else [])]


def layout_string(stages: list[list[int]]) -> str:
    """Megatron's ``pipeline_model_parallel_layout`` for checked ``stages``: entries in model order
    (virtual stage, then pipeline stage), ``E`` first, ``L`` last."""
    virtual = len(stages[0])
    entries = [("t" * stages[p][v]) for v in range(virtual) for p in range(len(stages))]
    entries[0] = "E" + entries[0]
    entries[-1] = entries[-1] + "L"
    return "|".join(entries)


def _first_last(stages: list[list[int]]) -> dict | None:
    """First/last stage counts that say the same as ``stages``, or None where they cannot."""
    if any(len(set(stage)) != 1 or stage[0] < 1 for stage in stages):
        return None  # a stage of 0 layers, or virtual stages of different sizes
    totals = [sum(stage) for stage in stages]
    if len(totals) == 2:
        return {"num_layers_in_first_pipeline_stage": totals[0]}
    middle = set(totals[1:-1])
    if len(middle) != 1:
        return None
    (each,) = middle
    fields = {}
    if totals[0] != each:
        fields["num_layers_in_first_pipeline_stage"] = totals[0]
    if totals[-1] != each:
        fields["num_layers_in_last_pipeline_stage"] = totals[-1]
    return fields


def _stage_counts(per_stage, entry, virtual: int) -> list[int]:
    counts = list(entry) if isinstance(entry, (list, tuple)) else [entry]
    if not isinstance(entry, (list, tuple)) and virtual > 1:
        problem = f"is a flat list but there are {virtual} virtual stages"
        fix = f"give one inner list of {virtual} counts per pipeline stage, e.g. [[2, 2], [3, 3]]"
        raise StageLayoutError(KEY, per_stage, problem, fix)
    if len(counts) != virtual:
        problem = f"stage entry {entry!r} has {len(counts)} counts but there are {virtual} virtual stage(s)"
        fix = f"give {virtual} count(s) per pipeline stage"
        raise StageLayoutError(KEY, per_stage, problem, fix)
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            problem = f"{count!r} is not a layer count"
            raise StageLayoutError(KEY, per_stage, problem, "use whole numbers >= 0")
    return counts


def _check_sizes(num_layers, pipeline_size, vpp_size) -> None:
    vpp_size = 1 if vpp_size is None else vpp_size
    sizes = {"num_layers": num_layers, "pipeline_size": pipeline_size, "vpp_size": vpp_size}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fix = f"pass the model's {name}"
            raise StageLayoutError(name, value, "must be a whole number >= 1", fix)
