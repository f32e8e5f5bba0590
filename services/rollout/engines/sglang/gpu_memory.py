"""GPU memory in use on this host, read with nvidia-smi: what another process (an SGLang server) holds is not in
this process's torch allocator, and device-wide numbers need no CUDA context here."""

from __future__ import annotations

import shutil
import subprocess

MIB = 1 << 20


def device_memory_used_bytes(*, timeout_s: float) -> int | None:
    """Memory in use on every GPU of this host, summed; None without nvidia-smi or when it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
        return sum(int(line.strip()) for line in out.splitlines() if line.strip()) * MIB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
