"""A process's own age, which every service logs as 'ready N s after its process started'."""

from __future__ import annotations

import subprocess
import sys

from services.telemetry.process_age import process_age_s


def test_a_process_knows_how_long_ago_it_started():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(1.2); "
            "from services.telemetry.process_age import process_age_s; print(process_age_s())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert 1.2 <= float(out.stdout) < 30.0
    assert process_age_s() > 0.0  # this test process too
