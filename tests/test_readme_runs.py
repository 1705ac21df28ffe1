"""The README's code blocks run, as a newcomer would use them (issue 33: "a new user reading
only the README can run `make demo` and pass a spec to `GPTModel`").

- The Python block is executed as written, with ``config`` (the block's "your
  TransformerConfig") a tiny one: it must build a ``GPTModel`` whose every layer's core attention
  is ``NPUFusionAttention``, which then runs a forward and backward on the CPU.
- Every ``mcore-npu train`` / ``-m mcore_npu.train`` command of its shell blocks, and its YAML
  block on top of ``configs/gpt_tiny.yaml``, loads and validates through the trainer's own
  ``load_config`` at the command's world size (nothing is trained here; ``make demo`` itself
  runs in tests/training/test_train.py).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from tests.transformer.megatron_models import tiny_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)


def _commands() -> list[list[str]]:
    """The trainer command lines of the README's bash blocks (continuations joined)."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "mcore-npu" in words[:1] or "mcore_npu.train" in words:
                commands.append(words)
    return commands


def _world_size(words: list[str]) -> int:
    def option(name: str) -> int:
        return int(words[words.index(name) + 1]) if name in words else 1

    return option("--nnodes") * option("--nproc-per-node")


def _config_and_overrides(words: list[str]) -> tuple[Path, list[str]]:
    config = ROOT / words[words.index("--config") + 1]
    overrides = [word for word in words if "=" in word and not word.startswith("-")]
    return config, overrides


@pytest.mark.cpu_only
@pytest.mark.usefixtures("megatron_runtime")
def test_the_readme_python_block_builds_a_gpt_with_the_npu_spec():
    from megatron.core.models.gpt import GPTModel

    from mcore_npu.transformer.attention import NPUFusionAttention

    (block,) = _blocks("python")
    namespace = {"config": tiny_config()}
    torch.manual_seed(0)
    exec(compile(block, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert isinstance(model, GPTModel)
    layers = model.decoder.layers
    assert len(layers) == 2
    assert all(
        isinstance(layer.self_attention.core_attention, NPUFusionAttention) for layer in layers
    )
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    logits = model(tokens, positions, attention_mask=None)
    assert logits.shape == (2, 16, 32000) and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_readme_trainer_commands_load_and_validate(tmp_path):
    from mcore_npu.training.config import load_config

    corpus = tmp_path / "corpus.txt"  # the user's data.path: a UTF-8 text file of theirs
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 4096)
    commands = _commands()
    assert len(commands) >= 4, commands  # the YAML toggle's command and three torchrun lines
    for words in commands:
        config, overrides = _config_and_overrides(words)
        overrides = [f"data.path={corpus}" if o.startswith("data.path=") else o for o in overrides]
        cfg = load_config(config, overrides, world_size=_world_size(words))
        for override in overrides:
            key, value = override.split("=", 1)
            assert str(_lookup(cfg, key)) == value, override


def test_the_readme_yaml_toggle_loads_on_the_demo_config():
    from mcore_npu.training.config import load_config

    toggles = [yaml.safe_load(b) for b in _blocks("yaml")]
    (toggle,) = [t for t in toggles if "attention" in t and "memory" in t]
    overrides = [f"{section}.{key}={value}" for section, keys in toggle.items()
                 for key, value in keys.items()]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", overrides)
    assert cfg.attention.backend == "npu_fusion" and cfg.memory.expandable_segments is True


def _lookup(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg
