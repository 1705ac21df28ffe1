"""Developer tools that build environments (``make test-compat``, ``make compat-smoke``,
``make test-megatron-bridge``); pytest does not collect this folder."""
