"""A base for the scripted fake engines of tests that only generate (a real model would make token layouts
random): every other Engine method is unused there and raises."""

from __future__ import annotations

from services.rollout.engines.gate import PauseGate
from services.rollout.engines.interface import Engine


class GenerateOnlyEngine(Engine):
    name = "scripted"
    model_path = device_label = "scripted"

    def __init__(self, *, max_context: int = 64, version: int = 0):
        self._version, self._max_context, self._gate = version, max_context, PauseGate(engine="scripted")
        self._released, self._generated = set(), 0

    def receive_weights(self, plan, *, rank_offset, receiver):
        raise NotImplementedError

    def pause(self, mode="drain", *, timeout_s=None):
        raise NotImplementedError

    def resume(self):
        raise NotImplementedError

    def release_memory(self, tags=()):
        raise NotImplementedError

    def resume_memory(self, tags=()):
        raise NotImplementedError
