"""A small JSON-over-HTTP client for SGLang's native server API (standard library only: http.client).

Every call has one total deadline: the socket timeout is set to what is left of it before connecting, before
waiting for the status line and before each read of the body, so a server that stops answering (or trickles
bytes) fails the call at its deadline and not later. One connection per call (`Connection: close`).

Error answers become exceptions that carry SGLang's own words. The shapes below are recorded from SGLang's
`python/sglang/srt/entrypoints/http_server.py` (0.5.x, and the 0.5.17 wheel for 499 and 500; bench/sglang_smoke.py
checks them on a real server):
  - weight and group endpoints answer 400 `{"success": false, "message": ...}` (ORJSONResponse);
  - /generate and the memory endpoints answer 400 `{"error": {"message": ...}}` (`_create_error_response`);
  - request validation answers 400 `{"object": "error", "message": ..., "type": "Bad Request", "code": 400}`
    (its RequestValidationError handler turns FastAPI's 422 into 400);
  - an unknown route answers FastAPI's 404 `{"detail": "Not Found"}` (how a missing endpoint of an older
    version shows up);
  - /flush_cache answers plain text (200, or 400 while requests are running);
  - /health_generate answers 200 or 503 with no body;
  - a /generate request aborted while it waited (pause_generation abort, then continue) answers 499
    `{"error": {"message": "Request ... was aborted"}}` (RequestAbortedError): retryable, not bad input;
  - an exception the handlers do not catch (e.g. an unknown sampling key) answers 500 "Internal Server Error".
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.contracts.untyped import JsonValue

_READ_CHUNK = 1 << 16
ABORTED_STATUS = 499  # SGLang's RequestAbortedError (a client-closed-request code, not a 4xx of bad input)


class SGLangError(RuntimeError):
    """An SGLang call failed; the message names the server, the endpoint and SGLang's reason."""

    def __init__(self, message: str, *, url: str = "", path: str = "", status: int = 0, reason: str = ""):
        super().__init__(message)
        self.url, self.path, self.status, self.reason = url, path, status, reason


class SGLangRequestError(SGLangError, ValueError):
    """SGLang refused the request (4xx): a bad argument or an operation the server cannot do now."""


class SGLangNotFound(SGLangRequestError):
    """404: this server has no such endpoint (an older or newer version than the adapter expects)."""


class SGLangUnavailable(SGLangError, ConnectionError):
    """The server is not reachable, closed the connection, or answered 5xx (e.g. 503 while starting)."""


class SGLangAborted(SGLangUnavailable):
    """499: SGLang aborted the request (a pause with mode abort reached it while it waited); retry it."""


class SGLangTimeout(SGLangError, TimeoutError):
    """No complete answer within the call's deadline (a server that stopped answering)."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: JsonValue  # parsed JSON, or None when the answer is not JSON
    text: str


def error_reason(body: JsonValue, text: str) -> str:
    """SGLang's own explanation from any of its error shapes (see the module docstring)."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message") is not None:
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if body.get(key) is not None:
                return str(body[key])
    return text.strip()[:2000] or "(no message)"


class _Keep:
    """getresponse() closes the connection early when the answer says Connection: close; keep the socket until the
    body is read, so its timeout can still be set to what is left of the deadline."""

    keep = True

    def close(self) -> None:
        if not self.keep:
            super().close()  # type: ignore[misc]


class _HTTP(_Keep, http.client.HTTPConnection):
    pass


class _HTTPS(_Keep, http.client.HTTPSConnection):
    pass


class SGLangClient:
    """Calls one SGLang server. `url` is http://HOST:PORT (an https:// URL uses TLS with default checks)."""

    def __init__(self, url: str, *, api_key: str | None = None):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"rollout.sglang.urls: {url!r} is not an http(s)://HOST:PORT URL")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._api_key = api_key

    def get(self, path: str, *, timeout_s: float) -> Answer:
        return self.request("GET", path, body=None, timeout_s=timeout_s)

    def post(self, path: str, body: JsonValue, *, timeout_s: float) -> Answer:
        return self.request("POST", path, body=body, timeout_s=timeout_s)

    def request(self, method: str, path: str, *, body: JsonValue, timeout_s: float) -> Answer:
        """One call; raises SGLang* errors for anything but a 2xx answer (or a 2xx saying success: false)."""
        deadline = time.monotonic() + timeout_s
        where = f"SGLang {method} {self.url}{path}"
        try:
            status, raw = self._exchange(method, path, body=body, deadline=deadline)
        except SGLangError:
            raise
        except TimeoutError as exc:  # socket.timeout is TimeoutError
            raise SGLangTimeout(
                f"{where}: no answer within {timeout_s:g}s (the server stopped answering?)", url=self.url, path=path
            ) from exc
        except (http.client.HTTPException, OSError) as exc:
            raise SGLangUnavailable(
                f"{where}: cannot reach the server: {exc or type(exc).__name__}", url=self.url, path=path
            ) from exc
        text = raw.decode("utf-8", errors="replace")
        try:
            parsed = json.loads(text) if text.strip() else None
        except ValueError:
            parsed = None
        if 200 <= status < 300 and not (isinstance(parsed, dict) and parsed.get("success") is False):
            return Answer(status=status, body=parsed, text=text)
        reason = error_reason(parsed, text)
        message = f"{where} answered {status}: {reason}"
        kind = (
            SGLangNotFound
            if status == 404
            else SGLangAborted
            if status == ABORTED_STATUS
            else SGLangUnavailable
            if status >= 500
            else SGLangRequestError
        )
        raise kind(message, url=self.url, path=path, status=status, reason=reason)

    def _exchange(self, method: str, path: str, *, body: JsonValue, deadline: float) -> tuple[int, bytes]:
        left = _left(deadline)
        conn = (_HTTPS if self._https else _HTTP)(self._host, self._port, timeout=left)
        try:
            headers = {"Connection": "close", "Accept": "application/json"}
            payload = None
            if body is not None:
                payload = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            if self._api_key:
                headers["Authorization"] = f"Bearer {self._api_key}"
            conn.connect()
            sock = conn.sock
            sock.settimeout(_left(deadline))
            conn.request(method, self._prefix + path, body=payload, headers=headers)
            sock.settimeout(_left(deadline))
            response = conn.getresponse()
            chunks = []
            while True:
                sock.settimeout(_left(deadline))
                chunk = response.read(_READ_CHUNK)
                if not chunk:
                    break
                chunks.append(chunk)
            return response.status, b"".join(chunks)
        finally:
            conn.keep = False
            conn.close()


def is_loopback(url: str) -> bool:
    """Whether `url` names this host (CUDA IPC handles open only there)."""
    host = urlsplit(url if "://" in url else f"http://{url}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def wait_for_all(futures: Iterable[Future[None]]) -> None:
    """Waits for every server's call, then raises the first error: no server is left mid-update unobserved."""
    errors = []
    for f in futures:
        try:
            f.result()
        except Exception as exc:  # noqa: BLE001 - all servers answer before the first error is raised
            errors.append(exc)
    if errors:
        raise errors[0]
