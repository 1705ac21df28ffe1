"""What the Hugging Face model tests (tests/nemotron, tests/dsa_hf) share: Megatron's CPU config
arguments, a finder that refuses imports of named packages, the plugin's model built and run from
a tiny checkpoint with those refused, and the measurements the tests assert on (logits against
transformers', packed thd against unpacked, export against the checkpoint, a wrong tensor's
effect, the TP = 2 run of a ``tp_export.py``)."""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import sys
import types
from pathlib import Path

import safetensors.torch
import torch

CPU_ARGS = dict(
    use_cpu_initialization=True,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    gradient_accumulation_fusion=False,
    variable_seq_lengths=False,
)
"""The bridge's ``set_extra_args`` for a CPU run: no fused kernels, CPU-side initialisation."""
NVTE = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


class ImportBlocker(importlib.abc.MetaPathFinder):
    """Refuses every import of the packages ``blocked``; records ``(name, importing file)``.
    Put it first in ``sys.meta_path`` and remove it after."""

    def __init__(self, blocked: tuple[str, ...]):
        self.blocked = blocked
        self.attempts: list[tuple[str, str]] = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.blocked:
            frame = sys._getframe(1)
            while frame.f_code.co_filename.startswith("<frozen"):
                frame = frame.f_back
            self.attempts.append((name, frame.f_code.co_filename))
            raise ModuleNotFoundError(f"blocked by the test: {name}")
        return None


@contextlib.contextmanager
def own_attention_variables():
    """Runs the body without TE's ``NVTE_*`` attention variables and puts them back after:
    Megatron's model writes them from its config's ``attention_backend`` (mbridge's DeepSeek-V3
    family says ``fused``, Nemotron-H ``auto``) and asserts one setting per process, where one
    pytest process builds several families."""
    before = {name: os.environ.pop(name, None) for name in NVTE}
    try:
        yield
    finally:
        for name, value in before.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def batches(lengths: tuple[int, ...], vocab: int) -> dict[int, torch.Tensor]:
    """length -> ``[2, length]`` token ids below ``vocab`` (one generator, seed 1)."""
    gen = torch.Generator().manual_seed(1)
    return {n: torch.randint(0, vocab, (2, n), generator=gen) for n in lengths}


def npu_logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The plugin model's logits ``[B, S, vocab]`` for ``ids`` ``[B, S]`` (positions 0 .. S - 1,
    no grad)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions, None, **kwargs)


def packed_params(lengths: tuple[int, ...]):
    """``(ends, PackedSeqParams)`` of sequences of ``lengths`` packed into one thd row: ``ends``
    ``[len(lengths) + 1]`` int32, each sequence's start and the total at the end."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ends = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ends, PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=ends,
        cu_seqlens_kv=ends,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )


def packed_logits(model, batches: dict[int, torch.Tensor]) -> torch.Tensor:
    """Logits ``[sum(lengths), vocab]`` of the first row of every batch (length -> ``[B, length]``
    ids) packed into one thd row in ``batches``' order, positions from 0 in each sequence."""
    lengths = tuple(batches)
    _, params = packed_params(lengths)
    ids = torch.cat([batches[n][0] for n in lengths])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        return model(ids, positions, None, packed_seq_params=params)[0]


def plugin_run(path, blocked: tuple[str, ...], batches: dict[int, torch.Tensor]):
    """The checkpoint at ``path`` built and loaded through the plugin's bridge (reference kernels,
    fp32, ``CPU_ARGS``) and run on ``batches``, with the packages ``blocked`` refused at import
    (the model built under :func:`own_attention_variables`).

    A namespace: ``bridge``, ``model`` (eval), ``npu`` / ``single`` (length -> logits
    ``[2, length, vocab]`` / ``[1, length, vocab]``, the batch's first row alone), ``packed``
    (:func:`packed_logits`), ``attempts`` (the blocker's) and ``new_modules`` (modules of the
    blocked packages that came into ``sys.modules`` meanwhile)."""
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    before = {m for m in sys.modules if m.split(".")[0] in blocked}
    blocker = ImportBlocker(blocked)
    sys.meta_path.insert(0, blocker)
    try:
        with own_attention_variables():
            bridge = npu_bridge(str(path), kernel="reference", dtype=torch.float32)
            bridge.set_extra_args(**CPU_ARGS)
            model = build_model(bridge).eval()
        load_hf_weights(model, str(path), bridge=bridge)
        npu = {n: npu_logits(model, ids) for n, ids in batches.items()}
        single = {n: npu_logits(model, ids[:1]) for n, ids in batches.items()}
        packed = packed_logits(model, batches)
    finally:
        sys.meta_path.remove(blocker)
    return types.SimpleNamespace(
        bridge=bridge,
        model=model,
        npu=npu,
        single=single,
        packed=packed,
        attempts=blocker.attempts,
        new_modules={m for m in sys.modules if m.split(".")[0] in blocked} - before,
    )


