"""A stand-in ``torch_npu`` for the fused operators (no NPU here): it records every call of
``npu_rms_norm``, ``npu_swiglu``, ``npu_grouped_matmul``, ``npu_rotary_mul`` and the four MoE
token permute operators with its arguments and answers with the reference's result, so models
keep computing real numbers while the calls are checked.

The stand-in's ``npu_grouped_matmul`` has the newer release's keyword-only signature; pass
``old_signature=True`` for the torch 2.1/2.2 builds' (no ``group_type`` / ``group_list_type``),
``routing_map_ops=False`` for a torch_npu without the ``_with_routing_map`` permute pair.
``old_rotary=True`` gives ``npu_rotary_mul`` the 6.0.x releases' signature (no ``rotary_mode``).
"""

from __future__ import annotations

import sys
import types

from mcore_npu.ops import reference


class FusedOpsTorchNpu(types.ModuleType):
    def __init__(
        self, old_signature: bool = False, routing_map_ops: bool = True, old_rotary: bool = False
    ) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[str, tuple, dict]] = []
        if old_signature:
            self.npu_grouped_matmul = self._old_grouped_matmul
        if not routing_map_ops:  # a torch_npu older than op-plugin 7.2.0
            self.npu_moe_token_permute_with_routing_map = None
            self.npu_moe_token_unpermute_with_routing_map = None
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

    def npu_moe_token_permute_with_routing_map(
        self, tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False
    ):
        kwargs = dict(probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)
        self.calls.append(("npu_moe_token_permute_with_routing_map", (tokens, routing_map),
                           kwargs))  # fmt: skip
        return reference.npu_moe_token_permute_with_routing_map(tokens, routing_map, **kwargs)

    def npu_moe_token_unpermute_with_routing_map(
        self, permuted_tokens, sorted_indices, restore_shape, *, probs=None, routing_map=None,
        drop_and_pad=False,
    ):  # fmt: skip
        kwargs = dict(probs=probs, routing_map=routing_map, drop_and_pad=drop_and_pad)
        args = (permuted_tokens, sorted_indices, restore_shape)
        self.calls.append(("npu_moe_token_unpermute_with_routing_map", args, kwargs))
        return reference.npu_moe_token_unpermute_with_routing_map(*args, **kwargs)

    def npu_moe_token_permute(self, tokens, indices, num_out_tokens=None, padded_mode=False):
        kwargs = dict(num_out_tokens=num_out_tokens, padded_mode=padded_mode)
        self.calls.append(("npu_moe_token_permute", (tokens, indices), kwargs))
        return reference.npu_moe_token_permute(tokens, indices, **kwargs)

    def npu_moe_token_unpermute(self, permuted_tokens, sorted_indices, probs=None,
                                padded_mode=False, restore_shape=None):  # fmt: skip
        kwargs = dict(probs=probs, padded_mode=padded_mode, restore_shape=restore_shape)
        self.calls.append(("npu_moe_token_unpermute", (permuted_tokens, sorted_indices), kwargs))
        return reference.npu_moe_token_unpermute(permuted_tokens, sorted_indices, **kwargs)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def _is_default(name, value) -> bool:
    return (name, value) in (("split_item", 0), ("group_list_type", 0), ("act_type", 0))


def install(monkeypatch, **kwargs) -> FusedOpsTorchNpu:
    module = FusedOpsTorchNpu(**kwargs)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module
