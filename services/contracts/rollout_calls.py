"""What a rollout replica is asked and answers, as frozen dataclasses: RolloutService takes and returns these, the
coordinator's pool, weight sync and evals build and read them, and only the gRPC edges (rollout/server.py,
coordinator/clients.py) turn them into the tandem.v1 messages and back (contracts/convert.py, by field name)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.contracts.chat_messages import ChatMessage, messages_json
from services.contracts.sampling_spec import SamplingParams
from services.contracts.weight_plan import WeightSyncPlan


@dataclass(frozen=True)
class PromptInput:
    """A prompt as the coordinator sends it: token ids, a chat (rendered with the chat template), or text to
    tokenize (with the tokenizer's BOS), in that order."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    label: str = ""
    group_id: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    messages: tuple[ChatMessage, ...] = ()

    def reward_metadata(self) -> dict[str, str]:
        """What the reward function gets as metadata: the row's other fields, and a chat's messages as JSON."""
        return {**self.metadata, "messages": messages_json(self.messages)} if self.messages else dict(self.metadata)


@dataclass(frozen=True)
class GenerateRequest:
    rollout_id: int
    prompts: tuple[PromptInput, ...]
    n_samples_per_prompt: int = 0  # 0: rollout.n_samples_per_prompt
    sampling: SamplingParams | None = None  # None: rollout.sampling; zeros: its values
    stream: str = ""  # "": the run's stream
    trace_context: dict[str, str] = field(default_factory=dict)
    reward: str = ""  # "": rollout.reward


@dataclass(frozen=True)
class GenerateResult:
    """One batch written (what is not known is 0, as in the protobuf it travels as)."""

    entry_id: str
    num_samples: int = 0
    num_prompt_tokens: int = 0
    num_response_tokens: int = 0
    weight_version: int = 0
    generate_time_s: float = 0.0
    reward_time_s: float = 0.0
    put_time_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    producer: str = ""
    num_groups: int = 0
    informative_groups: int = 0  # groups whose rewards are not all equal (what dynamic sampling counts)


@dataclass(frozen=True)
class EvaluateRequest:
    prompts: tuple[PromptInput, ...]
    name: str = "eval"  # the metrics' prefix ("": eval)
    n_samples_per_prompt: int = 0  # 0: rollout.eval_n_samples_per_prompt
    sampling: SamplingParams | None = None  # None: rollout.eval_sampling; zeros: its values
    reward: str = ""


@dataclass(frozen=True)
class EvaluateResult:
    metrics: dict[str, float]
    weight_version: int = 0
    time_s: float = 0.0


@dataclass(frozen=True)
class PrepareRequest:
    """Pause for the weight sync to `version`."""

    version: int
    pause_mode: str = ""  # "abort" | "retract" | "in_place" | "drain" ("": drain)


@dataclass(frozen=True)
class PrepareResult:
    """A replica paused for a weight sync: the ranks it brings to the sync's process group."""

    ready: bool
    engine_ranks: int


@dataclass(frozen=True)
class ReceiveRequest:
    plan: WeightSyncPlan
    rank_offset: int  # this replica's first rank in the group (the trainer is rank 0)


@dataclass(frozen=True)
class ReceiveResult:
    version: int
    checksums: dict[str, str] = field(default_factory=dict)  # per tensor, when the plan verifies
    bytes_received: int = 0
    time_s: float = 0.0
    bucket_checksums: tuple[str, ...] = ()
    checksum_s: float = 0.0


@dataclass(frozen=True)
class PauseRequest:
    mode: str = ""  # "abort" | "retract" | "in_place" | "drain" ("": drain)


@dataclass(frozen=True)
class MemoryRequest:
    tags: tuple[str, ...] = ()  # "kv_cache", "weights", "cuda_graph"; empty: all


@dataclass(frozen=True)
class RolloutStatus:
    weight_version: int
    engine: str = ""
    model_path: str = ""
    paused: bool = False
    memory_released: bool = False
    generated_samples: int = 0
    device: str = ""
    producer: str = ""
    in_flight: int = 0
    gpu_memory_reserved_bytes: int = 0  # CUDA memory the replica's allocator holds (0 on CPU)
    gpu_memory_freed_bytes: int = 0  # what the engine's last ReleaseMemory gave back
    engine_busy_s: float = 0.0  # wall seconds the engine computed since it started
