"""A stand-in ``torch_npu`` for the fused operators (no NPU here): it records every call of
``npu_rms_norm``, ``npu_swiglu``, ``npu_grouped_matmul`` and ``npu_rotary_mul`` with its arguments and answers with the
reference's result, so models keep computing real numbers while the calls are checked.

The stand-in's ``npu_grouped_matmul`` has the newer release's keyword-only signature; pass
``old_signature=True`` for the torch 2.1/2.2 builds' (no ``group_type`` / ``group_list_type``).
``old_rotary=True`` gives ``npu_rotary_mul`` the 6.0.x releases' signature (no ``rotary_mode``).
"""

from __future__ import annotations

import sys
import types

from mcore_npu.ops import reference


class FusedOpsTorchNpu(types.ModuleType):
    def __init__(self, old_signature: bool = False, old_rotary: bool = False) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[str, tuple, dict]] = []
        if old_signature:
            self.npu_grouped_matmul = self._old_grouped_matmul
        if old_rotary:
            self.npu_rotary_mul = self._old_rotary_mul

    def npu_rotary_mul(self, input, r1, r2, rotary_mode="half"):
        self.calls.append(("npu_rotary_mul", (input, r1, r2), {"rotary_mode": rotary_mode}))
        return reference.npu_rotary_mul(input, r1, r2, rotary_mode)

    def _old_rotary_mul(self, input, r1, r2):
        self.calls.append(("npu_rotary_mul", (input, r1, r2), {}))
        return reference.npu_rotary_mul(input, r1, r2, "half")

    def npu_rms_norm(self, x, gamma, epsilon=1e-06):
        self.calls.append(("npu_rms_norm", (x, gamma), {"epsilon": epsilon}))
        return reference.npu_rms_norm(x, gamma, epsilon)

    def npu_swiglu(self, x, dim=-1):
        self.calls.append(("npu_swiglu", (x,), {"dim": dim}))
        return reference.npu_swiglu(x, dim)

    def npu_grouped_matmul(
        self, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
        antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
        activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
        group_list_type=0, act_type=0, output_dtype=None,
    ):  # fmt: skip
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "x", "weight")}
        given = {k: v for k, v in kwargs.items() if v is not None and not _is_default(k, v)}
        self.calls.append(("npu_grouped_matmul", (x, weight), given))
        return reference.npu_grouped_matmul(x, weight, **kwargs)

    def _old_grouped_matmul(
        self, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
        antiquant_offset=None, group_list=None, split_item=0, output_dtype=None,
    ):  # fmt: skip
        kwargs = dict(group_list=group_list, split_item=split_item, bias=bias)
        self.calls.append(("npu_grouped_matmul", (x, weight), dict(kwargs)))
        return reference.npu_grouped_matmul(x, weight, group_type=0, **kwargs)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def _is_default(name, value) -> bool:
    return (name, value) in (("split_item", 0), ("group_list_type", 0), ("act_type", 0))


def install(monkeypatch, **kwargs) -> FusedOpsTorchNpu:
    module = FusedOpsTorchNpu(**kwargs)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module
