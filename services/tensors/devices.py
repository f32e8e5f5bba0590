"""Small device facts shared by the services."""

from __future__ import annotations

import torch


def cuda_reserved_bytes() -> int:
    """CUDA memory this process's torch allocator holds on every device (what other processes cannot use);
    0 without CUDA or before this process touched a GPU."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))
