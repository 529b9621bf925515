"""What the engine runs on: device, dtype, attention backend, CUDA graphs and the KV pool size.

Every "auto" in ``EngineArgs`` is resolved here, once, at engine start-up, into a
``DevicePlan``; nothing below reads a setting twice. Each function raises ValueError naming
the bad setting, so ``--attention-backend flashinfer`` on a CPU-only machine fails at start-up
with a message instead of deep inside a step.

Defaults, by device:

============================  ===================  ====================================
setting                       CPU                  CUDA
============================  ===================  ====================================
``dtype="auto"``              float32              bfloat16
``attention_backend="auto"``  torch                flashinfer if installed (bf16/fp16)
``cuda_graphs=None``          off (no CUDA)        on
``kv_cache_memory_bytes=None``  1 GiB              ``gpu_memory_utilization`` of the
                                                   device less this worker's weights
============================  ===================  ====================================
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import ATTENTION_BACKEND_CHOICES, resolve_dtype

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU default pool: the machine's RAM is not ours to take


def resolve_device(name: str) -> torch.device:
    """``EngineArgs.device`` -> a torch device; ValueError for CUDA on a machine without it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unsupported device {name!r}; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use cpu, cuda or auto")
    return device


def flashinfer_available() -> bool:
    """Whether the ``flashinfer`` package is installed (``pip install 'pdcluster[gpu]'``).
    Looks the package up without importing it: its import initialises CUDA."""
    return importlib.util.find_spec("flashinfer") is not None


def resolve_attention_backend(name: str, device: torch.device, dtype: str = "bfloat16",
                              have_flashinfer: Callable[[], bool] = flashinfer_available) -> str:
    """``"auto"`` -> flashinfer on CUDA when installed (else torch, with a warning), torch on
    CPU and for float32 (FlashInfer has no fp32 kernels; fp32 on a GPU is the exactness
    check against the CPU engine). ``"flashinfer"`` without CUDA, without the package, or
    with float32 is a ValueError."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; "
                         f"choose from {', '.join(ATTENTION_BACKEND_CHOICES)}")
    if name == "auto":
        if device.type != "cuda" or dtype == "float32":
            return "torch"
        if have_flashinfer():
            return "flashinfer"
        log.warning("CUDA without flashinfer installed: using the torch attention backend "
                    "(install pdcluster[gpu] for FlashInfer's paged kernels)")
        return "torch"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention backend 'flashinfer' needs a CUDA device "
                             f"(this engine runs on {device.type}); use 'torch' or 'auto'")
        if dtype == "float32":
            raise ValueError("attention backend 'flashinfer' has no float32 kernels: use "
                             "dtype bfloat16 or float16, or the 'torch' backend")
        if not have_flashinfer():
            raise ValueError("attention backend 'flashinfer' needs the flashinfer package: "
                             "pip install 'pdcluster[gpu]'")
    return name


def resolve_cuda_graphs(flag: bool | None, device: torch.device) -> bool:
    """``None`` -> on for CUDA, off for CPU; ``True`` without CUDA is a ValueError."""
    if flag is None:
        return device.type == "cuda"
    if flag and device.type != "cuda":
        raise ValueError("cuda_graphs=True needs a CUDA device "
                         f"(this engine runs on {device.type})")
    return flag


def kv_pool_bytes(explicit: int | None, device: torch.device, gpu_memory_utilization: float,
                  mem_info: Callable[[torch.device], tuple[int, int, int]] | None = None) -> int:
    """Bytes for the KV pool: ``explicit`` when given; on CPU 1 GiB; on CUDA what this
    process's own allocations (the weights) leave of ``gpu_memory_utilization`` of the
    device's memory, and never more than is free.

    Only this process's own use counts against its share, so workers sharing one GPU each
    pass their fraction (two workers: 0.45 each) and get the same pool whichever starts first.
    ``mem_info(device) -> (free, total, own)`` defaults to CUDA's free/total and this process's
    reserved bytes; call it after the weights are on the device. Raises ValueError when
    nothing is left.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if explicit is not None:
        if explicit <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {explicit}")
        return explicit
    if device.type != "cuda":
        return CPU_KV_CACHE_BYTES
    free, total, own = (mem_info or _cuda_mem_info)(device)
    # (1 - utilization) of the device stays free for activations, CUDA graphs, NCCL buffers
    # and whoever else shares the GPU; 5% of what is free now stays free whatever the cap.
    budget = min(int(total * gpu_memory_utilization) - own, int(free * 0.95))
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: this worker holds {own / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} of {total / 2**30:.1f} GiB are free, and "
            f"gpu_memory_utilization={gpu_memory_utilization} caps it at "
            f"{total * gpu_memory_utilization / 2**30:.2f} GiB")
    return budget


def _cuda_mem_info(device: torch.device) -> tuple[int, int, int]:
    free, total = torch.cuda.mem_get_info(device)
    return free, total, torch.cuda.memory_reserved(device)


@dataclass(frozen=True)
class DevicePlan:
    """The resolved form of EngineArgs' device settings (the pool size comes later, after
    the weights are loaded: ``kv_pool_bytes``)."""

    device: torch.device
    dtype: str
    attention_backend: str
    cuda_graphs: bool


def plan_device(device: str, dtype: str, attention_backend: str,
                cuda_graphs: bool | None) -> DevicePlan:
    """Resolve every "auto"; ValueError naming the first setting this machine cannot honour."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev.type)
    return DevicePlan(dev, dt, resolve_attention_backend(attention_backend, dev, dt),
                      resolve_cuda_graphs(cuda_graphs, dev))
