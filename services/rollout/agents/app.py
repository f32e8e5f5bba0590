"""The HTTP edge of the endpoint: a Starlette app (served by uvicorn, server.py).

    POST /episodes/{id}/v1/chat/completions, /episodes/{id}/v1/completions   a call in episode {id}
    POST /v1/chat/completions, /v1/completions      a call in the episode of the X-Episode-Id header, or a free call
    GET  /v1/models, /episodes/{id}/v1/models       the one model served (the run's policy)
    POST /episodes/claim {"max": k}                 an external agent takes up to k open episodes (ids, base URLs, rows)
    POST /episodes/{id}/reward {"reward": r}        ...and posts each one's reward (once), ending it
    POST /episodes/{id}/fail {"error": "..."}       ...or gives it up, naming why
    GET  /health

Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 a refused parameter, 401 a missing
token, 404 an unknown episode, 409 a closed one, 429 the engine's queue is full, 503 generation aborted.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.contracts.untyped import JsonObject, JsonValue
from services.rollout.agents.batcher import Busy
from services.rollout.agents.endpoint import EngineAborted, OpenAIEndpoint
from services.rollout.agents.episodes import EpisodeError
from services.rollout.agents.requests import Refused, chat_request, completion_request

log = logging.getLogger(__name__)
EPISODE_HEADER = "x-episode-id"
MODEL_ID = "tandem-policy"


def error_response(status: int, message: str, *, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def build_app(endpoint: OpenAIEndpoint, *, token: str | None, base_url: Callable[[], str]) -> Starlette:
    """`base_url()`: where this app is reached (known once the server listens), for the URLs claims hand out."""

    def episode_of(request: Request) -> str | None:
        return request.path_params.get("episode_id") or request.headers.get(EPISODE_HEADER) or None

    async def chat(request: Request) -> Response:
        parsed = chat_request(await body_of(request))
        answer = await endpoint.chat(episode_of(request), parsed)
        if parsed.params.stream:
            return _sse(_chat_chunks(answer, include_usage=parsed.params.include_usage))
        return JSONResponse(answer)

    async def completions(request: Request) -> Response:
        parsed = completion_request(await body_of(request))
        answer = await endpoint.completion(episode_of(request), parsed)
        if parsed.params.stream:
            return _sse(_completion_chunks(answer, include_usage=parsed.params.include_usage))
        return JSONResponse(answer)

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "tandem"}]}
        )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def guarded(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:  # a function: Starlette treats other callables as ASGI apps
            return await _answer(handler, token, request)

        return run

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/episodes/{episode_id}/v1/models", guarded(models), methods=["GET"]),
        Route("/episodes/{episode_id}/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/episodes/{episode_id}/v1/completions", guarded(completions), methods=["POST"]),
    ]
    routes += [Route(path, guarded(handler), methods=["POST"]) for path, handler in _episode_routes(endpoint, base_url)]
    return Starlette(routes=routes)


Handler = Callable[[Request], Awaitable[Response]]


async def _answer(handler: Handler, token: str | None, request: Request) -> Response:
    """`handler`'s answer once the token checks out; its errors as OpenAI-style error bodies."""
    if token is not None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return error_response(401, "missing or wrong bearer token (services.auth_token)", kind="auth_error")
    try:
        return await handler(request)
    except Refused as exc:
        return error_response(400, str(exc), kind="invalid_request_error", param=exc.param)
    except EpisodeError as exc:
        return error_response(exc.status, str(exc), kind="invalid_request_error")
    except Busy as exc:
        return error_response(429, str(exc), kind="rate_limit_error")
    except EngineAborted as exc:
        return error_response(503, str(exc), kind="server_error")
    except Exception as exc:
        log.exception("openai endpoint: %s %s failed", request.method, request.url.path)
        return error_response(500, f"{type(exc).__name__}: {exc}", kind="server_error")


async def body_of(request: Request) -> JsonValue:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise Refused("body", f"not JSON: {exc}") from None


def _episode_routes(
    endpoint: OpenAIEndpoint, base_url: Callable[[], str]
) -> list[tuple[str, Callable[[Request], Awaitable[Response]]]]:
    """What an external agent process calls: claim episodes, post a reward, give one up."""

    async def claim(request: Request) -> Response:
        body = await body_of(request)
        limit = body.get("max", 1) if isinstance(body, dict) else None
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise Refused("max", f"must be an integer >= 1, got {limit!r}")
        now = time.monotonic()
        return JSONResponse(
            {
                "episodes": [
                    {
                        "episode_id": e.id,
                        "base_url": f"{base_url()}/episodes/{e.id}/v1",
                        "row": e.row.as_json() if e.row is not None else None,
                        "seconds_left": max(0.0, e.deadline - now),
                    }
                    for e in endpoint.store.claim(limit)
                ]
            }
        )

    async def reward(request: Request) -> Response:
        body = await body_of(request)
        value = body.get("reward") if isinstance(body, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise Refused("reward", f"must be a finite number, got {value!r}")
        episode = endpoint.store.get(request.path_params["episode_id"])
        episode.check_open()
        episode.finish(float(value))
        return JSONResponse({"episode_id": episode.id, "status": episode.status, "error": episode.error or None})

    async def fail(request: Request) -> Response:
        body = await body_of(request)
        error = body.get("error") if isinstance(body, dict) else None
        episode = endpoint.store.get(request.path_params["episode_id"])
        episode.fail(f"the agent gave it up: {error or 'no reason given'}")
        return JSONResponse({"episode_id": episode.id, "status": episode.status})

    return [
        ("/episodes/claim", claim),
        ("/episodes/{episode_id}/reward", reward),
        ("/episodes/{episode_id}/fail", fail),
    ]


def _sse(chunks: Sequence[Mapping[str, JsonValue]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _chat_chunks(answer: Mapping[str, JsonValue], *, include_usage: bool) -> list[JsonObject]:
    """The answer as chat.completion.chunk events: the role, the content, the tool calls, then the finish."""
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks: list[JsonObject] = []
    for choice in answer["choices"]:
        message, index = choice["message"], choice["index"]
        deltas: list[JsonObject] = [{"role": "assistant", "content": ""}]
        if message.get("content"):
            deltas.append({"content": message["content"]})
        if message.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]})
        for delta in deltas:
            chunks.append(
                {**head, "choices": [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]}
            )
        last = {"index": index, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": choice["logprobs"]}
        chunks.append({**head, "choices": [last]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


def _completion_chunks(answer: Mapping[str, JsonValue], *, include_usage: bool) -> list[JsonObject]:
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "text_completion"}
    chunks = [
        {**head, "choices": [{k: c[k] for k in ("index", "text", "finish_reason", "logprobs")}]}
        for c in answer["choices"]
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks
