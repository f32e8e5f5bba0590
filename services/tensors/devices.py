"""Small device facts shared by the services."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

GPU_SERVICE_CPU_THREADS = 4  # intra-op CPU threads of a service computing on a GPU, unless configured


def cuda_reserved_bytes() -> int:
    """CUDA memory this process's torch allocator holds on every device (what other processes cannot use);
    0 without CUDA or before this process touched a GPU."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))


def cuda_peak_reserved_bytes(*, reset: bool) -> int:
    """The most CUDA memory this process's allocator held at once since the last reset (summed over devices): what
    a process sharing the GPU had to leave free. 0 without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    peak = sum(torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count()))
    if reset:
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
    return peak


def cuda_peak_metrics() -> dict[str, float]:
    """{"gpu_gb_peak": GiB} of cuda_peak_reserved_bytes since the previous call (which it resets); {} without CUDA."""
    peak = cuda_peak_reserved_bytes(reset=True)
    return {"gpu_gb_peak": peak / 2**30} if peak else {}


def limit_cpu_threads(configured: int | None, device: torch.device) -> None:
    """A service computing on a GPU needs few CPU threads: its host work is small tensor ops (batch preparation,
    micro-batch building, sampling metadata) that torch would spread over every core, and with the trainer, the
    rollout engine and SGLang on one host those pools spin against each other (tens of ms per step on a 16-core
    H200 host). `configured` (trainer.cpu_threads / rollout.cpu_threads) overrides; None on a CPU device keeps
    torch's default, since there the threads do the model's compute."""
    threads = configured if configured is not None else (GPU_SERVICE_CPU_THREADS if device.type == "cuda" else None)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        log.info("intra-op CPU threads: %d", threads)
