"""The buffer and the coordinator's loop are torch-free: importing them must not load torch (1.6 s, and the
coordinator process has no use for it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["services.buffer.stream", "services.coordinator.loop"])
def test_importing_does_not_load_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing {module} loaded torch: {done.stdout.strip()[:300]}"
