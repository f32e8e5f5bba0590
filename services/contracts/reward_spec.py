"""`rollout.reward` as terms: a rule reward (a built-in or `module:function`), a model of the reward service
(`service:NAME`, or `judge:NAME` / `classifier:NAME`, which also check the model's type), or a weighted sum of them.

One text form carries every spec, in the config and on the wire (GenerateRequest.reward):
`math_answer`, `judge:helpfulness`, `0.7*math_answer + 0.3*judge:helpfulness`. The YAML form of a sum is a mapping
`{math_answer: 0.7, "judge:helpfulness": 0.3}`, turned into the text form when the config loads. Torch-free: the
config's checks and the coordinator read it too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

SERVICE_PREFIXES = ("service", "judge", "classifier")  # `judge:NAME` is a model of the reward service, no module
_WEIGHTED = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*(.+?)\s*$")


class RewardSpecError(ValueError):
    """`rollout.reward` (or a request's reward) does not name a usable reward."""


@dataclass(frozen=True)
class RewardTerm:
    spec: str  # as written: `math_answer`, `judge:helpfulness`
    weight: float = 1.0

    @property
    def model(self) -> str | None:
        """The reward service's model this term names, or None for a rule reward."""
        prefix, sep, name = self.spec.partition(":")
        return name if sep and prefix in SERVICE_PREFIXES else None

    @property
    def model_type(self) -> str | None:
        """`judge` / `classifier` when the prefix fixes the model's type; None for `service:` and rule rewards."""
        prefix = self.spec.partition(":")[0]
        return prefix if self.model is not None and prefix != "service" else None

    @property
    def metric_name(self) -> str:
        """The term in metric keys: the model's name, or the rule's spec with path characters replaced."""
        return self.model or re.sub(r"[^A-Za-z0-9_.-]+", "_", self.spec)


def parse_reward(text: str) -> tuple[RewardTerm, ...]:
    """The terms of a reward spec; RewardSpecError naming what is wrong."""
    if not text.strip():
        raise RewardSpecError("reward: empty; name a built-in, module:function, service:NAME or a weighted sum")
    terms = []
    for part in text.split("+"):
        if not part.strip():
            raise RewardSpecError(f"reward {text!r}: an empty term (a sum is `0.7*math_answer + 0.3*judge:NAME`)")
        m = _WEIGHTED.match(part)
        spec, weight = (m.group(2), float(m.group(1))) if m else (part.strip(), 1.0)
        if not math.isfinite(weight):
            raise RewardSpecError(f"reward {text!r}: the weight of {spec} is {weight}")
        term = RewardTerm(spec=spec, weight=weight)
        if term.spec.partition(":")[0] in SERVICE_PREFIXES and not term.model:
            raise RewardSpecError(f"reward {text!r}: {spec} names no model (write {spec.rstrip(':')}:NAME)")
        terms.append(term)
    specs = [t.spec for t in terms]
    if len(set(specs)) != len(specs):
        raise RewardSpecError(f"reward {text!r}: a term appears twice")
    return tuple(terms)


def reward_text(value: str | Mapping[str, float]) -> str:
    """The text form of a config's reward: a spec as it is, a mapping spec -> weight as a weighted sum."""
    if isinstance(value, str):
        return value
    if not value:
        raise RewardSpecError("reward: an empty mapping; give spec: weight pairs, e.g. {math_answer: 1.0}")
    return " + ".join(f"{float(w)!r}*{spec}" for spec, w in value.items())


def service_models(text: str) -> tuple[RewardTerm, ...]:
    """The terms of a spec that name reward-service models."""
    return tuple(t for t in parse_reward(text) if t.model is not None)
