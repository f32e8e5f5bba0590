"""Contract tests of the sglang engine's HTTP side: the adapter against the contract test server.

The server (tests/helpers/sglang_contract_server.py) is a real HTTP server in its own process that implements the
request and answer shapes recorded from SGLang's source for the supported versions (0.5.15, 0.5.17 — the one that
ran on the GPU, docs/sglang.md —, 0.5.23) and the version answer of an unsupported one (0.4.10). No real SGLang runs
here: these tests check the adapter against the recorded contract; bench/sglang_smoke.py checks the same facts
against a real server.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.sglang_contract_server import ContractServer

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.engine_errors import EngineUnavailable
from services.rollout.engines.sglang.engine import SGLangEngine
from services.rollout.engines.sglang.http import (
    SGLangClient,
    SGLangRequestError,
    SGLangTimeout,
    SGLangUnavailable,
)
from services.rollout.engines.sglang.launch import LaunchSpec, SGLangNotInstalled, require_sglang
from services.rollout.engines.sglang.protocol import (
    UnsupportedSGLangVersion,
    parse_release,
    profile_for,
    sampling_params,
)

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server():
    s = ContractServer("--profile", "0.5.17", "--enable-memory-saver")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(server: ContractServer):
    e = SGLangEngine([server.url], startup_timeout_s=20, request_timeout_s=20)
    yield e
    e.close()


def requests_to(server: ContractServer, path: str) -> list[dict]:
    return [e["body"] for e in server.log() if e["path"] == path]


def expected(prompt: list[int], n: int, *, vocab: int = 22) -> list[int]:
    """The contract server's generation rule."""
    return [(prompt[-1] + 1 + i) % vocab for i in range(n)]


def test_sglang_contract_version_detection_per_profile(server: ContractServer, engine: SGLangEngine):
    old = ContractServer("--profile", "0.5.15")
    try:
        older = SGLangEngine([old.url], startup_timeout_s=20)
        assert older.servers[0].profile.version == "0.5.15" and older.servers[0].profile.session == "probe"
        paths = [e["path"] for e in old.log()]
        assert paths[:3] == ["/health_generate", "/server_info", "/get_server_info"]  # 404, then the old route
        older.close()
    finally:
        old.stop()
    assert engine.servers[0].profile.session == "probe"  # 0.5.17 has no begin/end routes: probed, then skipped
    assert [e["path"] for e in server.log()][:3] == ["/health_generate", "/server_info", "/v1/models"]
    assert engine.max_context_length == 128 and engine.engine_ranks == 1 and engine.weight_version == 0


def test_sglang_contract_unsupported_version_is_refused_by_name():
    old = ContractServer("--profile", "0.4.10")
    try:
        with pytest.raises(UnsupportedSGLangVersion, match=r"runs version 0\.4\.10; .*SGLang >=0\.5\.15, <0\.6"):
            SGLangEngine([old.url], startup_timeout_s=20)
    finally:
        old.stop()
    with pytest.raises(UnsupportedSGLangVersion, match="not a version number"):
        profile_for("main", url="http://x")


def test_sglang_contract_version_boundaries():
    assert parse_release("0.5.15.post1") == (0, 5, 15) and parse_release("0.5.23.dev40+g1a2b") == (0, 5, 23)
    assert parse_release("0.5.16rc2") == (0, 5, 16) and parse_release("nightly") is None
    for refused in ("0.5.14", "0.4.10", "0.6.0", "1.0.0"):
        with pytest.raises(UnsupportedSGLangVersion):
            profile_for(refused, url="http://x")
    assert [profile_for(v, url="http://x").session for v in ("0.5.15", "0.5.22", "0.5.23", "0.5.40")] == [
        "probe",
        "probe",
        "required",
        "required",
    ]


