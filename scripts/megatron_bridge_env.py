"""A scratch Megatron-Bridge for ``make test-megatron-bridge`` (not CI): ``python -m
scripts.megatron_bridge_env DIR`` installs megatron-bridge 0.3.1 into ``DIR`` with
``pip install --no-deps --target`` and replaces the modules that ``import megatron.bridge``
reaches and that need Transformer Engine or Triton with stand-in modules; then ``PYTHONPATH=DIR``
makes ``import megatron.bridge`` work in the verl environment (.venv-verl).

Stand-ins (hardware-only code we do not have): every attribute of a stand-in module is a class
whose constructor raises, so ``from ... import LoRALinear`` works and any use fails loudly.
Which modules (megatron-bridge 0.3.1, found by importing until it imported):

- ``peft/lora_layers.py``, ``peft/lora.py``: ``import transformer_engine.pytorch`` at the top;
- ``models/mamba/mamba_provider.py``, ``models/nemotron_vl/nemotron_vl_provider.py``: reach
  megatron-core's Mamba mixer, which imports ``triton``.

Nothing the GPT providers of Qwen3 / Qwen3-MoE use is replaced (LoRA and the Mamba / Nemotron
models are not built).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RELEASE = "megatron-bridge==0.3.1"
STAND_INS = (
    "megatron/bridge/peft/lora_layers.py",
    "megatron/bridge/peft/lora.py",
    "megatron/bridge/models/mamba/mamba_provider.py",
    "megatron/bridge/models/nemotron_vl/nemotron_vl_provider.py",
)
STAND_IN = '''"""A stand-in for a Transformer-Engine- or Triton-only module of megatron-bridge (written by
scripts/megatron_bridge_env.py for the scratch test; no such module runs here)."""


def _unavailable(*args, **kwargs):
    raise RuntimeError(f"{__name__} is a stand-in: it needs Transformer Engine or Triton")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {"__init__": _unavailable, "__module__": __name__})
'''


def scratch_site(target: Path) -> Path:
    """Install :data:`RELEASE` into ``target`` (once) and write the stand-ins; returns ``target``."""
    marker = target / "megatron" / "bridge" / "__init__.py"
    if not marker.exists():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                   "--target", str(target), RELEASE]  # fmt: skip
        subprocess.run(command, check=True, timeout=1800)
    for relative in STAND_INS:
        path = target / relative
        if not path.exists():
            raise FileNotFoundError(f"{path}: not in {RELEASE}; update STAND_INS")
        path.write_text(STAND_IN)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m scripts.megatron_bridge_env DIR")
    print(scratch_site(Path(sys.argv[1]).resolve()))
