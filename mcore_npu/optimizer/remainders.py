"""fp32 master weights as a bf16 parameter plus an int16 remainder (``store_param_remainders``).

The upper half is rounded to nearest (the model computes with the master rounded) and the split
is lossless: ``bits(master) = (bits(param) << 16) + remainder``, remainder in [-32768, 32767].
"""

from __future__ import annotations

import torch

__all__ = ["join_master", "split_master"]

_HALF = 1 << 16


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[N]`` -> (bf16 ``[N]`` rounded upper halves, int16 ``[N]`` signed remainders)."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_master: master must be float32, got {master.dtype}")
    bits = master.view(torch.int32)
    low = bits & (_HALF - 1)
    round_up = (low >= _HALF // 2).to(torch.int32)
    high = (bits >> 16) + round_up
    remainder = low - round_up * _HALF
    return high.to(torch.int16).view(torch.bfloat16), remainder.to(torch.int16)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 ``[N]``, int16 ``[N]``) -> the fp32 ``[N]`` master they were split from."""
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(
            "join_master: expects a bfloat16 parameter and an int16 remainder, got "
            f"{param.dtype} and {remainder.dtype}"
        )
    high = param.reshape(-1).view(torch.int16).to(torch.int32)
    bits = (high << 16) + remainder.reshape(-1).to(torch.int32)
    return bits.view(torch.float32).view(param.shape)
