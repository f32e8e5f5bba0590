"""Where a rollout replica's batches go: one RolloutBuffer per stream on the run's Redis, connected on first use
(Redis may start after the service)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from services.buffer.stream import RolloutBuffer, connect, redacted
from services.contracts.config import TandemConfig
from services.contracts.errors import FailedPrecondition, Unavailable
from services.contracts.wire import RolloutBatchData

if TYPE_CHECKING:
    import redis


class BatchWriter:
    def __init__(
        self, config: TandemConfig, *, producer: str, groups: tuple[str, ...], client: redis.Redis | None = None
    ):
        self.config, self.producer, self.groups = config, producer, groups
        self._client = client
        self._buffers: dict[str, RolloutBuffer] = {}
        self._lock = threading.Lock()

    def put(self, batch: RolloutBatchData, *, stream: str, trace_context: dict[str, str]) -> str:
        import redis

        try:
            return self._buffer(stream).put(
                batch, trace_context=trace_context, timeout_s=self.config.redis.put_timeout_s
            )
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise Unavailable(f"redis at {redacted(self.config.redis.url)} is not reachable: {exc}") from exc
        except redis.exceptions.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            raise ValueError(f"stream {stream!r} names a Redis key that is not a stream") from exc

    def _buffer(self, stream: str) -> RolloutBuffer:
        with self._lock:
            if stream not in self._buffers:
                if self._client is None:
                    if not self.config.redis.url:
                        raise FailedPrecondition("redis.url is not set: the rollout service needs the run's Redis")
                    timeouts = self.config.services.timeouts
                    self._client = connect(
                        self.config.redis.url,
                        password=self.config.redis.password,
                        timeout_s=timeouts.redis_socket_s,
                        connect_timeout_s=timeouts.redis_connect_s,
                    )
                self._buffers[stream] = RolloutBuffer(
                    self._client,
                    stream,
                    groups=self.groups,
                    group=None,
                    consumer=self.producer,
                    max_buffered_batches=self.config.redis.max_buffered_batches,
                    chunk_bytes=int(self.config.redis.chunk_mb * (1 << 20)),
                )
            return self._buffers[stream]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
