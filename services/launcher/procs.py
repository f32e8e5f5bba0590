"""Child processes that die with the process that started them, even when it is killed with kill -9."""

from __future__ import annotations

import os
import sys

# Runs in the child before it becomes the program: PR_SET_PDEATHSIG survives exec, so the program gets SIGKILL
# when its parent dies. SIGKILL, not SIGTERM: a service asked to stop gracefully waits for peers that are dying
# with it (a coordinator's final save, a pool waiting for a restart), and an orphan must not linger; every
# service already survives kill -9 (checkpoints, the AOF, pending entries). Not a preexec_fn: Python code between
# fork and exec can deadlock once other threads (gRPC's) run. A parent that died before the prctl is no longer
# getppid(): then the child exits at once.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def dies_with_parent(argv: list[str]) -> list[str]:
    """`argv` wrapped so that the program gets SIGKILL when this process dies (Linux; elsewhere it just runs).
    The signal follows the thread that starts the child: start it from a thread that lives as long as it should
    (the main thread, as `tandem run` does)."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
