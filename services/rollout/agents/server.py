"""The endpoint's server: uvicorn on its own thread and event loop, in the rollout service's process beside the
gRPC server, bound to 127.0.0.1. It starts with the service and stops with it (`stop`: uvicorn's graceful exit)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger(__name__)
HOST = "127.0.0.1"


class EndpointServer:
    def __init__(self, app: Starlette, *, port: int, start_timeout_s: float):
        import uvicorn

        config = uvicorn.Config(
            app, host=HOST, port=port, log_level="warning", access_log=False, lifespan="off", loop="asyncio"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="openai-endpoint", daemon=True)
        self._failed: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if self._failed is not None or not self._thread.is_alive():
                raise OSError(f"the OpenAI-compatible endpoint could not listen on {HOST}:{port}: {self._failed}")
            if time.monotonic() > deadline:
                self.stop(1.0)
                raise OSError(f"the OpenAI-compatible endpoint did not start within {start_timeout_s:g} s")
            time.sleep(0.01)
        self.port: int = self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _run(self) -> None:
        try:
            self.loop = asyncio.new_event_loop()
            self.loop.run_until_complete(self._server.serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread (uvicorn exits on a bind error)
            self._failed = exc
        finally:
            if self.loop is not None:
                self.loop.close()

    def stop(self, timeout_s: float) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
