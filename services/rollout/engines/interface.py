"""The inference-engine interface of the rollout service.

Shaped after what SGLang offers an RL framework, so an `sglang` engine can sit behind the same calls:
generation over token ids with per-token log-probs, weight updates from tensors / a process group /
disk, pause and resume around a weight update, release and resume of GPU memory, and a state snapshot.
Engines work on token ids only; tokenization and rewards belong to the service.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from services.contracts.sampling_spec import SamplingSpec

if TYPE_CHECKING:
    import torch

    from services.contracts.weight_plan import WeightSyncPlan
    from services.rollout.engines.gate import PauseGate
    from services.weights.front_ends import WeightReceiver
    from services.weights.transport_base import SyncStats

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
# What an engine's reported log-probs are of (RolloutBatch.logprob_space; docs/algorithms.md): the distribution it
# sampled from (truncated by top-k/top-p and renormalised), or log_softmax(logits / T) over the whole vocabulary.
LOGPROB_SAMPLING, LOGPROB_TEMPERED = "sampling", "tempered"


@dataclass(frozen=True)
class SampleOutput:
    """One generated sample. `log_probs[i]` is the log-probability of `token_ids[i]` in the engine's
    `logprob_space`: the distribution it was drawn from (services.rollout.engines.native.sampler.sampling_log_probs) for
    the native engine, the tempered one for SGLang; under the weights of `token_versions[i]`, so it is the token's
    behaviour log-prob even when a weight update landed mid-generation (rollout.inflight_update)."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # engine weight version when this sample's generation started
    token_versions: tuple[int, ...] = ()  # the version that sampled each token; () = all weight_version

    @property
    def versions(self) -> tuple[int, ...]:
        """The version of each token (token_versions, or weight_version for every token)."""
        return self.token_versions or (self.weight_version,) * len(self.token_ids)


@dataclass(frozen=True)
class WeightLoadStats:
    version: int
    tensors: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class EngineState:
    engine: str
    model_path: str
    device: str
    weight_version: int
    paused: bool
    pause_mode: str
    released_memory: tuple[str, ...]
    in_flight: int
    generated_samples: int
    max_context_length: int
    memory_freed_bytes: int = 0  # GPU memory the last release_memory gave back (0 where not measured)
    busy_s: float = 0.0  # wall seconds the engine computed since it started (gate.py's busy_s)


class Engine(ABC):
    """An inference engine owned by one rollout replica."""

    name: ClassVar[str]
    logprob_space: ClassVar[str] = LOGPROB_SAMPLING
    _freed_bytes: int = 0  # what the last release_memory gave back, where the engine measures it
    # Set by every engine's __init__: the version it serves, its context size, the gate of its generate calls,
    # the memory tags it released and how many samples it generated.
    _version: int
    _max_context: int
    _gate: PauseGate
    _released: set[str]
    _generated: int

    @property
    @abstractmethod
    def model_path(self) -> str: ...

    @property
    @abstractmethod
    def device_label(self) -> str:
        """Where it generates (a device, server URLs), for the state snapshot."""

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_context_length(self) -> int:
        """Prompt + response tokens one sequence may hold."""
        return self._max_context

    @property
    def compute_device(self) -> torch.device | None:
        """The kind of device the engine's work runs on, which sets this process's CPU threads (None: not known,
        as for a scripted test engine)."""
        return None

    @property
    def engine_ranks(self) -> int:
        """Ranks this engine contributes to a weight-sync process group (tensor-parallel size)."""
        return 1

    def validate_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """ValueError naming the first prompt that cannot be generated from."""
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} has no tokens")
            if len(prompt) >= self.max_context_length:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; the model's context holds "
                    f"{self.max_context_length}, leaving no room to generate"
                )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSpec,
        *,
        max_new_tokens: Sequence[int] | None = None,
        wait_timeout_s: float | None = None,
    ) -> list[SampleOutput]:
        """One output per prompt, in order. `max_new_tokens`: each prompt's own cap, below sampling.max_new_tokens
        (a data row's max_new_tokens). While paused, waits up to `wait_timeout_s` for a resume."""
        self.validate_prompts(prompts)
        if not prompts:
            return []
        budgets = prompt_budgets(len(prompts), sampling, max_new_tokens)
        with self._gate.admit(wait_timeout_s):
            return self._generate_admitted(prompts, sampling, budgets)

    @abstractmethod
    def _generate_admitted(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, budgets: Sequence[int]
    ) -> list[SampleOutput]:
        """`generate` once the gate let the call in; `prompts` are validated and not empty, `budgets` the new tokens
        each may produce at most (the context may stop it earlier)."""

    @abstractmethod
    def receive_weights(self, plan: WeightSyncPlan, *, rank_offset: int, receiver: WeightReceiver) -> SyncStats:
        """Takes part in a transfer announced by the trainer (process group, CUDA IPC or disk) through
        `receiver`; serves `plan.version` afterwards."""

    @abstractmethod
    def pause(self, mode: str = "drain", *, timeout_s: float | None = None) -> None:
        """drain: running requests finish, new ones wait; abort: running requests end now with finish
        reason abort; in_place / retract: running requests stop at the next token and continue on resume."""

    @abstractmethod
    def resume(self) -> None: ...

    @abstractmethod
    def release_memory(self, tags: Sequence[str] = ()) -> None:
        """Frees device memory for `tags` (kv_cache, weights, cuda_graph; empty = all)."""

    @abstractmethod
    def resume_memory(self, tags: Sequence[str] = ()) -> None: ...

    def get_state(self) -> EngineState:
        gate = self._gate
        return EngineState(
            engine=self.name,
            model_path=self.model_path,
            device=self.device_label,
            weight_version=self._version,
            paused=gate.paused,
            pause_mode=gate.pause_mode,
            released_memory=tuple(sorted(self._released)),
            in_flight=gate.admitted,
            generated_samples=self._generated,
            max_context_length=self._max_context,
            memory_freed_bytes=self._freed_bytes,
            busy_s=gate.busy_s,
        )

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """Releases what the engine holds; the object is unusable afterwards."""


def prompt_budgets(n: int, sampling: SamplingSpec, caps: Sequence[int] | None) -> list[int]:
    """The new tokens each of n prompts may produce: sampling.max_new_tokens, or its own cap when lower."""
    if caps is None:
        return [sampling.max_new_tokens] * n
    if len(caps) != n or any(c < 1 for c in caps):
        raise ValueError(f"max_new_tokens: expected {n} caps >= 1, got {list(caps)[:8]}")
    return [min(sampling.max_new_tokens, int(c)) for c in caps]


def normalize_memory_tags(tags: Sequence[str]) -> tuple[str, ...]:
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; known: {', '.join(MEMORY_TAGS)}")
    return tuple(tags) or MEMORY_TAGS
