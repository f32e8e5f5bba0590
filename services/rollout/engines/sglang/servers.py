"""One SGLang server as the adapter sees it (`Server`), and connecting to one (`connect_server`): the engine and its
two weight paths (weight_sync_group.py over a process group, weight_sync_tensor.py by CUDA IPC) share this type."""

from __future__ import annotations

import contextlib
import logging
import time

from services.rollout.engines.sglang.http import (
    SGLangClient,
    SGLangError,
    SGLangNotFound,
    SGLangTimeout,
    SGLangUnavailable,
)
from services.rollout.engines.sglang.launch import JIT_NOTE
from services.rollout.engines.sglang.protocol import ApiProfile, ServerInfo, parse_server_info, profile_for

log = logging.getLogger(__name__)

_HEALTH_POLL_S = 0.5  # while a server starts: between /health_generate calls


class Server:
    """One SGLang server and what the adapter knows about it (mutated only under the engine's weights lock)."""

    def __init__(self, *, client: SGLangClient, info: ServerInfo, profile: ApiProfile, max_model_len: int | None):
        self.client, self.info, self.profile, self.max_model_len = client, info, profile, max_model_len
        self.group: tuple | None = None  # (addr, port, plan group name, world, rank offset, generation)
        self.group_name = ""  # the name SGLang registered that group under
        self.session: bool | None = None  # begin/end_weight_update present? None = not probed yet

    @property
    def url(self) -> str:
        return self.client.url

    def held(self, key: tuple) -> int | None:
        return self.group[-1] if self.group is not None and self.group[:-1] == key else None


def connect_server(url: str, *, api_key: str | None, deadline: float, control_s: float) -> Server:
    """Waits for /health_generate, then reads the version (/server_info, or /get_server_info where the newer
    route is missing) and the context length (/v1/models); each call within `control_s`."""
    client = SGLangClient(url, api_key=api_key)
    last: Exception | None = None
    while True:
        try:
            client.get("/health_generate", timeout_s=max(0.1, min(control_s, deadline - time.monotonic())))
            break
        except (SGLangUnavailable, SGLangTimeout) as exc:  # starting (503), not up yet, or busy: wait
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"SGLang at {url} was not healthy within rollout.sglang.startup_timeout_s ({JIT_NOTE}): {last}"
            )
        time.sleep(_HEALTH_POLL_S)
    try:
        raw = client.get("/server_info", timeout_s=control_s).body
    except SGLangNotFound:
        raw = client.get("/get_server_info", timeout_s=control_s).body
    info = parse_server_info(raw, url=client.url)
    profile = profile_for(info.version, url=client.url)
    max_len = None
    with contextlib.suppress(SGLangError, TypeError, ValueError, KeyError, IndexError):
        max_len = int(client.get("/v1/models", timeout_s=control_s).body["data"][0]["max_model_len"])
    log.info("SGLang %s at %s (tp %d, model %s)", info.version, client.url, info.tp_size, info.model_path)
    return Server(client=client, info=info, profile=profile, max_model_len=max_len)
