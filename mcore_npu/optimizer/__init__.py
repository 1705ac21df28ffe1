"""The optimizer room: Adam state in reduced precision and in host memory, without TE.

- :mod:`.settings`: Megatron's precision and offload keys, checked once (:class:`AdamSettings`);
- :mod:`.remainders`: an fp32 master as a bf16 parameter plus an int16 remainder;
- :mod:`.host_offload`: which parameters' state lives on the host, and the copies;
- :mod:`.adam`: :class:`PrecisionAwareAdam`, the Adam with TE ``FusedAdam``'s state API;
- :mod:`.build`: Megatron's ``get_megatron_optimizer`` with that Adam inside.
"""

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
