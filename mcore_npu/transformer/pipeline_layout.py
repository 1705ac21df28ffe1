"""Uneven pipeline stages: MindSpeed's per-stage layer list -> Megatron-Core's own config keys.

MindSpeed's ``pipeline_num_transformer_layers`` gives the decoder layers of every pipeline stage:
one inner list per pipeline stage, one count per virtual stage (``[[6], [8], [8], [6]]``: 4
stages, no virtual pipeline; ``[[2, 2], [3, 3]]``: 2 stages of 2 virtual stages each). A flat list
(``[6, 8, 8, 6]``) is one count per stage without virtual stages. Model order is Megatron's
interleaved order: virtual stage 0 of every pipeline stage, then virtual stage 1, ...

Megatron-Core 0.16.1 has two ways to say the same thing, and ``megatron_stage_layout`` picks:

- ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` where they can
  express the list: the middle stages all hold the same count, and each stage holds the same
  count in each of its virtual stages (Megatron spreads a stage's layers evenly over them).
  These are the keys Megatron-LM's ``--decoder-first-pipeline-num-layers`` /
  ``--decoder-last-pipeline-num-layers`` set and that checkpoint converters know best; Megatron
  checks them with ``ValueError`` s. Only the keys that differ from the middle count are set, and
  with 2 stages only the first (Megatron 0.16.1 divides by the number of middle stages when both
  are set with a virtual pipeline, which is 0 there).
- ``pipeline_model_parallel_layout`` otherwise (a stage of 0 layers, middle stages that differ,
  virtual stages of one stage that differ): Megatron's general layout string, one ``|``-separated
  entry per (virtual stage, pipeline stage) in model order, ``E`` the embedding on the first
  entry, ``t`` a decoder layer, ``L`` the loss on the last entry: ``[[1], [3], [0], [2]]`` ->
  ``"Et|ttt||ttL"``.

An even list gives ``{}`` (Megatron's default split). verl's Ascend recipes also set the first
and last stage counts beside the list; ``resolve_stage_keys`` checks that they are the list's own
and returns the keys that replace all three. Pure Python: nothing here imports Megatron.
"""

from __future__ import annotations

KEY = "pipeline_num_transformer_layers"


class StageLayoutError(ValueError):
    """A per-stage layer list (or first/last stage count) that cannot work.

    ``problem`` and ``fix`` are kept apart so that a caller can name its own key (the trainer's
    YAML path) while the message of the plain ``ValueError`` names ``key``.
    """

    def __init__(self, key: str, value, problem: str, fix: str) -> None:
        self.key, self.value, self.problem, self.fix = key, value, problem, fix
        super().__init__(f"{key}={value!r}: {problem}; {fix}")


