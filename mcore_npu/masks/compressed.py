"""The compressed masks of ``npu_fusion_attention``, built once per device and cached.

Modes 2, 3, 4, 7 and 8 take a fixed ``[2048, 2048]`` bool mask whose strict upper triangle is
True (True = masked out); mode 6 a fixed ``[3072, 2048]`` one. One tensor per device serves every
layer and sequence length (4 MiB; 6 MiB for the prefix mask). ``COMPRESSED_MASKS`` is the
package's only cache of tensors, and never holds a mask whose size depends on S.
"""

from __future__ import annotations

import torch

from mcore_npu.ops.contract import COMPRESSED_MASK_SHAPE, PREFIX_COMPRESSED_MASK_SHAPE

CAUSAL = "causal"
PREFIX = "prefix"


def normalize_device(device: torch.device | str | int | None = None) -> torch.device:
    """A device with its index filled in, so ``"npu"`` and ``"npu:0"`` are one cache key (None:
    the current accelerator's current device, or the CPU)."""
    if device is None:
        accelerator = _current_accelerator()
        if accelerator is None:
            return torch.device("cpu")
        device = accelerator
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        device = torch.device(device.type, _current_index(device.type))
    return device


def _current_accelerator() -> torch.device | None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    return accelerator.current_accelerator()


def _current_index(device_type: str) -> int:
    module = getattr(torch, device_type, None)
    if module is not None and hasattr(module, "current_device"):
        return int(module.current_device())
    return 0


def _build(kind: str, device: torch.device) -> torch.Tensor:
    """Fill the mask in place from two ``arange`` vectors: no temporary as large as the mask."""
    shape = COMPRESSED_MASK_SHAPE if kind == CAUSAL else PREFIX_COMPRESSED_MASK_SHAPE
    mask = torch.empty(shape, dtype=torch.bool, device=device)  # True = masked out
    index = torch.arange(COMPRESSED_MASK_SHAPE[1], device=device)
    square = mask[: COMPRESSED_MASK_SHAPE[0]]
    torch.gt(index.unsqueeze(0), index.unsqueeze(1), out=square)  # [i, j] = j > i
    if kind == PREFIX:  # [1024, 2048] below: left half kept, right half masked
        half = COMPRESSED_MASK_SHAPE[1] // 2
        mask[COMPRESSED_MASK_SHAPE[0] :, :half] = False
        mask[COMPRESSED_MASK_SHAPE[0] :, half:] = True
    return mask


class CompressedMaskCache:
    """Compressed masks keyed by ``(kind, normalised device)``; each built once, then shared."""

    def __init__(self) -> None:
        self._masks: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, kind: str, device: torch.device | str | int | None = None) -> torch.Tensor:
        """The cached mask of ``kind`` (``"causal"`` or ``"prefix"``) on ``device``."""
        if kind not in (CAUSAL, PREFIX):
            raise ValueError(f"kind: unknown compressed mask {kind!r}; use 'causal' or 'prefix'")
        key = (kind, normalize_device(device))
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = _build(kind, key[1])
        return mask

    def clear(self) -> None:
        """Drop every cached mask (the next ``get`` rebuilds)."""
        self._masks.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached masks."""
        return sum(m.numel() * m.element_size() for m in self._masks.values())

    def __len__(self) -> int:
        return len(self._masks)


COMPRESSED_MASKS = CompressedMaskCache()


def compressed_causal_mask(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The operator's ``[2048, 2048]`` bool mask (True = masked, strict upper triangle), for
    ``sparse_mode`` 2, 3, 4, 7, 8; cached per device (later calls return the same object)."""
    return COMPRESSED_MASKS.get(CAUSAL, device)


def compressed_prefix_mask(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The operator's ``[3072, 2048]`` bool mask for ``sparse_mode=6`` (cached like the above)."""
    return COMPRESSED_MASKS.get(PREFIX, device)
