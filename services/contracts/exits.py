"""Exit codes of every `tandem` command and service process: what a supervisor (`tandem run`, compose, k8s) may
conclude from them."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # something went wrong that a restart may fix (a peer died, a transient error)
    BAD_INPUT = 2  # bad config, data, arguments or a taken port, found before anything ran: fix the input
    PERMANENT = 3  # the run failed on an error a restart would only repeat (a raising reward, a full disk)
    INTERRUPTED = 130  # Ctrl-C before a graceful stop could start
