"""The inference engines, by the name `rollout.engine` uses: one explicit table.

Each entry builds its engine from the run's config. An engine's module is imported only when it is built (the
native engine pulls in transformers and CUDA kernels, the SGLang adapter its HTTP client and launcher), and it
registers nothing itself. A test keeps the keys equal to the config's choices of rollout.engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.contracts.config import TandemConfig
    from services.rollout.engines.interface import Engine
    from services.rollout.engines.native.stop_strings import Detokenizer

# (config, every id that ends a sample, the run's tokenizer for stop strings) -> the engine
EngineFactory = Callable[["TandemConfig", Sequence[int], "Detokenizer | None"], "Engine"]


@dataclass(frozen=True)
class EngineKind:
    name: str
    build: EngineFactory


def _native(config: TandemConfig, eos_token_ids: Sequence[int], detokenizer: Detokenizer | None) -> Engine:
    from services.rollout.engines.native.engine import NativeEngine

    ro, model = config.rollout, config.model
    assert ro.engine == "native"  # this entry is rollout.engine native's: its keys are there
    return NativeEngine(
        model.path,
        device=ro.device,
        dtype=model.dtype,
        attn_implementation=model.attn_implementation,
        max_batch_size=ro.max_batch_size,
        max_context_length=ro.max_context_length,
        fused_kernels=model.fused_kernels,
        decode=ro.decode,
        continuous_batching=ro.continuous_batching,
        eos_token_ids=eos_token_ids or None,
        detokenizer=detokenizer,
    )


def _sglang(config: TandemConfig, eos_token_ids: Sequence[int], detokenizer: Detokenizer | None) -> Engine:
    """SGLang matches stop strings with its own copy of the tokenizer."""
    from services.rollout.engines.sglang.engine import engine_from_config

    return engine_from_config(config, eos_token_ids=eos_token_ids)


ENGINES: Mapping[str, EngineKind] = MappingProxyType(
    {
        e.name: e
        for e in (
            EngineKind("native", _native),
            EngineKind("sglang", _sglang),
        )
    }
)


def engine_kind(name: str) -> EngineKind:
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r} (known: {', '.join(sorted(ENGINES))})")
    return ENGINES[name]
