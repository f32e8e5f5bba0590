"""Small device facts shared by the services."""

from __future__ import annotations

import torch


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
