"""The small shims Megatron-Core needs to train on a CPU (gloo), in one place.

Megatron-Core assumes CUDA in a few spots (see ``megatron_core.md`` in the project reference):
``torch.cuda.current_device()`` for allocations, a CUDA RNG tracker, ``device="cuda"`` factory
calls in the pipeline schedules and grad buffers, ``torch.cuda.synchronize()`` in p2p and
checkpoint saving. ``apply()`` answers each of them on the CPU:

====================================  ==================================================
Megatron does                         on CPU, after ``apply()``
====================================  ==================================================
``torch.cuda.current_device()``       returns ``torch.device("cpu")``
``torch.cuda.synchronize()``          does nothing
RNG tracker ``fork()`` / ``add()``    ``CpuRngTracker``: real CPU generator states
``_get/_set_cuda_rng_state``          the CPU generator's state (full recompute)
``torch.zeros(..., device="cuda")``   ``CudaFactoriesOnCpu`` rewrites the device to CPU
``tensor.cuda(...)`` / ``module.cuda``  ``CudaFactoriesOnCpu`` keeps the tensor on the CPU
``pin_memory=True``                   ``CudaFactoriesOnCpu`` drops it (no pinned allocator)
gradient clipping (asserts            ``clip_grads_on_cpu``: the same scaling, no CUDA
``torch.cuda.FloatTensor`` grads)     type assertion
``torch.cuda.Stream()``,              ``CpuStream``: a stream that runs nothing (CPU work is
``current_stream()``, ``stream(s)``   synchronous), for the MoE alltoall dispatcher's
                                      device-to-host side stream
alltoall dispatcher's split sizes     ``splits_to_host``: CPU tensors become numpy arrays too
(``maybe_move_tensor_to_cpu`` only    (``all_to_all_single`` takes lists, not tensors)
converts CUDA tensors to numpy)
uneven sequence-parallel gather       ``UnevenGatherOnGloo``: each rank's rows padded to the
(the alltoall dispatcher under        longest, one even ``all_gather_into_tensor``, padding
EP x TP: ``all_gather`` with          dropped (gloo's list ``all_gather`` refuses unequal
``output_split_sizes``)               sizes; its uneven ``reduce_scatter`` works)
mixed-precision optimizers' type      ``CudaTypeNames`` while ``DistributedOptimizer`` /
check (``param.type()`` against       ``Float16OptimizerWithFloat16Params`` are constructed:
``'torch.cuda.BFloat16Tensor'`` ...:  ``Tensor.type()`` (no argument) of a CPU tensor
``distrib_optimizer.py:361, 420,      answers the CUDA name of its dtype; the fp32 main
582``; ``optimizer.py:671, 690``)     params are built as on CUDA. Only inside those two
                                      constructors
``torch.cuda.mem_get_info()``         ``(0, 0)``: no device memory (verl's
(verl's ``log_gpu_memory_usage``,     ``log_gpu_memory_usage`` at the end of
``verl/utils/profiler/                ``engine.initialize()`` then logs 0.00/0.00 GB)
performance.py:54``)
``torch.cuda.get_device_name()``      ``"CPU"`` (verl's FLOPs table has a CPU entry, so
(verl's FLOPs counter,                ``train_batch`` reports an ``mfu`` against it)
``verl/utils/flops_counter.py:80``,
whenever ``global_token_num`` is
given, as verl's SFT trainer does)
``torch.cuda.set_device(i)``          does nothing (torch's ``init_device_mesh("cuda", ...)``
(``DeviceMesh`` for a ``cuda`` mesh,  and verl's rollout mesh in its Ray workers)
verl's Ray workers)
``torch.cuda.ipc_collect()``          does nothing (there is no IPC to collect; on a CPU torch
(verl's ``aggressive_empty_cache``)   it would try to initialise CUDA)
====================================  ==================================================

Only ``mcore_npu.training.runtime`` imports this module, and only on a machine without an accelerator:
``apply()`` refuses to run where CUDA or an NPU is available. It is idempotent and ``revert()``
undoes it (for tests).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from mcore_npu.allocator.device import current_accelerator


class CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (or ``cuda:N``) in torch calls to the CPU and drops
    ``pin_memory=True`` (no pinned allocator without an accelerator).

    ``Tensor.cuda(...)`` returns the tensor itself (so ``module.cuda(torch.cuda.current_device())``,
    as model builders such as mbridge's ``get_model`` call it, leaves the module on the CPU, and
    Megatron's RoPE under context parallelism builds its chunk index on the CPU).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class CudaTypeNames(TorchFunctionMode):
    """``Tensor.type()`` without an argument answers ``'torch.cuda.<Name>Tensor'`` for a CPU tensor
    of dtype float32 / float16 / bfloat16 (what the tensor would be called on CUDA).

    Megatron's mixed-precision optimizers sort parameters into fp16/bf16 (fp32 main copy made)
    and fp32 by comparing ``param.type()`` with CUDA type names, and raise ``TypeError`` on
    anything else. Active only while those constructors run (see ``_with_cuda_type_names``);
    ``tensor.type(dtype)`` conversions and every other call are untouched.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        return func(*args, **kwargs)


