"""Optimizer state in host memory: which parameters, and the copies to and from the device.

Gradients go device-to-host, the update runs on the host, parameters go back; with ``overlap``
the copies run on a side stream of the device (``torch.get_device_module``) into pinned buffers.
On a CPU every copy is a real copy into a separate host buffer, so the same path is tested.
"""

from __future__ import annotations

import torch

__all__ = ["HostOffload", "offloaded_params"]

HOST = torch.device("cpu")


def offloaded_params(params: list[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """The first parameters, in order, until ``fraction`` of all elements (Megatron's rule)."""
    threshold = fraction * sum(p.numel() for p in params)
    chosen, numel = [], 0
    for param in params:
        if numel >= threshold or fraction == 0.0:
            break
        chosen.append(param)
        numel += param.numel()
    return chosen


class _Copies:
    """Copies between one device and the host, on a side stream when ``overlap`` (not on CPU)."""

    def __init__(self, device: torch.device, overlap: bool) -> None:
        use_stream = overlap and device.type != "cpu"
        self.module = torch.get_device_module(device) if use_stream else None
        self.stream = self.module.Stream() if self.module is not None else None
        self.pinned = device.type != "cpu"

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``host.copy_(device)`` for each ``(host, device)`` pair, after the compute so far."""
        self._copy(pairs, device_waits=False)

    def wait(self) -> None:
        """The host may read what :meth:`to_host` copied."""
        if self.stream is not None:
            self.stream.synchronize()

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``device.copy_(host)`` for each pair; later device work waits for the copies."""
        self._copy(pairs, device_waits=True)

    def _copy(self, pairs, *, device_waits: bool) -> None:
        """``dst.copy_(src)`` for each pair, on the side stream if any, after the compute so far
        (and, ``device_waits``, before the compute that follows)."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        self.stream.wait_stream(self.module.current_stream())
        with self.module.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        if device_waits:
            self.module.current_stream().wait_stream(self.stream)


class HostOffload:
    """The offloaded parameters of one optimizer and their host staging buffers (gradient and
    parameter, pinned off the CPU), keyed by parameter like the optimizer's ``state``."""

    def __init__(self, params: list[torch.Tensor], fraction: float, overlap: bool) -> None:
        self._params = offloaded_params(params, fraction)
        self._held = {id(p) for p in self._params}
        devices = {p.device for p in self._params}
        self._copies = {device: _Copies(device, overlap) for device in devices}
        self._grads: dict[int, torch.Tensor] = {}
        self._staged: dict[int, torch.Tensor] = {}

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._held

    def home(self, param: torch.Tensor) -> torch.device:
        """Where ``param``'s optimizer state lives."""
        return HOST if self.holds(param) else param.device

    def numel(self) -> int:
        return sum(p.numel() for p in self._params)

    def host_empty(self, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host tensor shaped like ``like`` (pinned when ``like`` is on an accelerator)."""
        pin = like.device.type != "cpu"
        return torch.empty(like.shape, dtype=dtype or like.dtype, device=HOST, pin_memory=pin)

    def send_grads(self, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start the device-to-host copies of ``(param, grad)`` pairs of offloaded params."""
        for device, copies in self._copies.items():
            pairs = [(self._grad_buffer(p, g), g) for p, g in grads if p.device == device]
            copies.to_host(pairs)

    def received_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The host copy of ``param``'s gradient (after :meth:`wait_grads`)."""
        return self._grads[id(param)]

    def wait_grads(self) -> None:
        for copies in self._copies.values():
            copies.wait()

    def send_params(self, values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``(param, host value)`` to the device, cast to the param's dtype on the host
        first so only the param's own bytes travel."""
        for device, copies in self._copies.items():
            pairs = []
            for param, value in values:
                if param.device != device:
                    continue
                staged = self._staged.get(id(param))
                if staged is None:
                    staged = self._staged[id(param)] = self.host_empty(param)
                staged.copy_(value)
                pairs.append((param, staged))
            copies.to_device(pairs)

    def _grad_buffer(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        buffer = self._grads.get(id(param))
        if buffer is None or buffer.dtype != grad.dtype:
            buffer = self._grads[id(param)] = self.host_empty(grad)
        return buffer
