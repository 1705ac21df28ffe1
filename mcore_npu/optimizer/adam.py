"""A precision-aware, offloadable Adam in pure PyTorch: what TE's ``FusedAdam`` gives Megatron.

Megatron's distributed optimizer, with ``use_precision_aware_optimizer``, hands its inner Adam the
model's own (bf16) parameter shards and the gradients as ``param.decoupled_grad``, and expects the
Adam to keep the fp32 master weights and to write the parameters itself. It reads and writes that
state through three methods of TE's ``FusedAdam``: ``initialize_state(p)``,
``get_unscaled_state(p, key)`` and ``set_scaled_state(p, key, value)`` (its checkpoint formats
go through them). :class:`PrecisionAwareAdam` offers the same, with no Transformer Engine:

- ``state["master_param"]``: the master weights, in ``main_params_dtype`` (fp32 or fp16), or, for
  a bf16 parameter with an fp32 master and ``store_param_remainders``, only its int16 low half
  (:mod:`.remainders`);
- ``state["exp_avg"]`` / ``state["exp_avg_sq"]``: Adam's moments, in ``exp_avg_dtype`` /
  ``exp_avg_sq_dtype`` (fp32, bf16, fp16);
- ``state["step"]``: a float32 scalar per parameter on the host, as torch's Adam keeps it (and
  Megatron's distributed optimizer reads it without TE).

Every update is computed in fp32 by torch's own Adam kernel (``torch.optim.adam.adam``), one
parameter at a time, on upcast copies of whatever is kept in lower precision. With every dtype
fp32 the arithmetic is torch's Adam's on the same tensors, so the results are identical bit for
bit to Megatron's distributed Adam over ``torch.optim.AdamW``.

Without ``precision_aware`` it is a plain Adam over Megatron's fp32 main parameters (state in
torch's format, ``param.grad``), which is what the CPU offload alone needs. With ``cpu_offload``,
the state of the first ``offload_fraction`` of the parameters lives in host memory and is updated
there (:mod:`.host_offload`); the on-device rest is updated by the same code where it lives.
"""

from __future__ import annotations

import torch
from torch.optim import adam as torch_adam

from .host_offload import HOST, HostOffload
from .remainders import join_master, split_master
from .settings import AdamSettings

