"""Where every token sits, for Qwen3-VL's language model and its vision tower (host-side indices).

:func:`rope_index` gives the language model's mRoPE positions ``[3, B, S]`` (t, h, w) as
transformers' ``Qwen3VLModel.get_rope_index`` does: text runs count on from the previous position,
an image or video frame of merged grid ``(t, h/m, w/m)`` takes ``start + (t, row, col)``, and the
next token starts ``max(h, w)/m`` later. Token kinds come from the config's ``image_token_id`` /
``video_token_id`` (verl passes no ``mm_token_type_ids``); padding (``attention_mask`` False) gets
position 0. The vision helpers give each patch its (row, col) for the 2D RoPE, its four bilinear
corners in the learned position table, and the frames' ``cu_seqlens``, all in the merge order
(each ``m x m`` block of patches contiguous)."""

from __future__ import annotations

import itertools

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def rope_index(
    input_ids,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    image_grid_thw=None,
    video_grid_thw=None,
    attention_mask=None,
) -> torch.Tensor:
    """mRoPE positions ``[3, B, S]`` long of ``input_ids [B, S]``; ``attention_mask [B, S]`` bool or
    0/1, **True / 1 = token** (left or right padding); grids ``[n, 3]`` (t, h, w) in patches, in
    the order the images / videos appear. Each video frame (t = 1 slices) is its own group, as
    Qwen3-VL separates frames by timestamps. Without any grid every token is text, image ids
    included, as transformers reads them."""
    grids = {IMAGE: _grid_rows(image_grid_thw), VIDEO: _video_frames(video_grid_thw)}
    used = {IMAGE: 0, VIDEO: 0}
    kinds = torch.zeros_like(input_ids)
    if image_grid_thw is not None or video_grid_thw is not None:
        kinds[input_ids == image_token_id] = IMAGE
        kinds[input_ids == video_token_id] = VIDEO
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    for row in range(input_ids.shape[0]):
        keep = _kept(attention_mask, row, input_ids)
        positions = _row_positions(kinds[row][keep].tolist(), grids, used, spatial_merge_size)
        out[:, row, keep] = positions.to(out.device)
    for kind, name in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw")):
        if used[kind] != len(grids[kind]):
            raise ValueError(
                f"rope_index: {name}: {len(grids[kind])} grids but {used[kind]} runs of their "
                "tokens in input_ids; pass one grid per image (per video) in the batch"
            )
    return out


def _grid_rows(grid_thw) -> list[tuple[int, int, int]]:
    return [] if grid_thw is None else [tuple(int(v) for v in g) for g in grid_thw.tolist()]


def _video_frames(grid_thw) -> list[tuple[int, int, int]]:
    return [(1, h, w) for t, h, w in _grid_rows(grid_thw) for _ in range(t)]


def _kept(attention_mask, row: int, input_ids) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(input_ids.shape[1], dtype=torch.bool, device=input_ids.device)
    return attention_mask[row].bool().to(input_ids.device)


def _row_positions(kinds: list[int], grids: dict, used: dict, merge: int) -> torch.Tensor:
    """``[3, n]`` positions of one row's kept tokens (``kinds``: TEXT / IMAGE / VIDEO each)."""
    pieces, current, start = [], 0, 0
    for kind, run in itertools.groupby(kinds):
        length = len(list(run))
        if kind == TEXT:
            pieces.append(torch.arange(current, current + length).expand(3, -1))
            current += length
        else:
            t, h, w = _next_grid(grids, used, kind, start)
            rows, cols = h // merge, w // merge
            if t * rows * cols != length:
                name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
                raise ValueError(
                    f"rope_index: {name}: grid {(t, h, w)} gives {t * rows * cols} tokens after "
                    f"the {merge}x{merge} merge but input_ids has a run of {length} at {start}; "
                    "pass the grids the processor produced for these input_ids"
                )
            pieces.append(_grid_positions(t, rows, cols) + current)
            current += max(rows, cols)
        start += length
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1)


def _next_grid(grids: dict, used: dict, kind: int, start: int) -> tuple[int, int, int]:
    if used[kind] >= len(grids[kind]):
        name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
        raise ValueError(
            f"rope_index: {name}: input_ids has more runs of its tokens (one at {start}) than "
            f"the {len(grids[kind])} grids passed; pass one grid per image (per video frame)"
        )
    used[kind] += 1
    return grids[kind][used[kind] - 1]


def _grid_positions(t: int, rows: int, cols: int) -> torch.Tensor:
    """``[3, t*rows*cols]``: (frame, row, col) of a merged grid in raster order."""
    frame = torch.arange(t).repeat_interleave(rows * cols)
    row = torch.arange(rows).repeat_interleave(cols).repeat(t)
    col = torch.arange(cols).repeat(rows * t)
    return torch.stack((frame, row, col))


def patch_positions(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """``[P, 2]`` long (row, col) of every patch of ``grid_thw [n, 3]``, in the merge order."""
    parts = []
    for t, h, w in _grid_rows(grid_thw):
        rows = _merge_order(torch.arange(h)[:, None].expand(h, w), spatial_merge_size)
        cols = _merge_order(torch.arange(w)[None, :].expand(h, w), spatial_merge_size)
        parts.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    return torch.cat(parts).to(grid_thw.device)


def _merge_order(grid: torch.Tensor, m: int) -> torch.Tensor:
    """``[h, w]`` -> ``[h*w]`` with each ``m x m`` block contiguous (blocks in raster order)."""
    h, w = grid.shape
    return grid.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()


def bilinear_corners(grid_thw: torch.Tensor, side: int, spatial_merge_size: int):
    """``(index [4, P] long, weight [4, P] fp32)``: each patch's four corners in a ``side x side``
    learned position table (``linspace(0, side-1, h)`` by ``(…, w)``), in the merge order."""
    indices, weights = [], []
    for t, h, w in _grid_rows(grid_thw):
        y, x = torch.linspace(0, side - 1, h), torch.linspace(0, side - 1, w)
        y0, x0 = y.int(), x.int()
        y1, x1 = (y0 + 1).clamp(max=side - 1), (x0 + 1).clamp(max=side - 1)
        fy, fx = (y - y0)[:, None], (x - x0)[None, :]
        corners = [(y0, x0), (y0, x1), (y1, x0), (y1, x1)]
        index = torch.stack([(a[:, None] * side + b[None, :]) for a, b in corners])  # [4, h, w]
        weight = torch.stack([(1 - fy) * (1 - fx), (1 - fy) * fx, fy * (1 - fx), fy * fx])
        order = _merge_order(torch.arange(h * w).reshape(h, w), spatial_merge_size).repeat(t)
        indices.append(index.flatten(1)[:, order])
        weights.append(weight.flatten(1)[:, order])
    device = grid_thw.device
    return torch.cat(indices, dim=1).to(device), torch.cat(weights, dim=1).to(device)


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """``[frames + 1]`` int32 offsets: every frame of every image / video its own sequence."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
