"""``mrope_angles``: Qwen3-VL's interleaved frequencies against a loop written from the rule,
Qwen2-VL's sections against Megatron's own ``MultimodalRotaryEmbedding``, the ``rotary_mode``
layouts, and the refusals (each naming the argument)."""

from __future__ import annotations

import pytest
import torch

from mcore_npu import ops
from mcore_npu.ops import registry


def _positions(b=2, s=7, seed=0):
    return torch.randint(0, 50, (3, b, s), generator=torch.Generator().manual_seed(seed))


def _inv_freq(frequencies: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, 2 * frequencies, 2).float() / (2 * frequencies)))


def _loop(positions, inv_freq, section):
    """Frequency ``i`` follows h where ``i % 3 == 1 and i < 3 h``, w where ``i % 3 == 2 and
    i < 3 w``, else t (transformers' apply_interleaved_mrope, one frequency at a time)."""
    _, b, s = positions.shape
    out = torch.empty(s, b, len(inv_freq))
    for i, f in enumerate(inv_freq.tolist()):
        axis = (
            1
            if i % 3 == 1 and i < 3 * section[1]
            else 2
            if i % 3 == 2 and i < 3 * section[2]
            else 0
        )
        out[:, :, i] = (positions[axis].float() * torch.tensor(f, dtype=torch.float32)).T
    return out


@pytest.mark.parametrize("section", [[24, 20, 20], [3, 3, 2], [11, 11, 10], [8, 0, 0], [2, 3, 3]])
def test_interleaved_angles_follow_the_rule(section):
    inv_freq = _inv_freq(sum(section))  # [2, 3, 3]: the rule gives t, h, w = 3, 3, 2
    positions = _positions()
    got = ops.mrope_angles(positions, inv_freq, section)
    want = _loop(positions, inv_freq, section)
    assert got.shape == (7, 2, 1, 2 * sum(section)) and got.dtype == torch.float32
    assert torch.equal(got[:, :, 0], torch.cat((want, want), dim=-1))


def test_sections_equal_megatrons_multimodal_rope():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    section = [2, 3, 3]
    module = MultimodalRotaryEmbedding.__new__(MultimodalRotaryEmbedding)
    torch.nn.Module.__init__(module)
    module.inv_freq, module.rotary_interleaved = _inv_freq(8), False
    module.seq_len_interpolation_factor, module.cp_group = None, None
    positions = _positions()
    want = module(positions, section)
    got = ops.mrope_angles(positions, _inv_freq(8), section, interleaved=False)
    assert torch.equal(got, want)
    assert not torch.equal(ops.mrope_angles(positions, _inv_freq(8), [3, 3, 2]), want)


def test_interleave_mode_repeats_each_frequency():
    positions, inv_freq = _positions(), _inv_freq(8)
    half = ops.mrope_angles(positions, inv_freq, [3, 3, 2])
    pairs = ops.mrope_angles(positions, inv_freq, [3, 3, 2], rotary_mode="interleave")
    assert torch.equal(pairs[..., 0::2], half[..., :8]) and torch.equal(
        pairs[..., 1::2], half[..., :8]
    )


def test_text_positions_give_plain_rope():
    """One position per token on all three axes: the angles are the 1D RoPE's."""
    positions = torch.arange(9).expand(3, 1, 9)
    got = ops.mrope_angles(positions, _inv_freq(8), [3, 3, 2])
    plain = torch.outer(torch.arange(9).float(), _inv_freq(8))
    assert torch.equal(got[:, 0, 0], torch.cat((plain, plain), dim=-1))


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (dict(position_ids=torch.zeros(2, 1, 4, dtype=torch.long)), "position_ids"),
        (dict(position_ids=torch.zeros(3, 1, 4)), "position_ids"),
        (dict(inv_freq=torch.zeros(2, 4)), "inv_freq"),
        (dict(mrope_section=[3, 3]), "mrope_section"),
        (dict(mrope_section=[3, -1, 2]), "mrope_section"),
        (dict(mrope_section=[3, 3, 3], interleaved=False), "mrope_section"),  # 9 != 8
        (dict(rotary_mode="full"), "rotary_mode"),
    ],
)
def test_refusals_name_the_argument(call, argument):
    args = dict(
        position_ids=torch.zeros(3, 1, 4, dtype=torch.long),
        inv_freq=_inv_freq(8),
        mrope_section=[3, 3, 2],
    )
    args.update(call)
    keywords = {k: args.pop(k) for k in ("rotary_mode", "interleaved") if k in args}
    with pytest.raises((ValueError, TypeError), match=f"mrope_angles: {argument}"):
        ops.mrope_angles(args["position_ids"], args["inv_freq"], args["mrope_section"], **keywords)


def test_registered_without_an_ascend_kernel():
    spec = registry.operator("mrope_angles")
    assert spec.kernels == () and registry.reference("mrope_angles") is ops.mrope_angles
    assert registry.resolve("mrope_angles", "auto", "npu").kernel == "reference"
