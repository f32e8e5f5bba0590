"""Writes the digit-max task: prompt "a b =", label max(a, b), for digits a and b.

    python examples/digit_max/generate_data.py [--train 2560] [--seed 0]

train.jsonl: random pairs (seeded); eval.jsonl: all 100 pairs once. A tiny random-init model learns this by
RL alone in a few dozen GRPO steps (FACTS.md: copy-a and max(a, b) learn fastest among digit tasks), and
the answer is one digit token, so the reward is exact and cheap.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def example(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a} {b} =", "label": str(max(a, b))}


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2560, help="training prompts (80 steps of 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", [example(rng.randrange(10), rng.randrange(10)) for _ in range(args.train)])
    write_jsonl(args.out / "eval.jsonl", [example(a, b) for a in range(10) for b in range(10)])
    print(f"wrote {args.train} training and 100 eval prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
