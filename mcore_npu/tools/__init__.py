"""The tools behind ``mcore-npu doctor``, ``verify`` and ``bench``.

- :mod:`.doctor`: what is installed and what ``auto`` picks here.
- :mod:`.verify` with :mod:`.cases`: the attention case table against the kernel (on an NPU) or
  the reference against a float64 oracle (elsewhere).
- :mod:`.bench`: memory and time measurements, as JSON, PNG and the figures of docs/figures.md.

Tools sit on top: they may use every room below them, and nothing below imports them.
"""
