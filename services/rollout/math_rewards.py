"""Math-answer rewards (built-ins of services.rollout.rewards).

`math_answer` (no dependency): the response's final answer is, in this order, the last `\\boxed{...}`, what follows
the last `####` (GSM8K's marker), what follows the last "answer is" / "Answer:", else the last number in the
response. It scores 1.0 when that equals the label numerically: integers, decimals, thousands separators
(`1,000`), signs, `$` and `%` decorations, fractions `3/4` and `\\frac{3}{4}`; exactly for fractions, within a
relative 1e-6 for decimals. The label may be the bare answer, a GSM8K solution ending in `#### 72`, a
`\\boxed{72}`, or a JSON list of accepted answers (verl's ground_truth lists). An answer that is not a number is
compared as text, spaces removed.

`math_verify`: Hugging Face's math-verify package (`pip install 'tandem-rl[math]'`): symbolic equivalence of
LaTeX answers (`\\frac{1}{2}` = `0.5`, intervals, sets, expressions). Its own signal-based timeouts are off (a
reward runs on a worker thread, where signals cannot be used); rollout.reward_timeout_s bounds it instead.
"""

from __future__ import annotations

import json
import logging
import re
from fractions import Fraction

_BOXED = ("\\boxed{", "\\fbox{")
_ANSWER_IS = re.compile(r"(?:answer is|answer:)\s*", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}")
_DECORATION = re.compile(r"\\[$%!,]|\\text\{[^}]*\}|\\mathrm\{[^}]*\}|[$%]|\\left|\\right|\\,|\\;")
REL_TOL = 1e-6


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...} (nested braces allowed), or None."""
    start = max(text.rfind(marker) for marker in _BOXED)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def final_answer(text: str) -> str | None:
    """The response's final answer as text (module docstring: boxed, ####, "answer is", last number)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for marker in ("####", _ANSWER_IS):
        after = _after_last(text, marker)
        if after is not None:
            number = _first_number(after)
            if number is not None:
                return number
    numbers = _NUMBER.findall(_FRAC.sub(r"\1/\2", text))
    return numbers[-1] if numbers else None


def _after_last(text: str, marker: str | re.Pattern[str]) -> str | None:
    if isinstance(marker, str):
        at = text.rfind(marker)
        return None if at < 0 else text[at + len(marker) :]
    matches = list(marker.finditer(text))
    return text[matches[-1].end() :] if matches else None


def _first_number(text: str) -> str | None:
    found = _NUMBER.search(_FRAC.sub(r"\1/\2", text))
    return found.group(0) if found else None


def to_number(text: str) -> Fraction | float | None:
    """`text` as a number when all of it is one (decorations aside): exact Fraction for integers and fractions,
    float for decimals; None otherwise."""
    cleaned = _DECORATION.sub("", _FRAC.sub(r"\1/\2", text)).strip().rstrip(".").replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", cleaned):
        cleaned = cleaned.replace(",", "")
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/", 1)
            return Fraction(num) / Fraction(den) if "." not in cleaned else float(num) / float(den)
        return Fraction(cleaned) if re.fullmatch(r"-?\d+", cleaned) else float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(predicted: str, gold: str) -> bool:
    a, b = to_number(predicted), to_number(gold)
    if a is None or b is None:
        return a is None and b is None and predicted.replace(" ", "") == gold.replace(" ", "")
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    return abs(float(a) - float(b)) <= REL_TOL * max(1.0, abs(float(b)))


def gold_answers(label: str) -> list[str]:
    """The accepted answers a label names (module docstring)."""
    text = label.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except ValueError:
            values = None
        if isinstance(values, list):
            return [a for v in values for a in gold_answers(str(v))]
    if "####" in text:
        return [text.rsplit("####", 1)[1].strip()]
    boxed = last_boxed(text)
    return [boxed if boxed is not None else text]


def math_answer(response: str, label: str) -> float:
    """1.0 when the response's final answer equals one of the label's answers numerically (module docstring)."""
    predicted = final_answer(response)
    if predicted is None:
        return 0.0
    return float(any(same_answer(predicted, gold) for gold in gold_answers(label) if gold))


def math_verify(response: str, label: str) -> float:
    """1.0 when math-verify finds the response's answer equivalent to the label's (module docstring)."""
    from math_verify import parse, verify

    # timeouts off (see the module docstring): math-verify then warns on every call that they are
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    golds = gold_answers(label)
    answer = parse(response, parsing_timeout=None)
    return float(
        any(
            verify(parse(g if "$" in g else f"${g}$", parsing_timeout=None), answer, timeout_seconds=None)
            for g in golds
            if g
        )
    )
