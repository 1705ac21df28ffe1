"""The allocator room: accelerator detection (:mod:`.device`), expandable segments and the
worker mixin (:mod:`.workers`). Imports no Megatron, and no torch at import."""
