"""The transformer room: what fills Megatron-Core's spec slots (attention, norms, MLP, RoPE, router,
experts, MLA, Gated DeltaNet, context parallelism) and the spec builders (``spec_provider``,
``layer_specs``, ``megatron_lm``). Imports Megatron-Core in its modules, never in this ``__init__``;
nothing here patches Megatron, keeps global state or writes ``config``."""
