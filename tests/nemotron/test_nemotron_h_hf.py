"""A tiny Nemotron-H through the plugin's Hugging Face bridge (``integrations.hf_nemotron_h``)
into Megatron's hybrid model from the NPU spec, against transformers 5.25's own model.

The checkpoint is nemotron_models.py's (``M*M-M*``: Mamba2, attention, MLP; chunk 8 < every
sequence; every norm, ``D`` and ``dt_bias`` away from its init). fp32, reference kernels, one
process (conftest.py's CPU runtime). Checked: logits within 1e-4 (absolute) of transformers for
7, 12 and 33 tokens, batch 1 and 2; the three packed into one thd row give each one's logits
within 1e-5; export is bit-exact; the TP split / merge of the sectioned tensors are inverse;
the plugin model imports none of mamba_ssm, causal_conv1d, triton, transformer_engine.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("mbridge")
pytest.importorskip("transformers.models.nemotron_h")

from tests.hf_model_checks import (
    batches,
    logit_errors,
    logit_moves,
    npu_logits,
    packed_errors,
    plugin_run,
    run_tp2,
    saved_and_exported,
    tp2_results,
)
from tests.nemotron.nemotron_models import PATTERN, VOCAB, save_tiny, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

TOLERANCE = 1e-4  # max |logit difference|, absolute (the logits' max |value| is printed)
PACKED_TOLERANCE = 1e-5
LENGTHS = (7, 12, 33)
BLOCKED = ("mamba_ssm", "causal_conv1d", "triton", "transformer_engine")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The checkpoint, transformers' logits, and the plugin's bridge, model and logits (sbhd and
    packed thd), the plugin built and run with ``BLOCKED`` refused at import
    (:func:`~tests.hf_model_checks.plugin_run`)."""
    path = tmp_path_factory.mktemp("tiny_nemotron_h")
    hf_model = save_tiny(path)
    tokens = batches(LENGTHS, VOCAB)
    with torch.no_grad():
        hf = {n: hf_model(input_ids=ids).logits for n, ids in tokens.items()}
    return types.SimpleNamespace(
        path=str(path), batches=tokens, hf=hf, **vars(plugin_run(path, BLOCKED, tokens))
    )


def test_npu_bridge_builds_the_hybrid_model_from_the_npu_spec(run):
    from mbridge import AutoBridge

    from mcore_npu.integrations.hf_nemotron_h import NemotronHBridge
    from mcore_npu.transformer.mamba import NPUMambaMixer

    assert isinstance(run.bridge, NemotronHBridge)
    assert AutoBridge.list_supported_models().count("nemotron_h") == 1
    kinds = [type(layer).__name__ for layer in run.model.decoder.layers]
    assert kinds == [
        "MambaLayer",
        "TransformerLayer",
        "MambaLayer",
        "MLPLayer",
        "MambaLayer",
        "TransformerLayer",
    ]
    mixer = run.model.decoder.layers[0].mixer
    assert isinstance(mixer, NPUMambaMixer)
    assert (mixer.d_conv, mixer.chunk_size, mixer.kernel) == (4, 8, "reference")
    assert run.bridge.pattern == PATTERN and run.bridge.config.is_hybrid_model


def test_logits_match_transformers(run):
    errors, scale = logit_errors(run, LENGTHS)
    print(
        f"tiny nemotron_h: max |logit - transformers| (tokens, batch): "
        f"{ {key: f'{e:.2e}' for key, e in errors.items()} }; max |logit| {scale:.2f}"
    )
    assert max(errors.values()) <= TOLERANCE, errors


def test_packed_thd_gives_each_sequences_logits(run):
    own, hf = packed_errors(run, LENGTHS)
    print(
        f"packed thd: max |logit - unpacked| per sequence {[f'{e:.2e}' for e in own]}, "
        f"- transformers {[f'{e:.2e}' for e in hf]}"
    )
    assert max(own) <= PACKED_TOLERANCE and max(hf) <= TOLERANCE, (own, hf)


def test_export_is_bit_exact(run):
    saved, exported = saved_and_exported(run)
    assert exported.keys() == saved.keys()
    for key, tensor in saved.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    print(f"export: {len(saved)} tensors, every one torch.equal to the checkpoint's")


def test_no_cuda_only_package_is_imported(run):
    """Built, loaded and run with the packages refused at import: none is in ``sys.modules``, and
    no module of the plugin asked for one (torch and Megatron probe them in ``try`` blocks)."""
    probes = sorted(
        {f"{name} <- {Path(where).parent.name}/{Path(where).name}" for name, where in run.attempts}
    )
    print(f"blocked optional imports (probes): {probes}")
    assert run.new_modules == set()
    assert not [where for _, where in run.attempts if "/mcore_npu/" in where]


