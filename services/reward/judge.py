"""`type: judge`: a generative judge on Tandem's native engine.

The rubric (a Jinja template with `prompt`, `response`, `label`, `metadata` and `messages` in scope; sandboxed, and
a variable it names that the sample lacks is an error) becomes the judge's prompt, as text or as a user turn of the
judge's chat template (`chat: true`). The judge writes a verdict, greedily by default; a parser turns it into a
number: a regex (its first group, else the whole match, of the first match) or `module:function` (verdict -> number
or None). A parsed score is clipped to `score_range`; a verdict that cannot be parsed scores `default_score` and is
counted (ScoreResult.parse_failures), never an error. With `n` votes the score is the most common parsed one (ties:
the first drawn) and the sub-score `agreement` is the share of votes that gave it."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.contracts.reward_calls import RewardSample, ScoreResult, SubScores
from services.contracts.reward_config import JudgeModelConfig
from services.contracts.sampling_spec import SamplingSpec

if TYPE_CHECKING:
    import jinja2

    from services.rollout.engines.interface import Engine
    from services.rollout.tokenizer import Texts

Parser = Callable[[str], float | None]


class JudgeConfigError(ValueError):
    """A judge's template or parser cannot be used (the service refuses to start)."""


def load_template(text_or_file: str) -> jinja2.Template:
    import jinja2.sandbox

    path = Path(text_or_file)
    source = text_or_file
    if "\n" not in text_or_file and "{" not in text_or_file and path.suffix in (".j2", ".jinja", ".jinja2", ".txt"):
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise JudgeConfigError(f"template: cannot read {path}: {exc}") from None
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise JudgeConfigError(f"template: {exc.message} (line {exc.lineno})") from None


def load_parser(spec: str) -> Parser:
    """A regex, or `module:function` / `file.py:function` (what a regex cannot be: it names a loadable function)."""
    target, sep, attr = spec.rpartition(":")
    if sep and target and attr.isidentifier() and (target.endswith(".py") or re.fullmatch(r"[\w.]+", target)):
        from services.rollout.rewards import load_callable

        fn = load_callable(
            spec,
            kind="judge parser",
            error=JudgeConfigError,
            builtins=(),
            attr_name="function",
            callable_as="a function",
        )
        return lambda verdict: _number(fn(verdict))
    try:
        pattern = re.compile(spec)
    except re.error as exc:
        raise JudgeConfigError(f"parser {spec!r} is neither module:function nor a regex ({exc})") from None

    def parse(verdict: str) -> float | None:
        m = pattern.search(verdict)
        if m is None:
            return None
        return _number(m.group(1) if pattern.groups else m.group(0))

    return parse


def _number(value: object) -> float | None:
    if value is None or isinstance(value, bytes):
        return None
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def majority(votes: Sequence[float | None]) -> tuple[float | None, float]:
    """The most common parsed vote (ties: the first drawn) and the share of all votes that gave it."""
    parsed = [v for v in votes if v is not None]
    if not parsed:
        return None, 0.0
    counts = Counter(parsed)
    top = max(counts.values())
    winner = next(v for v in parsed if counts[v] == top)
    return winner, top / len(votes)


class JudgeModel:
    type = "judge"

    def __init__(self, config: JudgeModelConfig, *, engine: Engine, texts: Texts):
        self.config = config
        self.path = config.path
        self.engine = engine
        self.texts = texts
        self.template = load_template(config.template)
        self.parse = load_parser(config.parser)
        self.sampling = SamplingSpec(
            temperature=config.temperature,
            max_new_tokens=config.max_new_tokens,
            stop=tuple(config.stop),
            seed=config.seed or None,
        )

    def rubric(self, sample: RewardSample) -> str:
        import jinja2

        try:
            return self.template.render(
                prompt=sample.prompt,
                response=sample.response,
                label=sample.label,
                metadata=dict(sample.metadata),
                messages=[m.as_dict() for m in sample.messages],
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the judge's template failed on a sample: {exc}") from None

    def prompt_ids(self, samples: Sequence[RewardSample]) -> list[list[int]]:
        from services.contracts.chat_messages import ChatMessage

        rubrics = [self.rubric(s) for s in samples]
        if self.config.chat:
            return [self.texts.chat_prompt_ids([ChatMessage(role="user", content=r)]) for r in rubrics]
        _, ids = self.texts.model_inputs([_Text(r) for r in rubrics])
        return ids

    def score(self, samples: Sequence[RewardSample]) -> ScoreResult:
        cfg = self.config
        ids = self.prompt_ids(samples)
        outputs = self.engine.generate([row for row in ids for _ in range(cfg.n)], self.sampling)
        texts = [self.texts.decode(o.token_ids) for o in outputs]
        scores: list[float] = []
        agreement: list[float] = []
        verdicts: list[str] = []
        failed: list[bool] = []
        lo, hi = cfg.score_range
        for i in range(len(samples)):
            votes = texts[i * cfg.n : (i + 1) * cfg.n]
            winner, share = majority([self.parse(v) for v in votes])
            failed.append(winner is None)
            scores.append(cfg.default_score if winner is None else min(hi, max(lo, winner)))
            agreement.append(share)
            verdicts.append(votes[0] if cfg.n == 1 else " | ".join(votes))
        return ScoreResult(
            scores=tuple(scores),
            sub_scores={"agreement": SubScores(tuple(agreement))} if cfg.n > 1 else {},
            verdicts=tuple(verdicts),
            parse_failed=tuple(failed),
            tokens=sum(len(r) for r in ids) * cfg.n + sum(len(o.token_ids) for o in outputs),
        )


class _Text:
    """A rubric as the tokenizer's prompt path takes it: text, no chat."""

    def __init__(self, text: str):
        self.text = text
        self.messages: tuple[()] = ()
