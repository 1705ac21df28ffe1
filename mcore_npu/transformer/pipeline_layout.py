"""MindSpeed's per-stage layer list -> Megatron's uneven pipeline layout (TransformerConfig kwargs).

MindSpeed's ``pipeline_num_transformer_layers`` lists the decoder layers of each pipeline stage,
``[[6], [8], [8], [6]]`` (one inner list per stage, one entry per virtual chunk) or ``[6, 8, 8, 6]``.
Megatron-Core says the same with ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage`` (even middle stages) or ``pipeline_model_parallel_layout``.

Minimal version written by the recipe translator's branch against the agreed signature; the
pipeline engineer's module of the same name replaces it at merge.
"""

from __future__ import annotations

__all__ = ["megatron_stage_layout"]


def _stage_chunks(per_stage, vpp_size: int | None) -> list[list[int]]:
    """``per_stage`` as ``[pp][vpp]`` layer counts (ints >= 0)."""
    if not isinstance(per_stage, (list, tuple)) or not per_stage:
        raise ValueError(
            f"pipeline_num_transformer_layers: expected a list with one entry per pipeline "
            f"stage, got {per_stage!r}; pass e.g. [[6], [8], [8], [6]]"
        )
    chunks = [list(s) if isinstance(s, (list, tuple)) else [s] for s in per_stage]
    want = vpp_size or 1
    for stage, row in enumerate(chunks):
        if len(row) != want or not all(isinstance(n, int) and n >= 0 for n in row):
            raise ValueError(
                f"pipeline_num_transformer_layers: stage {stage} is {row!r}; each stage needs "
                f"{want} non-negative layer count(s) (one per virtual pipeline chunk)"
            )
    return chunks


def megatron_stage_layout(
    per_stage, *, num_layers: int, pipeline_size: int, vpp_size: int | None = None
) -> dict:
    """TransformerConfig kwargs that place ``per_stage`` layers on each pipeline stage.

    Args:
        per_stage: MindSpeed's list, one entry per pipeline stage (an int, or a list with one
            count per virtual chunk).
        num_layers: the model's decoder layers; the counts must add up to it.
        pipeline_size: pipeline-parallel size; ``per_stage`` needs exactly this many entries.
        vpp_size: virtual pipeline size (None = 1).

    Returns:
        ``{}`` for one stage; ``num_layers_in_first/last_pipeline_stage`` when every middle
        stage holds the same count and there is no virtual pipeline; otherwise
        ``pipeline_model_parallel_layout`` (Megatron's string form, ``E`` embedding, ``t`` a
        decoder layer, ``L`` the loss, ``|`` between virtual stages).

    Raises:
        ValueError: wrong number of stages, or counts that do not add up to ``num_layers``
            (the message names the sum).
    """
    chunks = _stage_chunks(per_stage, vpp_size)
    total = sum(map(sum, chunks))
    if len(chunks) != pipeline_size:
        raise ValueError(
            f"pipeline_num_transformer_layers: {len(chunks)} stages given, pipeline size is "
            f"{pipeline_size}; give one entry per pipeline stage"
        )
    if total != num_layers:
        raise ValueError(
            f"pipeline_num_transformer_layers: the stages add up to {total} layers, the model has "
            f"{num_layers}; make the list sum to {num_layers}"
        )
    if pipeline_size == 1:
        return {}
    counts = [row[0] for row in chunks]
    if (vpp_size or 1) == 1 and len(set(counts[1:-1])) <= 1 and all(counts):
        middle = counts[1:-1]
        kwargs = {}
        if not middle or counts[0] != middle[0]:
            kwargs["num_layers_in_first_pipeline_stage"] = counts[0]
        if not middle or counts[-1] != middle[0]:
            kwargs["num_layers_in_last_pipeline_stage"] = counts[-1]
        if not middle and counts[0] == counts[-1]:
            kwargs = {}  # two even stages: Megatron's default split
        return kwargs
    virtual = [chunks[pp][v] for v in range(vpp_size or 1) for pp in range(pipeline_size)]
    stages = ["t" * n for n in virtual]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return {"pipeline_model_parallel_layout": "|".join(stages)}
