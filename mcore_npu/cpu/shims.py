"""What the CPU runtime puts in place of CUDA-only code: the replacements named in
:data:`mcore_npu.cpu.patches.PATCHES`, and the torch function modes. They hold no state."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode


class CudaFactoriesOn(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (or ``cuda:N``) in torch calls, ``Tensor.to("cuda")`` and
    ``Tensor.cuda()`` to ``device`` (``cuda:N`` to index N of its type where it has indices);
    ``pin_memory=False``: drops ``pin_memory=True`` (no pinned allocator without an
    accelerator)."""

    def __init__(self, device: torch.device, *, pin_memory: bool = True) -> None:
        super().__init__()
        self.device, self.pin_memory = torch.device(device), pin_memory

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return self._cuda(*args, **kwargs)
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], self.redirect(args[1]), *args[2:])  # verl: .to(get_device_name())
        device = kwargs.get("device")
        if device is not None and is_cuda_device(device):
            kwargs = {**kwargs, "device": self.redirect(device)}
        if kwargs.get("pin_memory") and not self.pin_memory:
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)

    def redirect(self, cuda) -> torch.device:
        """Where ``cuda`` (``"cuda"``, ``"cuda:N"``, a CUDA device or an index) goes."""
        index = cuda if isinstance(cuda, int) else torch.device(cuda).index
        if index is None or self.device.type == "cpu":
            return self.device
        return torch.device(self.device.type, index)

    def _cuda(self, tensor, device=None, non_blocking=False, memory_format=torch.preserve_format):
        target = self.redirect("cuda" if device is None else device)
        return tensor.to(target, non_blocking=non_blocking, memory_format=memory_format)


class CudaFactoriesOnCpu(CudaFactoriesOn):
    """:class:`CudaFactoriesOn` the CPU, ``pin_memory`` dropped: ``Tensor.cuda(...)`` returns the
    tensor itself, so ``module.cuda(...)`` leaves a module on the CPU."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), pin_memory=False)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:  # as it is, meta tensors included
            return args[0]
        return super().__torch_function__(func, types, args, kwargs)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class CudaTypeNames(TorchFunctionMode):
    """``Tensor.type()`` answers ``'torch.cuda.<Name>Tensor'`` for a float32 / float16 /
    bfloat16 tensor off CUDA (CPU, NPU), while Megatron's mixed-precision optimizers sort their
    parameters."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type != "cuda" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        return func(*args, **kwargs)


def with_cuda_type_names(init):
    """``init`` (an optimizer constructor) run under :class:`CudaTypeNames`."""

    @functools.wraps(init)
    def constructor(self, *args, **kwargs):
        with CudaTypeNames():
            init(self, *args, **kwargs)

    constructor.__wrapped_cpu_shim__ = init
    return constructor


def is_cuda_device(device) -> bool:
    """Whether ``device`` (a ``torch.device`` or a string) names CUDA."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


# torch.cuda entry points. One function per replaced entry point: torch's dynamo keeps a rule
# per ``torch.cuda`` function object and asserts when two names share one object.


def cpu_device() -> torch.device:
    """``torch.cuda.current_device``: the CPU."""
    return torch.device("cpu")


def synchronize_nothing(device=None) -> None:
    """``torch.cuda.synchronize``: CPU work is synchronous."""


def no_device_memory(device=None) -> tuple[int, int]:
    """``torch.cuda.mem_get_info``: ``(free, total) = (0, 0)``, no device memory."""
    return 0, 0


def cpu_device_name(device=None) -> str:
    """``torch.cuda.get_device_name``."""
    return "CPU"


def select_no_device(device) -> None:
    """``torch.cuda.set_device``: there is no device to select."""


def collect_nothing() -> None:
    """``torch.cuda.ipc_collect``: no IPC memory to collect."""


class CpuStream:
    """``torch.cuda.Stream`` on the CPU, where every operation is synchronous: all no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_DEFAULT_STREAM = CpuStream()


def current_cpu_stream(device=None) -> CpuStream:
    """``torch.cuda.current_stream``: the one CPU stream."""
    return _CPU_DEFAULT_STREAM


def on_cpu_stream(stream=None):
    """``torch.cuda.stream(s)``: a context that changes nothing."""
    return contextlib.nullcontext()


# Megatron


def make_cpu_rng_tracker():
    """A Megatron RNG tracker whose named streams are CPU generator states."""
    return rng_tracker_on(torch)


def rng_tracker_on(generator):
    """A Megatron RNG tracker whose named streams are states of ``generator``: a module with
    ``get_rng_state()``, ``set_rng_state(state)`` and ``manual_seed(seed)`` (``torch`` for the
    CPU, ``torch.npu`` for the current NPU)."""
    from megatron.core.tensor_parallel import random as mp_random

    class GeneratorRngTracker(mp_random.CudaRNGStatesTracker):
        """Megatron's tracker on ``generator``: ``fork(name)`` swaps its state in and out."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            outer = generator.get_rng_state()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_rng_state()
            generator.set_rng_state(outer)
            self.seeds_.add(seed)
            self._is_initialized = True

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = generator.get_rng_state()
            generator.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = generator.get_rng_state()
                generator.set_rng_state(outer)

    return GeneratorRngTracker()


def get_cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    """Megatron's ``_get_cuda_rng_state``: the CPU generator's state (full recompute)."""
    return torch.get_rng_state()


def set_cpu_rng_state(state, *args, **kwargs) -> None:
    """Megatron's ``_set_cuda_rng_state``."""
    torch.set_rng_state(state)


def splits_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the CPU: honour
    ``as_numpy`` (the alltoall dispatcher's split sizes must reach ``all_to_all_single`` as plain
    numbers; Megatron converts only ``is_cuda`` tensors)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


class UnevenGatherOnGloo:
    """Megatron's ``mappings._gather_along_first_dim`` that also gathers unequal row counts
    (the alltoall dispatcher under EP x TP), which gloo refuses: padded, gathered, unpadded."""

    def __init__(self, original) -> None:
        self.original = original

    def __call__(self, input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1:
            return self.original(input_, group, output_split_sizes, use_global_buffer)
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((longest * len(sizes), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
        chunks = gathered.split(longest)
        return torch.cat([chunk[:n] for chunk, n in zip(chunks, sizes)])


def clip_grads_without_type_check(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA type assertion (any device)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(coeff)