def test_sglang_contract_generate_maps_tokens_log_probs_and_finish_reasons(
    server: ContractServer, engine: SGLangEngine
):
    out = engine.generate(
        [[1, 5, 6], [3, 1], [7, 9]], SamplingSpec(temperature=0.7, top_k=0, max_new_tokens=4, stop_token_ids=(11,))
    )
    assert [o.token_ids for o in out] == [tuple(expected([6], 4)), (2,), (10, 11)]
    assert [o.finish_reason for o in out] == ["length", "stop", "stop"]  # EOS 2 and stop id 11 kept as last token
    assert out[0].log_probs == pytest.approx([-(0.25 + 0.01 * t) for t in expected([6], 4)])
    assert all(o.weight_version == 0 for o in out)  # "default" before any update
    body = requests_to(server, "/generate")[-1]
    assert body["input_ids"] == [[1, 5, 6], [3, 1], [7, 9]] and body["return_logprob"] is True
    assert body["sampling_params"] == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 4,
        "ignore_eos": False,
        "stop_token_ids": [11],
    }
    (single,) = engine.generate([[1]], SamplingSpec(max_new_tokens=3, ignore_eos=True, seed=5))
    assert single.token_ids == (2, 3, 4) and single.finish_reason == "length"
    assert requests_to(server, "/generate")[-1]["sampling_params"]["sampling_seed"] == 5
    chunked = SGLangEngine([server.url], max_batch_size=2, startup_timeout_s=20)
    before = len(requests_to(server, "/generate"))
    outs = chunked.generate([[i + 3] for i in range(5)], SamplingSpec(max_new_tokens=1))
    assert [o.token_ids for o in outs] == [(i + 4,) for i in range(5)]
    # the chunks are sent concurrently: they may arrive in any order
    assert sorted(len(b["input_ids"]) for b in requests_to(server, "/generate")[before:]) == [1, 2, 2]
    chunked.close()
    # a data row's own max_new_tokens: per-prompt sampling params
    capped = engine.generate([[1], [3]], SamplingSpec(max_new_tokens=3, ignore_eos=True), max_new_tokens=[1, 9])
    assert [len(o.token_ids) for o in capped] == [1, 3]
    assert [p["max_new_tokens"] for p in requests_to(server, "/generate")[-1]["sampling_params"]] == [1, 3]


def test_sglang_contract_error_answers_are_clear(server: ContractServer, engine: SGLangEngine):
    with pytest.raises(SGLangRequestError, match=r"POST http://127\.0\.0\.1:\d+/generate answered 400: .*vocab size"):
        engine.generate([[1, 99]], SamplingSpec(max_new_tokens=2))
    with pytest.raises(ValueError, match="context holds 128"):
        engine.generate([[1] * 128], SamplingSpec(max_new_tokens=2))
    client = SGLangClient(server.url)
    with pytest.raises(SGLangRequestError, match=r"answered 400: .*unknown field"):  # a typo cannot pass silently
        client.post(
            "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "flush_cahce": 1}, timeout_s=5
        )
    update = {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}
    with pytest.raises(SGLangRequestError, match="answered 400: Group g not in"):  # {"success": false, ...}
        client.post("/update_weights_from_distributed", update, timeout_s=5)
    with pytest.raises(SGLangUnavailable, match="answered 500: Internal Server Error"):  # SamplingParams TypeError
        client.post("/generate", {"input_ids": [[1]], "sampling_params": {"temprature": 1.0}}, timeout_s=5)
    with pytest.raises(
        SGLangRequestError,
        match="answered 400: Requested token count exceeds the model's maximum context length of 128 tokens",
    ):  # 0.5.17 does not clamp
        client.post("/generate", {"input_ids": [[1] * 120], "sampling_params": {"max_new_tokens": 9}}, timeout_s=5)
    server.configure(fail={"/generate": "out of memory while scheduling"})
    try:
        with pytest.raises(SGLangRequestError, match="answered 400: out of memory while scheduling"):
            engine.generate([[1]], SamplingSpec(max_new_tokens=1))
    finally:
        server.configure(fail={})
    with pytest.raises(SGLangRequestError, match="answered 400: Input should be 'abort', 'retract' or 'in_place'"):
        client.post("/pause_generation", {"mode": "drain"}, timeout_s=5)


