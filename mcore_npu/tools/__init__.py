"""The tools behind ``mcore-npu doctor``, ``verify`` and ``bench``.

- :mod:`.doctor`: what is installed and what ``auto`` picks here.
- :mod:`.verify` with :mod:`.cases` (the case tables' one loader and case type): a table's cases,
  the kernel against the reference (on an NPU) or the reference against float64 oracles.
- :mod:`.bench`: memory and time measurements, as JSON, PNG and the figures of docs/figures.md.

Tools sit on top: they may use every room below them, and nothing below imports them.
"""
