"""``PrecisionAwareAdam`` alone (pure PyTorch, in process): the arithmetic against torch's own
Adam, the stored dtypes and their measured memory, the remainder split, the checkpoint API
Megatron's distributed optimizer calls, and the settings' refusals. On a CPU the offloaded and
the on-device state are both in host memory; placement is checked through the optimizer's own
bookkeeping (``offload.holds`` / ``state_bytes``), the copies are real copies."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.optimizer import AdamSettings, PrecisionAwareAdam, parse_dtype
from mcore_npu.optimizer.host_offload import offloaded_params
from mcore_npu.optimizer.remainders import join_master, split_master
from mcore_npu.tools.bench.memory import track_allocations

SIZES = (50, 30, 70, 50)
SETTINGS = {
    "plain": AdamSettings(),
    "precision_aware": AdamSettings(precision_aware=True),
    "offload_1": AdamSettings(cpu_offload=True, offload_fraction=1.0),
    "offload_0.4_overlap": AdamSettings(cpu_offload=True, offload_fraction=0.4, overlap_copies=True),
    "both_0.9": AdamSettings(precision_aware=True, cpu_offload=True, offload_fraction=0.9),
}  # fmt: skip


def _params(dtype=torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=generator).to(dtype) for n in SIZES]


def _train(optimizer, params, *, decoupled: bool, steps: int = 5) -> None:
    """``steps`` updates with gradients ``sin((i + 1) * p + j)`` (in ``params``' dtype)."""
    for i in range(steps):
        for j, p in enumerate(params):
            grad = torch.sin(p.float() * (i + 1) + j).to(p.dtype)
            if decoupled:
                p.decoupled_grad = grad
            else:
                p.grad = grad
        optimizer.step()


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("decoupled_weight_decay", [True, False])
def test_fp32_equals_torch_adam_bit_for_bit(name, decoupled_weight_decay):
    settings = SETTINGS[name]
    reference = _params()
    torch_cls = torch.optim.AdamW if decoupled_weight_decay else torch.optim.Adam
    _train(torch_cls(reference, lr=1e-2, weight_decay=0.1), reference, decoupled=False)
    params = _params()
    adam = PrecisionAwareAdam(params, settings=settings, lr=1e-2, weight_decay=0.1,
                              decoupled_weight_decay=decoupled_weight_decay)  # fmt: skip
    _train(adam, params, decoupled=settings.precision_aware)
    assert all(torch.equal(a, b) for a, b in zip(reference, params, strict=True))
    assert all(float(adam.state[p]["step"]) == 5 for p in params)


def test_offload_takes_the_first_parameters_up_to_the_fraction():
    params = _params()  # 50, 30, 70, 50 elements: 200
    assert [p.numel() for p in offloaded_params(params, 0.4)] == [50, 30]  # 50 < 80 <= 80
    assert [p.numel() for p in offloaded_params(params, 0.9)] == [50, 30, 70, 50]
    assert offloaded_params(params, 0.0) == []
    adam = PrecisionAwareAdam(params, settings=SETTINGS["offload_0.4_overlap"])
    _train(adam, params, decoupled=False, steps=1)
    assert adam.state_bytes() == {"device": 8 * 120, "host": 8 * 80 + 4 * 80}  # + host copies


@pytest.mark.parametrize(
    "dtype, expected",
    [(torch.float32, 10), (torch.bfloat16, 6), (torch.float16, 6)],
    ids=["fp32", "bf16", "fp16"],
)
def test_state_memory_per_parameter_measured(dtype, expected):
    """bf16 parameters, fp32 master as an int16 remainder (2 B) + two moments in ``dtype``;
    measured with the allocation tracker around the state's allocation."""
    params = _params(torch.bfloat16)
    settings = AdamSettings(precision_aware=True, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    adam = PrecisionAwareAdam(params, settings=settings)
    with track_allocations() as usage:
        adam.initialize_all_state()
    steps = 4 * len(SIZES)  # a float32 step per parameter
    assert (usage.live_bytes - steps) / sum(SIZES) == expected
    assert adam.state_bytes() == {"device": expected * sum(SIZES), "host": 0}


def test_torch_adam_and_offloaded_state_memory_measured():
    """The references of the memory table: torch's Adam (Megatron's, without TE) keeps two fp32
    moments (8 B per parameter, beside Megatron's own fp32 main copy of a bf16 model: 4 B); the
    offloaded precision-aware state (fraction 1) keeps nothing on the device and an fp32 master
    plus two fp32 moments (12 B) on the host."""
    params = [p.requires_grad_() for p in _params()]
    adam = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    with track_allocations() as usage:
        adam.step()
    assert (usage.live_bytes - 4 * len(SIZES)) / sum(SIZES) == 8
    params = _params(torch.bfloat16)
    settings = AdamSettings(precision_aware=True, cpu_offload=True, offload_fraction=1.0)
    offloaded = PrecisionAwareAdam(params, settings=settings)
    with track_allocations() as usage:
        offloaded.initialize_all_state()
    assert (usage.live_bytes - 4 * len(SIZES)) / sum(SIZES) == 12
    assert offloaded.state_bytes() == {"device": 0, "host": 12 * sum(SIZES)}


def test_bf16_moments_track_the_fp32_run():
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = _params(torch.bfloat16)
        settings = AdamSettings(precision_aware=True, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
        adam = PrecisionAwareAdam(params, settings=settings, lr=1e-2)
        _train(adam, params, decoupled=True, steps=20)
        runs[dtype] = torch.cat([adam.get_unscaled_state(p, "master_param") for p in params])
        assert {adam.state[p]["exp_avg"].dtype for p in params} == {dtype}
    assert (runs[torch.float32] - runs[torch.bfloat16]).abs().max() < 0.02


def test_remainders_are_lossless_and_round_to_nearest():
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(100_000, generator=generator) * torch.logspace(-30, 30, 100_000)
    values = torch.cat([values, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38])])
    high, remainder = split_master(values)
    assert torch.equal(join_master(high, remainder).view(torch.int32), values.view(torch.int32))
    differs = high != values.bfloat16()
    assert differs.sum() < 10  # only exact ties round differently from round-to-nearest-even


def test_checkpoint_api_round_trips_master_and_moments():
    params = _params(torch.bfloat16)
    settings = AdamSettings(precision_aware=True, exp_avg_dtype=torch.bfloat16)
    adam = PrecisionAwareAdam(params, settings=settings, lr=1e-2)
    _train(adam, params, decoupled=True, steps=3)
    saved = {k: adam.get_unscaled_state(params[0], k).clone() for k in ("master_param", "exp_avg")}
    assert adam.state[params[0]]["master_param"].dtype == torch.int16  # remainder only
    fresh_params = _params(torch.bfloat16)
    fresh = PrecisionAwareAdam(fresh_params, settings=settings, lr=1e-2)
    for key, value in saved.items():
        fresh.set_scaled_state(fresh_params[0], key, value)
    assert torch.equal(fresh.get_unscaled_state(fresh_params[0], "master_param"),
                       saved["master_param"])  # fmt: skip
    assert torch.equal(fresh_params[0], params[0])  # the bf16 parameter is the master's upper half
    assert fresh.state[fresh_params[0]]["exp_avg"].dtype == torch.bfloat16


def test_state_dict_keeps_dtypes_and_gives_each_parameter_its_step():
    params = _params(torch.bfloat16)
    settings = AdamSettings(precision_aware=True, exp_avg_sq_dtype=torch.float16)
    adam = PrecisionAwareAdam(params, settings=settings)
    _train(adam, params, decoupled=True, steps=2)
    state_dict = adam.state_dict()
    shared = torch.tensor(2.0)  # Megatron's load gives one step tensor to every parameter
    for values in state_dict["state"].values():
        values["step"] = shared
    other = PrecisionAwareAdam(params, settings=settings)
    other.load_state_dict(state_dict)
    steps = [other.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == len(params) and all(float(s) == 2 for s in steps)
    assert other.state[params[0]]["exp_avg_sq"].dtype == torch.float16
    assert torch.equal(other.state[params[1]]["exp_avg"], adam.state[params[1]]["exp_avg"])


def test_empty_optimizer_state_dict_describes_every_parameter():
    """Megatron's distributed optimizer reads a step from every parameter's state, also before
    the first step (a checkpoint load into a fresh worker)."""
    adam = PrecisionAwareAdam(_params(), settings=SETTINGS["precision_aware"])
    assert len(adam.state_dict()["state"]) == len(SIZES)


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"use_precision_aware_optimizer": True, "exp_avg_dtype": "fp8"}, "exp_avg_dtype='fp8'"),
        ({"use_precision_aware_optimizer": True, "exp_avg_dtype": torch.float8_e4m3fn},
         "Transformer Engine"),
        ({"use_precision_aware_optimizer": True, "main_params_dtype": "bf16"},
         "main_params_dtype='bf16'"),
        ({"exp_avg_dtype": "bf16"}, "needs use_precision_aware_optimizer=True"),
        ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.5},
         "optimizer_offload_fraction=1.5"),
    ],
)  # fmt: skip
def test_settings_refuse_in_one_line_naming_the_key(keys, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as info:
        AdamSettings.from_keys(keys)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "value, dtype",
    [("fp32", torch.float32), ("float32", torch.float32), ("32", torch.float32),
     (32, torch.float32), ("torch.float32", torch.float32), ("BF16", torch.bfloat16),
     ("bfloat16", torch.bfloat16), (torch.bfloat16, torch.bfloat16), ("fp16", torch.float16),
     ("float16", torch.float16), ("16", torch.float16), (16, torch.float16)],
)  # fmt: skip
def test_every_spelling_verl_accepts_is_read(value, dtype):
    assert parse_dtype("exp_avg_dtype", value) == dtype


@pytest.mark.parametrize("value", [True, None, 8, "int8", torch.int16])
def test_anything_else_is_refused(value):
    with pytest.raises(ValueError, match="exp_avg_sq_dtype="):
        parse_dtype("exp_avg_sq_dtype", value)


def test_settings_read_dtype_names_as_verl_leaves_them():
    settings = AdamSettings.from_keys({"use_precision_aware_optimizer": True,
                                       "main_params_dtype": "fp32", "exp_avg_dtype": "bf16",
                                       "exp_avg_sq_dtype": torch.bfloat16})  # fmt: skip
    assert settings.main_params_dtype == torch.float32
    assert settings.exp_avg_dtype == settings.exp_avg_sq_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        settings.check_against(optimizer="adam", use_distributed_optimizer=False)
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        settings.check_against(optimizer="sgd", use_distributed_optimizer=True)
