"""`tandem ctl episodes` and `tandem ctl reward`: an external agent process's side of rollout.agent: external, over
the rollout service's endpoint (app.py's /episodes routes). Which endpoint: --endpoint URL, else the one the run's
rollout service wrote to RUN_DIR/openai_api/rollout-<replica>.json when it started.

    tandem ctl episodes --run-dir runs/x --max 8    # JSON lines: episode_id, base_url, row, seconds_left
    tandem ctl reward --run-dir runs/x --episode ep-... --reward 1.0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from services.contracts.config_base import ConfigError
from services.contracts.exits import ExitCode
from services.contracts.files import write_json_atomic
from services.contracts.untyped import JsonObject, JsonValue

ENDPOINT_DIR = "openai_api"


def write_endpoint_file(run_dir: Path, replica: int, url: str) -> Path:
    """Where a run's rollout replica serves the endpoint (its port may be chosen at start)."""
    (run_dir / ENDPOINT_DIR).mkdir(parents=True, exist_ok=True)
    return write_json_atomic(run_dir / ENDPOINT_DIR / f"rollout-{replica}.json", {"url": url, "replica": replica})


def find_endpoint(*, endpoint: str | None, run_dir: Path | None, replica: int = 0) -> str:
    if endpoint:
        return endpoint.rstrip("/")
    if run_dir is None:
        raise ConfigError(
            "tandem ctl episodes/reward: give --endpoint URL or --run-dir of a run with an agent endpoint"
        )
    path = run_dir / ENDPOINT_DIR / f"rollout-{replica}.json"
    try:
        return str(json.loads(path.read_text())["url"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"--run-dir {run_dir}: no endpoint file {path} ({type(exc).__name__}); is rollout.openai_api.enabled "
            "set and the rollout service up?"
        ) from None


def _post(url: str, body: JsonObject, *, token: str | None, timeout_s: float) -> tuple[int, JsonValue]:
    import httpx

    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.post(url, json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return 0, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
    try:
        return reply.status_code, reply.json()
    except ValueError:
        return reply.status_code, {"error": {"message": reply.text[:500]}}


def claim_episodes(url: str, *, token: str | None, limit: int, timeout_s: float) -> int:
    status, body = _post(f"{url}/episodes/claim", {"max": limit}, token=token, timeout_s=timeout_s)
    if status != 200:
        return _failed("episodes", status, body)
    for episode in body["episodes"]:
        print(json.dumps(episode, sort_keys=True))
    return ExitCode.OK


def post_reward(url: str, *, token: str | None, episode: str, reward: float, timeout_s: float) -> int:
    status, body = _post(f"{url}/episodes/{episode}/reward", {"reward": reward}, token=token, timeout_s=timeout_s)
    if status != 200:
        return _failed("reward", status, body)
    print(json.dumps(body, sort_keys=True))
    return ExitCode.OK


def _failed(action: str, status: int, body: JsonValue) -> int:
    message = body.get("error", {}).get("message") if isinstance(body, dict) else body
    print(f"tandem ctl {action}: {status or 'no answer'}: {message}", file=sys.stderr)
    return ExitCode.FAILED
