"""A precision-aware, offloadable Adam in pure PyTorch: what TE's ``FusedAdam`` gives Megatron.

:class:`PrecisionAwareAdam` has ``FusedAdam``'s state API (``initialize_state``,
``get_unscaled_state``, ``set_scaled_state``) and keeps per parameter ``master_param``
(``main_params_dtype``, or the int16 remainder of :mod:`.remainders`), ``exp_avg`` /
``exp_avg_sq`` (fp32, bf16, fp16) and a float32 host ``step``. Every update runs torch's Adam
kernel in fp32 (bit for bit Megatron's Adam when every dtype is fp32). Without
``precision_aware`` it is a plain Adam over fp32 main parameters (the CPU offload alone); the
offloaded state lives in host memory (:mod:`.host_offload`).
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
    """Adam / AdamW (``decoupled_weight_decay=True``, Megatron's default) whose state dtypes and
    placement follow :class:`AdamSettings`."""

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
        """An Adam with ``settings`` over ``inner``'s hyper-parameters and param groups (the same
        dicts, assigned as Megatron's distributed optimizer does: ``add_param_group`` refuses
        views)."""
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
        dtype on its home device."""
        home, s = self.offload.home(param), self.settings
        state = self.state[param]
        state["step"] = step_tensor()
        state["exp_avg"] = torch.zeros(param.shape, dtype=s.exp_avg_dtype, device=home)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=s.exp_avg_sq_dtype, device=home)
        if s.precision_aware and param.untyped_storage().size() == 0:
            # verl's param_offload freed the parameter: a placeholder for set_scaled_state
            master_dtype = self._master_format(param)
            state["master_param"] = torch.zeros(param.shape, dtype=master_dtype, device=home)
        elif s.precision_aware:
            state["master_param"] = self._stored_master(param, param.detach().float())

    def initialize_all_state(self) -> None:
        """:meth:`initialize_state` for every parameter that has no state yet."""
        for param in self._all_params():
            if not self.state[param]:
                self.initialize_state(param)

    def _stored_master(self, param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """fp32 ``master`` -> its stored form (writes the upper half into ``param`` when only the
        remainder is kept)."""
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
        """Put every state tensor back on its home device (the hook of Megatron's CPU-offload
        optimizer that verl's ``load_megatron_optimizer`` calls)."""
        for param in self._all_params():
            state = self.state[param]
            home = self.offload.home(param)
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device != home:
                    state[key] = value.to(home)

    def state_dict(self):
        """torch's format, every parameter's state allocated first (Megatron reads each step)."""
        self.initialize_all_state()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict``, keeping each state tensor's dtype and home device, and
        one step tensor per parameter."""
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
        """Store the updated fp32 ``master`` and write the on-device param (:meth:`step` sends
        an offloaded one)."""
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

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state (and plain-mode host copies): ``{"device": .., "host": ..}``."""
        totals = {"device": 0, "host": 0}
        for param in self._all_params():
            where = "host" if self.offload.holds(param) else "device"
            for key, value in self.state[param].items():
                if key != "step":
                    totals[where] += value.numel() * value.element_size()
        for value in self._host_params.values():
            totals["host"] += value.numel() * value.element_size()
        return totals
