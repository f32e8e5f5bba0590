"""A judge parser for tests/test_reward_e2e.py: examples/judge.yaml's verdict regex, which holds the Score call
that parses while the file named by $TANDEM_TEST_HOLD exists (having created `<that file>.in_call`), so the test
can kill -9 the reward service with a batch in flight. Without the variable it is the plain regex."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

VERDICT = re.compile(r"^\s*([01])\s*$")


def verdict(text: str) -> float | None:
    hold = os.environ.get("TANDEM_TEST_HOLD")
    if hold and Path(hold).exists():
        Path(f"{hold}.in_call").touch()
        while Path(hold).exists():  # until the test has killed this process and lifted the hold
            time.sleep(0.05)
    m = VERDICT.match(text)
    return float(m.group(1)) if m else None