def test_sglang_contract_a_hung_server_fails_at_the_deadline(server: ContractServer):
    impatient = SGLangEngine([server.url], startup_timeout_s=20, request_timeout_s=1.5)
    server.configure(hang=["/generate", "/pause_generation"])
    try:
        start = time.monotonic()
        with pytest.raises(SGLangTimeout, match=r"/generate: no answer within 1\.5s"):
            impatient.generate([[1]], SamplingSpec(max_new_tokens=1))
        assert 1.4 < time.monotonic() - start < 4
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="/pause_generation: no answer within 1s"):
            impatient.pause("abort", timeout_s=1.0)
        assert time.monotonic() - start < 3
    finally:
        server.configure(hang=[])
        # the hung pause still lands once released: resume only after it did, or a loaded machine can deliver it
        # after the resume and leave the module's server paused for the next test
        _wait_for(lambda: requests_to(server, "/pause_generation") and server.state()["paused"] is not None)
        impatient.resume()
        _wait_for(lambda: server.state()["paused"] is None)
        impatient.close()


def test_sglang_contract_a_stopped_then_dead_server():
    s = ContractServer("--profile", "0.5.23")
    try:
        e = SGLangEngine([s.url], startup_timeout_s=20, request_timeout_s=1.0)
        s.proc.send_signal(signal.SIGSTOP)  # the process stops answering; the kernel still accepts connections
        start = time.monotonic()
        with pytest.raises(SGLangTimeout):
            e.generate([[1]], SamplingSpec(max_new_tokens=1))
        assert time.monotonic() - start < 3
        s.proc.send_signal(signal.SIGCONT)
        assert e.generate([[1]], SamplingSpec(max_new_tokens=1))[0].token_ids == (2,)
        s.stop()
        with pytest.raises(SGLangUnavailable, match="cannot reach the server"):
            e.generate([[1]], SamplingSpec(max_new_tokens=1))
        e.close()
    finally:
        s.stop()


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_sglang_contract_pause_abort_ends_running_samples(server: ContractServer, engine: SGLangEngine):
    server.configure(token_delay_s=0.02)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(engine.generate, [[1], [5]], SamplingSpec(max_new_tokens=100, ignore_eos=True))
            _wait_for(lambda: server.state()["running"] == 1)
            engine.pause("abort", timeout_s=10)
            aborted = running.result(timeout=20)
        assert [o.finish_reason for o in aborted] == ["abort", "abort"] and len(aborted[0].token_ids) < 100
        assert requests_to(server, "/pause_generation")[-1] == {"mode": "abort"}
        with pytest.raises(EngineUnavailable, match="paused"):  # new calls wait at the adapter while paused
            engine.generate([[1]], SamplingSpec(max_new_tokens=1), wait_timeout_s=0.2)
    finally:
        engine.resume()
        server.configure(token_delay_s=0.0)
    assert engine.generate([[1]], SamplingSpec(max_new_tokens=1))[0].finish_reason == "stop"


def test_sglang_contract_pause_retract_parks_and_continues(server: ContractServer, engine: SGLangEngine):
    server.configure(token_delay_s=0.01)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(engine.generate, [[1]], SamplingSpec(max_new_tokens=30, ignore_eos=True))
            _wait_for(lambda: server.state()["running"] == 1)
            engine.pause("retract", timeout_s=10)
            assert server.state()["parked"] == 1 and engine.get_state().paused
            engine.resume()
            (done,) = running.result(timeout=20)
        assert done.finish_reason == "length" and len(done.token_ids) == 30
        assert requests_to(server, "/pause_generation")[-1] == {"mode": "retract"}
        assert requests_to(server, "/continue_generation")[-1] == {}
    finally:
        server.configure(token_delay_s=0.0)


