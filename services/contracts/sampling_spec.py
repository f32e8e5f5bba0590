"""The sampling spec: the one type that says how tokens are drawn, from the config to the engine and the trainer.

`SamplingSpec` is validated once, when it is made. It converts from the config section (`from_config`) and to and
from what a call carries (`params` / `from_params`, `SamplingParams`). The distribution it defines (logits /
temperature, then top-k, then top-p, renormalised) is computed by `services.tensors.sampling_dist.sampling_log_probs`;
torch stays out of here so that the wire format and the coordinator import no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from services.contracts.config import stop_strings_problem

if TYPE_CHECKING:
    from services.contracts.config import SamplingConfig


@dataclass(frozen=True)
class SamplingSpec:
    """temperature 0 = greedy; top_p 1 and top_k 0 = off; seed None = nondeterministic.

    Stop tokens end a sample like EOS does and are kept as its last token (the policy must learn to emit them).
    Stop strings end a sample at the token whose text completes one: that token is kept whole, even when the string
    ends inside it, so the response holds the stop string (docs/own-task.md, "Stop strings").
    `ignore_eos` keeps going past EOS (benchmarks that force a response length)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        problem = stop_strings_problem(self.stop)
        if problem:
            raise ValueError(f"sampling.stop {problem}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self, seed: int | None) -> SamplingSpec:
        return replace(self, seed=seed)

    @classmethod
    def from_config(cls, cfg: SamplingConfig) -> SamplingSpec:
        return cls(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=tuple(cfg.stop_token_ids),
            seed=cfg.seed or None,
            ignore_eos=cfg.ignore_eos,
            stop=tuple(cfg.stop),
        )

    def params(self) -> SamplingParams:
        """As a call carries it (seed None travels as 0)."""
        return SamplingParams(**{**asdict(self), "seed": self.seed or 0})

    @classmethod
    def from_params(cls, params: SamplingParams, *, default: SamplingSpec) -> SamplingSpec:
        """Zeros mean: temperature 0 = greedy, top_p 0 = off, top_k 0 = off, max_new_tokens 0, no stop tokens and
        no stop strings = the default's, seed 0 = nondeterministic. Out-of-range values raise ValueError."""
        return cls(
            temperature=float(params.temperature),
            top_p=float(params.top_p) if params.top_p > 0 else 1.0,
            top_k=int(params.top_k),
            max_new_tokens=int(params.max_new_tokens) or default.max_new_tokens,
            stop_token_ids=tuple(params.stop_token_ids) or default.stop_token_ids,
            seed=int(params.seed) or None,
            ignore_eos=bool(params.ignore_eos),
            stop=tuple(params.stop) or default.stop,
        )


@dataclass(frozen=True)
class SamplingParams:
    """A sampling request as calls carry it (tandem.v1.SamplingParams): every field as the caller set it, a zero
    meaning the receiving service's default (SamplingSpec.from_params resolves it)."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    max_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()


# A data row may carry its own response budget: a JSONL key beside the prompt and the label, which the coordinator
# hands on in the prompt's metadata; it caps sampling.max_new_tokens for that prompt's samples.
PROMPT_MAX_NEW_TOKENS = "max_new_tokens"


def prompt_max_new_tokens(metadata: dict[str, str], *, where: str) -> int | None:
    """A prompt's own max_new_tokens (None when it has none); ValueError naming `where` when it is no count >= 1."""
    raw = metadata.get(PROMPT_MAX_NEW_TOKENS)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{where}: {PROMPT_MAX_NEW_TOKENS} must be a whole number >= 1, got {raw!r}")
    return value