__all__ = ["PrecisionAwareAdam", "step_tensor"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def step_tensor(value: float = 0.0) -> torch.Tensor:
    """A step counter as torch's Adam keeps it (not capturable): a float32 0-dim host tensor."""
    return torch.tensor(float(value), dtype=torch.float32)


class PrecisionAwareAdam(torch.optim.Adam):
    """Adam / AdamW whose state dtypes and placement follow :class:`AdamSettings`.

    Args:
        params: parameters or param groups (Megatron's, with their extra keys).
        settings: dtypes, remainders and CPU offload.
        lr, betas, eps, weight_decay, decoupled_weight_decay: as ``torch.optim.Adam``
            (``decoupled_weight_decay=True`` is AdamW, Megatron's default).
    """

    def __init__(
        self,
        params,
        *,
        settings: AdamSettings,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        self.settings = settings
        self._adopt(self.param_groups)
        self._host_params: dict[int, torch.Tensor] = {}  # plain mode: host copies, by id
        self._synced: dict[int, int] = {}  # plain mode: param._version after our last write

    @classmethod
    def replacing(cls, inner: torch.optim.Adam, settings: AdamSettings) -> PrecisionAwareAdam:
        """An Adam over ``inner``'s param groups (the same dict objects) and hyper-parameters.

        The groups are adopted as Megatron's distributed optimizer gives its own Adam its shard
        groups (``distrib_optimizer.py:607``: ``optimizer.param_groups = ...``): they may hold
        views of model parameters, which ``Optimizer.add_param_group`` refuses as non-leaves.
        """
        d = inner.defaults
        adam = cls(
            [torch.zeros(0, requires_grad=True)],  # replaced below
            settings=settings,
            lr=d["lr"],
            betas=d["betas"],
            eps=d["eps"],
            weight_decay=d["weight_decay"],
            decoupled_weight_decay=d.get("decoupled_weight_decay", True),
        )
        adam._adopt(inner.param_groups)
        return adam

    def _adopt(self, groups: list[dict]) -> None:
        for group in groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.param_groups = groups
        self.state.clear()
        fraction = self.settings.offload_fraction if self.settings.cpu_offload else 0.0
        self.offload = HostOffload(self._all_params(), fraction, self.settings.overlap_copies)

    # -- state ------------------------------------------------------------------------------

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _keeps_remainder(self, param: torch.Tensor) -> bool:
        s = self.settings
        return (
            s.precision_aware
            and s.store_param_remainders
            and param.dtype == torch.bfloat16
            and s.main_params_dtype == torch.float32
            and not self.offload.holds(param)  # the host keeps a whole fp32 master
        )

    def _master_format(self, param: torch.Tensor) -> torch.dtype:
        return torch.int16 if self._keeps_remainder(param) else self.settings.main_params_dtype

    def initialize_state(self, param: torch.Tensor) -> None:
        """Zero moments, step 0 and (precision-aware) the master copy of ``param``, each in its
        dtype on its home device (TE ``FusedAdam``'s method, which Megatron calls)."""
        home, s = self.offload.home(param), self.settings
        state = self.state[param]
        state["step"] = step_tensor()
        state["exp_avg"] = torch.zeros(param.shape, dtype=s.exp_avg_dtype, device=home)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=s.exp_avg_sq_dtype, device=home)
        if s.precision_aware and param.untyped_storage().size() == 0:
            # verl's param_offload has freed the parameter (a checkpoint load into a fresh
            # worker): a placeholder, which the load overwrites through set_scaled_state
            state["master_param"] = torch.zeros(param.shape, dtype=self._master_format(param),
                                                device=home)  # fmt: skip
        elif s.precision_aware:
            state["master_param"] = self._stored_master(param, param.detach().float())

    def initialize_all_state(self) -> None:
        """:meth:`initialize_state` for every parameter that has no state yet."""
        for param in self._all_params():
            if not self.state[param]:
                self.initialize_state(param)

    def _stored_master(self, param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """fp32 ``master`` -> the form kept in ``state["master_param"]`` (writes the rounded
        upper half into ``param`` when only the remainder is kept)."""
        if self._keeps_remainder(param):
            high, remainder = split_master(master.reshape(-1))
            param.copy_(high.view(param.shape))
            return remainder.view(param.shape)
        home = self.offload.home(param)
        return master.to(device=home, dtype=self.settings.main_params_dtype, copy=True)

    def get_unscaled_state(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """``state[key]`` of ``param`` as fp32 (the master rebuilt from its remainder)."""
        self._ensure_state(param)
        value = self.state[param][key]
        if key == "step":
            return value
        if key == "master_param" and self._keeps_remainder(param):
            return join_master(param.detach(), value)
        return value.float()

    def set_scaled_state(self, param: torch.Tensor, key: str, value: torch.Tensor) -> None:
        """Store ``value`` (fp32) as ``state[key]`` of ``param``, in that state's dtype."""
        if not isinstance(value, torch.Tensor):
            return  # the dp_reshardable format's per-entry metadata ("padding": bool)
        self._ensure_state(param)
        state = self.state[param]
        with torch.no_grad():
            if key == "step":
                state["step"] = step_tensor(float(value))
            elif key == "master_param":
                state[key] = self._stored_master(param, value.detach().float())
            else:
                state[key].copy_(value)

    def _ensure_state(self, param: torch.Tensor) -> None:
        if not self.state[param]:
            self.initialize_state(param)

    def _move_new_state_to_right_device(self) -> None:
        """Put every state tensor back on its home device and dtype (verl's
        ``load_megatron_optimizer`` calls this hook, which Megatron's CPU-offload optimizer
        defines, instead of moving all the state to the device)."""
        for param in self._all_params():
            state = self.state[param]
            home = self.offload.home(param)
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device != home:
                    state[key] = value.to(home)

    def state_dict(self):
        """torch's format; the state of every parameter exists first (Megatron's distributed
        optimizer reads a step from each)."""
        self.initialize_all_state()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict``, keeping each state tensor's dtype and home device
        (torch's own would cast the moments to the parameter's dtype and device) and giving
        every parameter its own step tensor."""
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        params = self._all_params()
        for index, values in saved.items():
            param = params[index]
            self.initialize_state(param)
            for key, value in values.items():
                self._load_value(param, key, value)

    def _load_value(self, param: torch.Tensor, key: str, value) -> None:
        state = self.state[param]
        if key == "step":
            state["step"] = step_tensor(float(value))
        elif key == "master_param" and value.dtype != self._master_format(param):
            pass  # Megatron's placeholder for a state about to be set (set_scaled_state)
        elif key in state:
            state[key].copy_(value)
        else:
            state[key] = value

    # -- the update -------------------------------------------------------------------------

    def _grad(self, param: torch.Tensor) -> torch.Tensor | None:
        if self.settings.precision_aware:
            return getattr(param, "decoupled_grad", None)
        return param.grad

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._move_new_state_to_right_device()
        grads = [(group, p, self._grad(p)) for group in self.param_groups for p in group["params"]]
        work = [(group, p, g) for group, p, g in grads if g is not None]
        offloaded = [(group, p, g) for group, p, g in work if self.offload.holds(p)]
        self.offload.send_grads([(p, g) for _, p, g in offloaded])
        for group, param, grad in work:
            if not self.offload.holds(param):
                self._update(group, param, grad)
        self.offload.wait_grads()
        for group, param, _ in offloaded:
            self._update(group, param, self.offload.received_grad(param))
        self.offload.send_params([(p, self._host_value(p)) for _, p, _ in offloaded])
        for _, param, _ in offloaded:
            self._synced[id(param)] = param._version
        return loss

    def _update(self, group: dict, param: torch.Tensor, grad: torch.Tensor) -> None:
        """One Adam update of ``param`` in fp32, then everything stored back in its dtype."""
        self._ensure_state(param)
        state = self.state[param]
        master = self._working_master(param)
        moments = [state[key].float() for key in _MOMENTS]  # the same tensor when fp32
        beta1, beta2 = group["betas"]
        torch_adam.adam(
            [master],
            [grad if grad.dtype == torch.float32 else grad.float()],
            moments[:1],
            moments[1:],
            [],
            [state["step"]],
            foreach=group.get("foreach"),
            decoupled_weight_decay=group.get("decoupled_weight_decay", True),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group.get("maximize", False),
        )
        for key, value in zip(_MOMENTS, moments, strict=True):
            if value is not state[key]:
                state[key].copy_(value)
        self._store_master(param, master)

    def _working_master(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor the update runs on (in place where the master is fp32 already)."""
        if self.settings.precision_aware:
            return self.get_unscaled_state(param, "master_param")
        if not self.offload.holds(param):
            return param
        host = self._host_params.get(id(param))
        if host is None or self._synced.get(id(param)) != param._version:
            # first step, or the parameter was written since (a checkpoint load): refresh
            host = self._host_params[id(param)] = param.detach().to(HOST, copy=True)
        return host

    def _store_master(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """Keep the updated fp32 ``master`` in its stored form and write the on-device param
        (an offloaded one is sent by :meth:`step`; plain mode updated in place already)."""
        if not self.settings.precision_aware:
            return
        state = self.state[param]
        if self._keeps_remainder(param):
            state["master_param"] = self._stored_master(param, master)  # writes param too
            return
        if master is not state["master_param"]:
            state["master_param"].copy_(master)
        if not self.offload.holds(param):
            param.copy_(master)

    def _host_value(self, param: torch.Tensor) -> torch.Tensor:
        """What an offloaded parameter becomes: its master, or (plain mode) its host copy."""
        if self.settings.precision_aware:
            return self.state[param]["master_param"]
        return self._host_params[id(param)]

    # -- accounting -------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state (and plain-mode host copies) by placement:
        ``{"device": ..., "host": ...}``; on a CPU run "device" is the on-device part."""
        totals = {"device": 0, "host": 0}
        for param in self._all_params():
            where = "host" if self.offload.holds(param) else "device"
            for key, value in self.state[param].items():
                if key != "step":
                    totals[where] += value.numel() * value.element_size()
        for value in self._host_params.values():
            totals["host"] += value.numel() * value.element_size()
        return totals
