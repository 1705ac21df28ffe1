"""The optimizer room: Adam state in reduced precision and in host memory, without TE
(docs/optimizer.md)."""

from .adam import PrecisionAwareAdam
from .build import OPTIMIZER_KEYS, get_megatron_optimizer, optimizer_members, plugin_adams
from .settings import AdamSettings, parse_dtype

__all__ = [
    "OPTIMIZER_KEYS",
    "AdamSettings",
    "PrecisionAwareAdam",
    "get_megatron_optimizer",
    "optimizer_members",
    "parse_dtype",
    "plugin_adams",
]