def logit_errors(run, lengths: tuple[int, ...]):
    """``(errors, scale)``: (tokens, batch) -> max |logit - transformers'| for ``run.npu`` (batch
    2) and ``run.single`` (batch 1) of each length against ``run.hf``; the largest |logit| of
    transformers' compared."""
    errors, scale = {}, 0.0
    for n in lengths:
        for got in (run.npu[n], run.single[n]):
            want = run.hf[n][: got.shape[0]]
            errors[(n, got.shape[0])] = float((got - want).abs().max())
            scale = max(scale, float(want.abs().max()))
    return errors, scale


def packed_errors(run, lengths: tuple[int, ...]):
    """``(own, hf)``: per sequence of ``lengths``, max |logit| difference of its slice of
    ``run.packed`` from its unpacked batch-1 logits (``run.single``) and from transformers'."""
    ends, _ = packed_params(lengths)
    own, hf = [], []
    for n, a, b in zip(lengths, ends[:-1], ends[1:], strict=True):
        own.append(float((run.packed[a:b] - run.single[n][0]).abs().max()))
        hf.append(float((run.packed[a:b] - run.hf[n][0]).abs().max()))
    return own, hf


def saved_and_exported(run):
    """``(saved, exported)``: name -> tensor of the checkpoint's safetensors at ``run.path`` and of
    the plugin's export of ``run.model`` through ``run.bridge`` (on the CPU)."""
    from mcore_npu.integrations.hf import export_hf_weights

    saved = safetensors.torch.load_file(str(next(Path(run.path).glob("*.safetensors"))))
    exported = {key: t.cpu() for key, t in export_hf_weights(run.model, run.bridge)}
    return saved, exported


def logit_moves(model, module, wrongs: dict, ids: torch.Tensor, want: torch.Tensor):
    """name -> max |logit - ``want``| for ``ids`` with ``module``'s parameter ``name`` changed in
    place by ``wrongs[name](param)`` (no grad); each parameter is put back after."""
    moved = {}
    for name, wrong in wrongs.items():
        param = module.get_parameter(name)
        kept = param.detach().clone()
        try:
            with torch.no_grad():
                wrong(param)
            moved[name] = float((npu_logits(model, ids) - want).abs().max())
        finally:
            with torch.no_grad():
                param.copy_(kept)
    return moved


def run_tp2(module: str, path: str, ids: torch.Tensor, logits: torch.Tensor):
    """``torchrun --nproc-per-node=2 -m module path`` (a ``tp_export.py``) after saving ``ids``
    and the one-process ``logits`` there as ``tp1_ids.pt`` / ``tp1_logits.pt``; the finished
    process (``tests.launch.run_command``)."""
    from tests.launch import ROOT, TORCHRUN, run_command

    torch.save(ids, Path(path) / "tp1_ids.pt")
    torch.save(logits, Path(path) / "tp1_logits.pt")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node=2", "-m", module, path]
    return run_command(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def tp2_results(stdout: str):
    """``(export, diff)`` from rank 0's output: the ``TP_EXPORT`` line's ``[tensors, names equal,
    all torch.equal]`` (strings) and the ``TP_LOGITS`` max |logit diff| (float)."""
    lines = stdout.splitlines()
    export = next(line.split()[1:] for line in lines if "TP_EXPORT" in line)
    diff = next(float(line.split()[1]) for line in lines if line.startswith("TP_LOGITS"))
    return export, diff


def tp1_ids_logits(model) -> torch.Tensor:
    """For ``tp_export.py`` (``sys.argv[1]`` the checkpoint): ``model``'s logits for the
    ``tp1_ids.pt`` the test saved there (:func:`run_tp2`)."""
    ids = torch.load(Path(sys.argv[1]) / "tp1_ids.pt")
    return model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