def megatron_stage_layout(per_stage, *, num_layers, pipeline_size, vpp_size=None) -> dict:
    """``TransformerConfig`` keyword arguments that place ``per_stage`` decoder layers per stage.

    Args:
        per_stage: MindSpeed's ``pipeline_num_transformer_layers``: ``pipeline_size`` inner lists
            of ``vpp_size`` (1 if None) layer counts each, or a flat list of ``pipeline_size``
            counts (no virtual pipeline).
        num_layers: the model's decoder layers (``TransformerConfig.num_layers``); the counts
            must add up to it.
        pipeline_size: ``pipeline_model_parallel_size``.
        vpp_size: ``virtual_pipeline_model_parallel_size`` (None or 1: no virtual pipeline).

    Returns:
        ``{}`` for an even split, else ``num_layers_in_first_pipeline_stage`` and/or
        ``num_layers_in_last_pipeline_stage``, else ``pipeline_model_parallel_layout`` (a
        string). ``num_layers``, ``pipeline_model_parallel_size`` and
        ``virtual_pipeline_model_parallel_size`` stay the caller's to set.

    Raises:
        StageLayoutError (a ValueError): the list's shape, a count, or its sum does not fit.
    """
    stages = normalized_stages(per_stage, num_layers=num_layers, pipeline_size=pipeline_size,
                               vpp_size=vpp_size)  # fmt: skip
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

    verl's Ascend recipes set ``pipeline_num_transformer_layers=[[11],[13],[13],[11]]`` together
    with ``num_layers_in_first_pipeline_stage=11`` and ``num_layers_in_last_pipeline_stage=11``.
    Megatron refuses a ``pipeline_model_parallel_layout`` beside first/last counts, and two keys
    that disagree would leave one of them silently unused; so the counts given must be the list's
    own first and last stage totals, and the returned keys replace all three.

    Args:
        per_stage, num_layers, pipeline_size, vpp_size: as for ``megatron_stage_layout``;
            ``per_stage`` None = only ``first`` / ``last`` (checked as Megatron checks them).
        first, last: the recipe's ``num_layers_in_first/last_pipeline_stage``, or None.

    Returns:
        The ``TransformerConfig`` keys to set instead of the recipe's three (``{}`` = even).

    Raises:
        StageLayoutError: as ``megatron_stage_layout``; or a first/last count that is not the
            list's.
    """
    if per_stage is None:
        stages_from_first_last(first, last, num_layers=num_layers, pipeline_size=pipeline_size)
        given = {"num_layers_in_first_pipeline_stage": first,
                 "num_layers_in_last_pipeline_stage": last}  # fmt: skip
        return {key: value for key, value in given.items() if value is not None}
    stages = normalized_stages(per_stage, num_layers=num_layers, pipeline_size=pipeline_size,
                               vpp_size=vpp_size)  # fmt: skip
    for key, count, stage in (("num_layers_in_first_pipeline_stage", first, stages[0]),
                              ("num_layers_in_last_pipeline_stage", last, stages[-1])):  # fmt: skip
        if count is not None and count != sum(stage):
            raise StageLayoutError(key, count, f"disagrees with {KEY}={per_stage!r}, whose stage "
                                   f"holds {sum(stage)} layers", f"make it {sum(stage)}, or "
                                   "leave it out (the list says it)")  # fmt: skip
    return megatron_stage_layout(per_stage, num_layers=num_layers, pipeline_size=pipeline_size,
                                 vpp_size=vpp_size)  # fmt: skip


def normalized_stages(per_stage, *, num_layers, pipeline_size, vpp_size=None) -> list[list[int]]:
    """``per_stage`` as ``pipeline_size`` lists of ``vpp_size`` counts, checked (see
    ``megatron_stage_layout``)."""
    _check_sizes(num_layers, pipeline_size, vpp_size)
    virtual = vpp_size or 1
    if isinstance(per_stage, (str, bytes)) or not isinstance(per_stage, (list, tuple)):
        raise StageLayoutError(KEY, per_stage, "is not a list of per-stage layer counts",
                               "pass e.g. [[6], [8], [8], [6]] (one inner list per pipeline "
                               "stage) or [6, 8, 8, 6]")  # fmt: skip
    if len(per_stage) != pipeline_size:
        raise StageLayoutError(KEY, per_stage, f"has {len(per_stage)} stages but the pipeline "
                               f"parallel size is {pipeline_size}", f"give one entry per "
                               f"pipeline stage ({pipeline_size}), or change the pipeline "
                               "parallel size")  # fmt: skip
    stages = [_stage_counts(per_stage, entry, virtual) for entry in per_stage]
    total = sum(sum(stage) for stage in stages)
    if total != num_layers:
        raise StageLayoutError(KEY, per_stage, f"adds up to {total} layers but num_layers is "
                               f"{num_layers}", f"make the counts add up to {num_layers}, or "
                               f"set num_layers to {total}")  # fmt: skip
    return stages


def stages_from_first_last(first, last, *, num_layers, pipeline_size) -> list[int]:
    """Per-stage counts that ``num_layers_in_first/last_pipeline_stage`` mean (no virtual
    pipeline), checked as Megatron checks them, with the key named.

    Args:
        first, last: layers of the first / last stage, or None (= as the middle stages).
        num_layers, pipeline_size: as for ``megatron_stage_layout``.

    Raises:
        StageLayoutError: a count below 1, a stage size of 1, or middle layers that do not
            split evenly over the middle stages.
    """
    _check_sizes(num_layers, pipeline_size, None)
    given = {"num_layers_in_first_pipeline_stage": first,
             "num_layers_in_last_pipeline_stage": last}  # fmt: skip
    for key, count in given.items():
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise StageLayoutError(key, count, "must be a whole number of layers >= 1",
                                   "give a positive count, or null for an even split")  # fmt: skip
        if pipeline_size < 2:
            raise StageLayoutError(key, count, "needs a pipeline parallel size > 1",
                                   "set a pipeline size of 2 or more, or leave it null")  # fmt: skip
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pipeline_size - (first is not None) - (last is not None)
    key, value = "num_layers", num_layers
    if last is not None:
        key, value = "num_layers_in_last_pipeline_stage", last
    if first is not None:
        key, value = "num_layers_in_first_pipeline_stage", first
    if middle_stages == 0 and middle_layers != 0:
        raise StageLayoutError(key, value, f"the first and last stages ({first} and {last} "
                               f"layers) hold {num_layers - middle_layers} of {num_layers} "
                               "layers and there is no middle stage",
                               f"make them add up to {num_layers}")  # fmt: skip
    if middle_stages and (middle_layers < middle_stages or middle_layers % middle_stages):
        raise StageLayoutError(key, value, f"leaves {middle_layers} of {num_layers} layers for "
                               f"{middle_stages} middle stage(s), which does not split into "
                               "equal counts >= 1", "choose first/last counts that leave a "
                               "multiple of the middle stages, or use "
                               "pipeline_num_transformer_layers")  # fmt: skip
    middle = [middle_layers // middle_stages] * middle_stages if middle_stages else []
    return [*([first] if first is not None else []), *middle, *([last] if last is not None else [])]


def layout_string(stages: list[list[int]]) -> str:
    """Megatron's ``pipeline_model_parallel_layout`` string for checked ``stages`` (pipeline
    stage -> counts per virtual stage): entries in model order (virtual stage, then pipeline
    stage), ``E`` first, ``L`` last."""
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
        raise StageLayoutError(KEY, per_stage, f"is a flat list but there are {virtual} "
                               "virtual stages", f"give one inner list of {virtual} counts per "
                               "pipeline stage, e.g. [[2, 2], [3, 3]]")  # fmt: skip
    if len(counts) != virtual:
        raise StageLayoutError(KEY, per_stage, f"stage entry {entry!r} has {len(counts)} "
                               f"counts but there are {virtual} virtual stage(s)",
                               f"give {virtual} count(s) per pipeline stage")  # fmt: skip
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise StageLayoutError(KEY, per_stage, f"{count!r} is not a layer count",
                                   "use whole numbers >= 0")  # fmt: skip
    return counts


def _check_sizes(num_layers, pipeline_size, vpp_size) -> None:
    for name, value in (("num_layers", num_layers), ("pipeline_size", pipeline_size),
                        ("vpp_size", 1 if vpp_size is None else vpp_size)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StageLayoutError(name, value, "must be a whole number >= 1",
                                   f"pass the model's {name}")  # fmt: skip
