"""``build_npu_attention_mask`` against verl 0.9.1's own mask code, on verl's own inputs; and
every mask verl's own forward (``gptmodel_forward_model_engine``) hands the model, through the
NPU spec.

The keep masks come from verl's ``preprocess_bshd_engine`` (right padding, ``[B, S]`` bool,
True = real token). verl's ``_build_npu_attn_mask`` and ``postprocess_bshd_engine`` are called
as installed. ``postprocess_bshd_engine`` reads the keep mask back from a dense mask's diagonal
only when verl's ``is_npu_available`` flag is set; the round-trip test sets that flag with
``monkeypatch`` as the stand-in for torch_npu being present (no other verl code is touched).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from verl.models.mcore import util as verl_util
from verl.utils import tensordict_utils as tu

from mcore_npu.masks import build_npu_attention_mask

pytestmark = pytest.mark.usefixtures("cpu_runtime")

CASES = [(5, 3, 1), (8, 8, 8), (1, 7), (16, 2, 9, 11)]


def _verl_keep_mask(lengths) -> torch.Tensor:
    """verl's own right-padded ``[B, S]`` bool keep mask for sequences of these lengths."""
    nested = tu.nested_tensor_from_tensor_list([torch.arange(1, n + 1) for n in lengths])
    _, keep, _ = verl_util.preprocess_bshd_engine(nested, pre_process=True)
    return keep


@pytest.mark.parametrize("lengths", CASES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.uint8])
def test_equals_verls_npu_mask(lengths, dtype):
    keep = _verl_keep_mask(lengths)
    assert keep.dtype == torch.bool and keep.shape == (len(lengths), max(lengths))
    want = verl_util._build_npu_attn_mask(keep)  # [B, 1, S, S] bool, True = masked out
    got = build_npu_attention_mask(keep.to(dtype))
    assert got.dtype == torch.bool
    assert torch.equal(got, want)


def test_verls_integer_mask_is_not_a_bool_mask():
    """Why integer input is converted: verl's builder inverts integers bitwise (~1 == -2)."""
    keep = _verl_keep_mask((4, 2))
    verl_int = verl_util._build_npu_attn_mask(keep.long())
    assert verl_int.dtype == torch.int64 and set(verl_int.unique().tolist()) == {-2, -1}
    assert torch.equal(build_npu_attention_mask(keep.long()), verl_int == -1)


@pytest.mark.parametrize("lengths", CASES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_diagonal_round_trip_through_postprocess(monkeypatch, lengths, dtype):
    keep = _verl_keep_mask(lengths)
    output = torch.randn(*keep.shape, 3, generator=torch.Generator().manual_seed(len(lengths)))
    want = verl_util.postprocess_bshd_engine(output, keep)  # the [B, S] path (no NPU)
    monkeypatch.setattr(verl_util, "is_npu_available", True)  # stand-in: torch_npu present
    got = verl_util.postprocess_bshd_engine(output, build_npu_attention_mask(keep.to(dtype)))
    assert [len(row) for row in got.unbind()] == list(lengths)
    for ours, theirs in zip(got.unbind(), want.unbind()):
        assert torch.equal(ours, theirs)
    recovered = ~build_npu_attention_mask(keep.to(dtype)).diagonal(dim1=-2, dim2=-1).squeeze(1)
    assert torch.equal(recovered, keep)


def test_other_dtypes_are_refused():
    keep = _verl_keep_mask((3, 2))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        with pytest.raises(TypeError, match="keep_mask: dtype"):
            build_npu_attention_mask(keep.to(dtype))


# ---------------------------------------------------------------------------------------------
# every mask verl's own forwards hand the model, through the NPU spec
# ---------------------------------------------------------------------------------------------

LENGTHS = (11, 6, 3)
# (data_format, vision_model, verl's is_npu_available): what reaches the model's attention
FORWARDS = {
    "bshd": ("bshd", False, False),  # preprocess_bshd_engine: [B, S] keep, True = real token
    "bshd_npu": ("bshd", False, True),  # _build_npu_attn_mask: [B, 1, S, S], True = masked out
    "bshd_vision": ("bshd", True, False),  # build_vlm_attn_mask_bshd: [B, S] keep, no positions
    "bshd_vision_npu": ("bshd", True, True),  # build_vlm_attn_mask_bshd on an NPU: None
    "thd": ("thd", False, False),  # preprocess_thd_engine: no mask, PackedSeqParams
}


@pytest.fixture(scope="module")
def fp32_model(qwen3):
    """The tiny Qwen3 through the plugin's engine (NPU spec), fp32, and its rows."""
    from tests.integrations import verl_loop as loop

    worker = loop.new_worker(loop.worker_config(qwen3, dtype="float32"), loop.sft_loss_fn())
    generator = torch.Generator().manual_seed(4)
    rows = [torch.randint(1, 128, (n,), generator=generator) for n in LENGTHS]
    return worker.engine.module[0], rows


@pytest.mark.parametrize("name", FORWARDS)
def test_every_mask_verls_forwards_hand_the_model_gives_each_rows_own_logits(
    name, fp32_model, monkeypatch
):
    """verl's ``gptmodel_forward_model_engine`` (the forward of its Megatron engine) with the
    plugin's model: each form of mask it builds is accepted, and every real token's logits are
    those of its row run alone (no padding, no mask). The NPU forms are verl's own code with its
    ``is_npu_available`` flag set (the stand-in for torch_npu being present)."""
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine

    model, rows = fp32_model
    data_format, vision, on_npu = FORWARDS[name]
    monkeypatch.setattr(verl_util, "is_npu_available", on_npu)
    with torch.no_grad():
        got = gptmodel_forward_model_engine(
            model, tu.nested_tensor_from_tensor_list(rows), {}, vision_model=vision,
            pad_token_id=0, data_format=data_format,
        )  # fmt: skip
        for row, logits in zip(rows, got.unbind(), strict=True):
            alone = model(input_ids=row[None], position_ids=torch.arange(len(row))[None],
                          attention_mask=None)  # fmt: skip
            torch.testing.assert_close(logits, alone[0], rtol=1e-5, atol=1e-5)