def test_sglang_contract_drain_waits_then_pauses_with_the_configured_mode(server: ContractServer):
    e = SGLangEngine([server.url], pause_mode="in_place", startup_timeout_s=20)
    server.configure(token_delay_s=0.01)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(e.generate, [[1]], SamplingSpec(max_new_tokens=20, ignore_eos=True))
            _wait_for(lambda: server.state()["running"] == 1)
            e.pause("drain", timeout_s=10)  # returns once the adapter's call has finished
            assert server.state()["running"] == 0 and requests_to(server, "/generate")[-1]["input_ids"] == [[1]]
            assert running.result(timeout=5)[0].finish_reason == "length"  # finished, not aborted or parked
        assert requests_to(server, "/pause_generation")[-1] == {"mode": "in_place"}
        state = e.get_state()
        assert state.paused and state.pause_mode == "drain" and state.in_flight == 0
    finally:
        server.configure(token_delay_s=0.0)
        e.resume()
        e.close()


def test_sglang_contract_memory_release_and_resume(server: ContractServer, tmp_path: Path):
    from safetensors.torch import save_file

    engine = SGLangEngine([server.url], startup_timeout_s=20)
    engine.release_memory(["kv_cache", "weights"])
    assert [e["path"] for e in server.log()][-2:] == ["/flush_cache", "/release_memory_occupation"]  # idle first
    assert requests_to(server, "/release_memory_occupation")[-1] == {"tags": ["kv_cache", "weights"]}
    assert server.state()["released"] == ["kv_cache", "weights"]
    with pytest.raises(EngineUnavailable, match="memory is released"):
        engine.generate([[1]], SamplingSpec(max_new_tokens=1))
    engine.release_memory(["weights"])  # released already: SGLang is not asked twice
    assert len(requests_to(server, "/release_memory_occupation")) == 1
    engine.resume_memory([])  # every tag: only those released are asked for (an unreleased one kills SGLang)
    assert requests_to(server, "/resume_memory_occupation")[-1] == {"tags": ["kv_cache", "weights"]}
    assert server.state()["released"] == [] and engine.get_state().released_memory == ()
    assert server.state()["weights_lost"]  # without --enable-weights-cpu-backup the contents are gone ...
    with pytest.raises(EngineUnavailable, match="weights came back empty from ResumeMemory"):
        engine.generate([[1]], SamplingSpec(max_new_tokens=1))  # ... so nothing is generated from them
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    engine.update_weights_from_disk(tmp_path, version=1)  # a sync refills them
    assert engine.generate([[1]], SamplingSpec(max_new_tokens=1))[0].weight_version == 1
    assert not server.state()["weights_lost"]
    engine.resume_memory(["weights"])
    assert len(requests_to(server, "/resume_memory_occupation")) == 1 and server.proc.poll() is None
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.release_memory(["activations"])
    engine.close()