def _with_cuda_type_names(init):
    """``init`` (an optimizer constructor) run under :class:`CudaTypeNames`."""

    @functools.wraps(init)
    def constructor(self, *args, **kwargs):
        with CudaTypeNames():
            init(self, *args, **kwargs)

    constructor.__wrapped_cpu_shim__ = init
    return constructor


def _no_device_memory(device=None) -> tuple[int, int]:
    """``torch.cuda.mem_get_info`` on a CPU: ``(free, total) = (0, 0)``, no device memory."""
    return 0, 0


def _cpu_device_name(device=None) -> str:
    """``torch.cuda.get_device_name`` on a CPU."""
    return "CPU"


def _select_no_device(device) -> None:
    """``torch.cuda.set_device`` on a CPU: there is no device to select.

    One function per replaced entry point: torch's dynamo keeps a rule per ``torch.cuda``
    function object and asserts when two names share one object."""


def _collect_nothing() -> None:
    """``torch.cuda.ipc_collect`` on a CPU: no IPC memory to collect."""


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _rng_tracker_base():
    from megatron.core.tensor_parallel import random as mp_random

    return mp_random.CudaRNGStatesTracker


def make_cpu_rng_tracker():
    """A Megatron RNG tracker whose named streams are CPU generator states."""

    class CpuRngTracker(_rng_tracker_base()):
        """Megatron's tracker with CPU states: ``fork(name)`` swaps the CPU RNG in and out."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)
            self.seeds_.add(seed)
            self._is_initialized = True

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRngTracker()


class CpuStream:
    """A stand-in for ``torch.cuda.Stream`` on the CPU, where every operation is synchronous:
    waiting, recording events and synchronising are no-ops."""

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


def splits_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the CPU: honour
    ``as_numpy`` (the alltoall dispatcher's split sizes must reach gloo as plain numbers)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


class UnevenGatherOnGloo:
    """Megatron's ``mappings._gather_along_first_dim`` that also gathers unequal row counts.

    Megatron gathers the alltoall dispatcher's tokens over the tensor-parallel group with
    ``torch.distributed.all_gather`` into unequal chunks (``output_split_sizes``), which NCCL
    and HCCL accept and gloo refuses. With unequal sizes this pads each rank's ``[n_r, ...]``
    rows to ``[max n, ...]``, gathers them evenly and keeps the first ``n_r`` rows of each: the
    same ``[sum n_r, ...]`` result, rank by rank. Every other call goes to Megatron's function.
    """

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


@dataclass
class _Shims:
    """What ``apply()`` replaced, so ``revert()`` can put it back."""

    originals: dict[str, object] = field(default_factory=dict)
    mode: CudaFactoriesOnCpu | None = None
    threads: bool = False  # apply_in_new_threads() is on

    @property
    def applied(self) -> bool:
        return self.mode is not None


_SHIMS = _Shims()


def apply() -> None:
    """Install the CPU shims (idempotent). Refuses on a machine with an accelerator."""
    if _SHIMS.applied:
        return
    accelerator = current_accelerator()
    if accelerator != "cpu":
        raise RuntimeError(
            f"cpu_support.apply(): this machine has an accelerator ({accelerator}); the CPU "
            "shims must never be active next to one. Run on the accelerator instead."
        )
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import random as mp_random

    originals = _SHIMS.originals
    originals["torch.cuda.current_device"] = torch.cuda.current_device
    originals["torch.cuda.synchronize"] = torch.cuda.synchronize
    originals["tracker"] = mp_random._CUDA_RNG_STATE_TRACKER
    originals["tracker_initialized"] = mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    originals["_get_cuda_rng_state"] = mp_random._get_cuda_rng_state
    originals["_set_cuda_rng_state"] = mp_random._set_cuda_rng_state
    originals["clip_grad_by_total_norm_fp32"] = megatron_optimizer.clip_grad_by_total_norm_fp32
    for name in ("Stream", "current_stream", "stream"):
        originals[f"torch.cuda.{name}"] = getattr(torch.cuda, name)
    from megatron.core.transformer.moe import token_dispatcher

    originals["maybe_move_tensor_to_cpu"] = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = splits_to_host
    from megatron.core.tensor_parallel import mappings

    originals["_gather_along_first_dim"] = mappings._gather_along_first_dim
    mappings._gather_along_first_dim = UnevenGatherOnGloo(mappings._gather_along_first_dim)

    from megatron.core.optimizer import distrib_optimizer

    for cls in (
        distrib_optimizer.DistributedOptimizer,
        megatron_optimizer.Float16OptimizerWithFloat16Params,
    ):
        originals[f"{cls.__name__}.__init__"] = cls.__dict__["__init__"]
        cls.__init__ = _with_cuda_type_names(cls.__dict__["__init__"])
    for name in ("mem_get_info", "get_device_name", "set_device", "ipc_collect"):
        originals[f"torch.cuda.{name}"] = getattr(torch.cuda, name)
    torch.cuda.mem_get_info = _no_device_memory
    torch.cuda.get_device_name = _cpu_device_name
    torch.cuda.set_device = _select_no_device
    torch.cuda.ipc_collect = _collect_nothing

    torch.cuda.Stream = CpuStream
    torch.cuda.current_stream = lambda device=None: _CPU_DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    mp_random._CUDA_RNG_STATE_TRACKER = make_cpu_rng_tracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip_grads_on_cpu
    _SHIMS.mode = CudaFactoriesOnCpu()
    _SHIMS.mode.__enter__()


def apply_in_new_threads() -> None:
    """Make :class:`CudaFactoriesOnCpu` active in every thread started from now on.

    A torch function mode is thread-local: ``apply()`` enters it in the calling thread only.
    Processes whose work runs in threads they start later (a Ray actor runs its tasks in an
    executor's threads, not in the thread that imported the shims) call this once after
    ``apply()``: each new ``threading`` thread enters its own mode on its first Python call
    (``threading.setprofile``, a hook that removes itself at once). ``revert()`` turns it off.
    """
    if not _SHIMS.applied:
        raise RuntimeError("cpu_support.apply_in_new_threads(): call apply() first")
    threading.setprofile(_enter_mode_in_thread)
    _SHIMS.threads = True


def _enter_mode_in_thread(frame, event, arg) -> None:
    """The one-shot profile hook of a new thread: enter the CPU factories mode, unhook."""
    sys.setprofile(None)
    if _SHIMS.applied:
        CudaFactoriesOnCpu().__enter__()


def revert() -> None:
    """Undo ``apply()`` (tests use it to leave the process as they found it)."""
    if not _SHIMS.applied:
        return
    if _SHIMS.threads:
        threading.setprofile(None)
        _SHIMS.threads = False
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import random as mp_random

    _SHIMS.mode.__exit__(None, None, None)
    originals = _SHIMS.originals
    torch.cuda.current_device = originals["torch.cuda.current_device"]
    torch.cuda.synchronize = originals["torch.cuda.synchronize"]
    mp_random._CUDA_RNG_STATE_TRACKER = originals["tracker"]
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = originals["tracker_initialized"]
    mp_random._get_cuda_rng_state = originals["_get_cuda_rng_state"]
    mp_random._set_cuda_rng_state = originals["_set_cuda_rng_state"]
    megatron_optimizer.clip_grad_by_total_norm_fp32 = originals["clip_grad_by_total_norm_fp32"]
    for name in ("Stream", "current_stream", "stream", "mem_get_info", "get_device_name",
                 "set_device", "ipc_collect"):  # fmt: skip
        setattr(torch.cuda, name, originals[f"torch.cuda.{name}"])
    from megatron.core.optimizer import distrib_optimizer

    for cls in (
        distrib_optimizer.DistributedOptimizer,
        megatron_optimizer.Float16OptimizerWithFloat16Params,
    ):
        cls.__init__ = originals[f"{cls.__name__}.__init__"]
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = originals["maybe_move_tensor_to_cpu"]
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = originals["_gather_along_first_dim"]
    _SHIMS.originals.clear()
    _SHIMS.mode = None


def clip_grads_on_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA type assertion."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(coeff)


def seed_if_applied(seed: int) -> bool:
    """Where the shims are applied, :func:`seed_cpu_streams` with this process's Megatron ranks
    (parallel state must be initialised); returns whether it seeded. Megatron seeds its tracker
    only on a device (``model_parallel_cuda_manual_seed``), so engines built on a CPU call this."""
    if not _SHIMS.applied:
        return False
    from megatron.core import parallel_state as mpu

    seed_cpu_streams(
        seed,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
    )
    return True


def seed_cpu_streams(seed: int, *, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Seed the CPU generator and Megatron's three named streams (as Megatron seeds CUDA)."""
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add("data-parallel-rng", seed)
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
    tracker.add("expert-parallel-rng", seed + 1024 + 100 * ep_rank + etp_rank)