def test_tensor_parallel_split_and_merge(run):
    """For TP = 2, rank r gets the r-th half of each of z, x, B, C, dt (``in_proj``) and of x, B,
    C (``conv1d``), as NPUMambaMixer holds them; merging the two ranks' parts gives the whole
    tensor back. The per-head tensors split and merge on rows."""
    bridge, mixer = run.bridge, run.model.decoder.layers[0].mixer
    sections = {
        "in_proj.weight": (64, 64, 32, 32, 4),
        "conv1d.weight": (64, 32, 32),
        "conv1d.bias": (64, 32, 32),
        "A_log": (4,),
        "D": (4,),
        "dt_bias": (4,),
        "norm.weight": (64,),
    }
    tp2 = types.SimpleNamespace(tp_size=2)
    for suffix, parts in sections.items():
        name = f"decoder.layers.0.mixer.{suffix}"
        param = mixer.get_parameter(suffix)
        whole = torch.arange(param.shape[0], dtype=torch.float32)
        whole = whole.view(-1, *[1] * (param.dim() - 1)).expand(param.shape).contiguous()
        half = param[: param.shape[0] // 2]
        split = list(bridge._weight_split_across_tp(name, whole, half, 2))
        bounds = torch.tensor([0, *parts]).cumsum(0)
        for rank, got in enumerate(split):
            rows = torch.cat(
                [
                    torch.arange(a + rank * (b - a) // 2, a + (rank + 1) * (b - a) // 2)
                    for a, b in zip(bounds[:-1], bounds[1:])
                ]
            )
            assert torch.equal(got.reshape(got.shape[0], -1)[:, 0], rows.float()), (suffix, rank)
        mpu, bridge.mpu = bridge.mpu, tp2
        try:
            merged = bridge._weight_merge_across_tp(name, split, param)
        finally:
            bridge.mpu = mpu
        assert torch.equal(merged, whole), suffix


def test_the_config_refuses_what_the_hybrid_model_cannot_compute():
    from mcore_npu.integrations.hf_nemotron_h import config_keywords, hybrid_pattern

    keywords = config_keywords(tiny_config())
    assert keywords["num_layers"] == 6 and keywords["gated_linear_unit"] is False
    assert (keywords["mamba_num_heads"], keywords["mamba_num_groups"]) == (4, 2)
    assert hybrid_pattern(tiny_config(hybrid_override_pattern="M-*")) == "M-*"
    refused = {
        "moe": dict(hybrid_override_pattern="M*E"),
        "layer_norm_epsilon": dict(layer_norm_epsilon=1e-6),
        "use_bias": dict(use_bias=True),
        "mlp_bias": dict(mlp_bias=True),
        "time_step_limit": dict(time_step_limit=(0.0, 1.0)),
        "mlp_hidden_act": dict(mlp_hidden_act="silu"),
        "tie_word_embeddings": dict(tie_word_embeddings=True),
    }
    for field, overrides in refused.items():
        with pytest.raises(ValueError, match=field):
            config_keywords(tiny_config(**overrides))


def test_a_wrong_mapping_moves_the_logits(run):
    """The comparison can fail: each Mamba tensor the draw moved away from its init, put back
    to its init or permuted over heads, moves the logits far beyond the tolerance."""
    mixer = run.model.decoder.layers[0].mixer
    ids = run.batches[12][:1]
    want = run.hf[12][:1]
    wrongs = {
        "D": lambda p: p.fill_(1.0),
        "dt_bias": lambda p: p.copy_(p.flip(0)),
        "A_log": lambda p: p.copy_(p.flip(0)),
        "norm.weight": lambda p: p.fill_(1.0),
        "in_proj.layer_norm_weight": lambda p: p.fill_(1.0),
        "conv1d.bias": lambda p: p.zero_(),
    }
    moved = logit_moves(run.model, mixer, wrongs, ids, want)
    print(f"max |logit - transformers| with one tensor wrong: {moved}")
    assert min(moved.values()) > 10 * TOLERANCE, moved
    assert float((npu_logits(run.model, ids) - want).abs().max()) <= TOLERANCE


@pytest.mark.distributed
def test_tensor_parallel_2_loads_and_exports_bit_exact(run):
    """Two processes (torchrun, gloo) at TP = 2 (``tp_export.py``): the weights load split per
    rank, export back to every tensor of the checkpoint ``torch.equal``, and the TP = 2 logits are
    the one-process ones."""
    done = run_tp2("tests.nemotron.tp_export", run.path, run.batches[12], run.npu[12])
    assert done.returncode == 0, done.stderr[-4000:]
    export, diff = tp2_results(done.stdout)
    assert export[1:] == ["True", "True"] and int(export[0]) > 0, export
    assert diff <= 1e-5, diff
    print(f"TP = 2: {export[0]} tensors exported bit-exact; logits within {diff:.1e} of TP = 1")