def test_sglang_contract_a_busy_server_is_not_released(server: ContractServer, engine: SGLangEngine):
    """SGLang asserts an idle scheduler in release_memory_occupation (and dies otherwise, as the contract server
    does): another client's request parked by pause(retract) waits in its queue, so /flush_cache fails and the
    release stops there; one of the adapter's own calls stops it before any request."""
    server.configure(token_delay_s=0.01)
    try:
        with ThreadPoolExecutor(2) as pool:
            mine = pool.submit(engine.generate, [[1]], SamplingSpec(max_new_tokens=10, ignore_eos=True))
            _wait_for(lambda: server.state()["running"] == 1)
            with pytest.raises(EngineUnavailable, match=r"while 1 generate call\(s\) of this adapter run"):
                engine.release_memory([])
            mine.result(timeout=20)
            other = SGLangClient(server.url)
            running = pool.submit(
                other.post,
                "/generate",
                {"input_ids": [[1]], "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}},
                timeout_s=20,
            )
            _wait_for(lambda: server.state()["running"] == 1)
            engine.pause("retract", timeout_s=10)
            released = len(requests_to(server, "/release_memory_occupation"))
            with pytest.raises(
                EngineUnavailable,
                match=r"is not idle \(Flush cache failed\.\), so nothing was "
                r"released",
            ):
                engine.release_memory([])
            assert len(requests_to(server, "/release_memory_occupation")) == released
            assert server.proc.poll() is None and server.state()["released"] == []
            engine.resume()
            assert running.result(timeout=20).body[0]["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        server.configure(token_delay_s=0.0)


def test_sglang_contract_release_reports_the_freed_memory_with_a_fake_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """nvidia-smi cannot run here: a script of that name answers 50,000 MiB in use, then 2,000 (what a release of
    48 GiB looks like on the GPU), so the measurement and its way into the engine state are what is tested."""
    counter = tmp_path / "calls"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f"#!/bin/sh\nn=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}\n"
        f'if [ "$n" = 0 ]; then echo 50000; else echo 2000; fi\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    s = ContractServer("--profile", "0.5.17", "--enable-memory-saver")
    try:
        e = SGLangEngine([s.url], startup_timeout_s=20)
        e.release_memory([])
        assert e.get_state().memory_freed_bytes == 48000 * 2**20
        e.close()
    finally:
        s.stop()


def test_sglang_contract_context_limit_and_an_aborted_wait(server: ContractServer, engine: SGLangEngine):
    """0.5.17 refuses a whole request whose input + max_new_tokens exceed the context (it does not clamp): the
    adapter cuts that prompt's max_new_tokens to what the context leaves, and SGLang's scheduler makes 2 fewer (on
    the H200 too: bench/sglang_smoke.py). A request a pause(abort)
    reaches while it waits answers 499: the adapter returns aborted samples (the service retries), not bad input."""
    out = engine.generate([[1] * 120, [3]], SamplingSpec(max_new_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 20] and out[0].finish_reason == "length"
    sent = requests_to(server, "/generate")[-1]["sampling_params"]
    assert [p["max_new_tokens"] for p in sent] == [8, 20]
    client = SGLangClient(server.url)
    client.post("/pause_generation", {"mode": "retract"}, timeout_s=5)  # paused behind the adapter's back
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(engine.generate, [[4], [5]], SamplingSpec(max_new_tokens=2))
            _wait_for(
                lambda: (
                    len(requests_to(server, "/generate"))
                    and requests_to(server, "/generate")[-1]["input_ids"] == [[4], [5]]
                )
            )
            client.post("/pause_generation", {"mode": "abort"}, timeout_s=5)
            client.post("/continue_generation", {}, timeout_s=5)
            aborted = waiting.result(timeout=20)
        assert [o.finish_reason for o in aborted] == ["abort", "abort"] and aborted[0].token_ids == ()
    finally:
        client.post("/continue_generation", {}, timeout_s=5)


def test_sglang_contract_refuses_servers_that_report_other_log_probs():
    for flag, words in (
        ('rl_on_policy_target="fsdp"', "bf16 log-probs"),
        ("enable_deterministic_inference=true", "one seed"),
    ):
        s = ContractServer("--profile", "0.5.17", "--server-arg", flag)
        try:
            with pytest.raises(ValueError, match=f"runs with {flag.split('=')[0]}=.*{words}"):
                SGLangEngine([s.url], startup_timeout_s=20)
        finally:
            s.stop()


def test_sglang_contract_session_routes_of_0_5_23():
    s = ContractServer("--profile", "0.5.23")
    try:
        client = SGLangClient(s.url)
        update = {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}
        with pytest.raises(SGLangRequestError, match=r"answered 400: .*between begin_weight_update and end_weight_"):
            client.post("/update_weights_from_distributed", update, timeout_s=5)  # a session is required
        client.post("/begin_weight_update", {}, timeout_s=5)
        with pytest.raises(SGLangRequestError, match="answered 400: Group g not in"):
            client.post("/update_weights_from_distributed", update, timeout_s=5)
        client.post("/end_weight_update", {}, timeout_s=5)
        assert SGLangEngine([s.url], startup_timeout_s=20).servers[0].profile.session == "required"
    finally:
        s.stop()


def test_sglang_contract_memory_needs_the_memory_saver():
    s = ContractServer("--profile", "0.5.15")
    try:
        e = SGLangEngine([s.url], startup_timeout_s=20)
        with pytest.raises(EngineUnavailable, match="--enable-memory-saver"):
            e.release_memory(["weights"])
        assert requests_to(s, "/release_memory_occupation") == []  # refused before asking SGLang
        e.close()
    finally:
        s.stop()


def test_sglang_contract_api_key():
    s = ContractServer("--profile", "0.5.23", "--api-key", "sk-test")
    try:
        with pytest.raises(SGLangRequestError, match="answered 401: Unauthorized"):
            SGLangEngine([s.url], startup_timeout_s=20)
        e = SGLangEngine([s.url], api_key="sk-test", startup_timeout_s=20)
        assert e.generate([[4]], SamplingSpec(max_new_tokens=1))[0].token_ids == (5,)
        e.close()
    finally:
        s.stop()


def test_sglang_contract_launch_command_and_a_missing_sglang(tmp_path: Path):
    spec = LaunchSpec(
        model_path="/m/qwen",
        port=31000,
        api_key="k",
        extra_args=("--tp-size", "2", "--enable-memory-saver"),
        python="/usr/bin/python3",
    )
    assert spec.command() == [
        "/usr/bin/python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--api-key",
        "k",
        "--tp-size",
        "2",
        "--enable-memory-saver",
    ]
    assert spec.url == "http://127.0.0.1:31000"
    with pytest.raises(ValueError, match="must not set --port"):
        LaunchSpec(model_path="/m", port=1, extra_args=("--port=5",)).command()
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here; the missing-package error cannot be shown")
    with pytest.raises(SGLangNotInstalled, match=r"sglang package is not installed .* rollout.sglang.urls"):
        require_sglang()
    from services.contracts.config_loading import config_from_dict
    from services.rollout.builder import build_engine

    config = config_from_dict(
        {"model": {"path": str(tmp_path)}, "data": {"train_path": "x.jsonl"}, "rollout": {"engine": "sglang"}}
    )
    with pytest.raises(SGLangNotInstalled):
        build_engine(config)


def test_sglang_contract_build_engine_from_config(server: ContractServer, tmp_path: Path):
    from services.contracts.config_loading import config_from_dict
    from services.rollout.builder import build_engine

    config = config_from_dict(
        {
            "model": {"path": str(tmp_path)},
            "data": {"train_path": "x.jsonl"},
            "rollout": {
                "engine": "sglang",
                "max_batch_size": 3,
                "sglang": {
                    "urls": [server.url],
                    "pause_mode": "abort",
                    "weight_load_format": "flattened_bucket",
                    "request_timeout_s": 7,
                },
            },
        }
    )
    e = build_engine(config)
    try:
        assert isinstance(e, SGLangEngine) and e.max_batch_size == 3 and e._pause_mode == "abort"
        assert e._load_format == "flattened_bucket" and e._request_timeout_s == 7
    finally:
        e.close()


def test_sglang_contract_sampling_mapping_units():
    assert sampling_params(SamplingSpec(temperature=0.0, top_k=5, max_new_tokens=2)) == {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 5,
        "max_new_tokens": 2,
        "ignore_eos": False,
    }


def test_sglang_contract_concurrent_calls_share_the_engine(server: ContractServer, engine: SGLangEngine):
    results: list = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(
                engine.generate([[i + 3]], SamplingSpec(max_new_tokens=2, ignore_eos=True))[0].token_ids
            )
        )
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == sorted(tuple(expected([i + 3], 2)) for i in range(6))
