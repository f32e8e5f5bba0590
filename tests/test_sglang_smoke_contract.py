"""bench/sglang_smoke.py checks on a real SGLang server the facts the contract server encodes; here its generation
checks run against the contract server (0.5.17 profile) and must all pass: the two agree on what SGLang does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.sglang_contract_server import ContractServer

pytestmark = pytest.mark.timeout(120)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_the_smoke_checks_pass_against_the_contract_server():
    import sglang_smoke

    server = ContractServer("--profile", "0.5.17")
    try:
        server.configure(token_delay_s=0.02)  # a long request must still run when the smoke flushes
        sglang_smoke.RESULTS.clear()
        sglang_smoke.generation_checks(server.url)
        failed = [(name, detail) for name, ok, detail in sglang_smoke.RESULTS if not ok]
        assert not failed, failed
        assert len(sglang_smoke.RESULTS) == 6 and server.proc.poll() is None
    finally:
        server.stop()
