"""Writes a grade-school word-problem dataset with numeric answers, as parquet with chat messages.

    python examples/math_chat/make_data.py [--out DIR] [--train 2048] [--eval 128] [--max-number 2] [--seed 0]

Each row: `messages` (one user turn: the problem and "Give the final answer after ####."), `answer` (the number,
as text), `solution` (the worked steps ending in `#### N`, as GSM8K writes them) and `kind`. Five kinds of
problem (add, take away, groups of, share equally, two steps) over small numbers, drawn from a seeded generator:
the same arguments write the same files. The defaults write the committed train.parquet and eval.parquet of
examples/math_chat.yaml: numbers up to 2, so every answer is 1 to 4 and a tiny model's RL has answers to find in
a CPU minute (README.md says what it learns); `--max-number 20` writes harder problems, for a real model. Point
data.prompt_key at `messages` and data.label_key at `answer`, and score with rollout.reward: math_answer.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ("Ava", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gia", "Hugo")
ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "shells", "cards")
INSTRUCTION = "Give the final answer after ####."

Problem = tuple[str, str, int]  # question, worked solution (without the #### line), answer


def _add(rng: random.Random, top: int, name: str, item: str) -> Problem:
    a, b = rng.randint(1, top), rng.randint(1, top)
    return (
        f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        f"{a} + {b} = {a + b}",
        a + b,
    )


def _take_away(rng: random.Random, top: int, name: str, item: str) -> Problem:
    a = rng.randint(2, top)
    b = rng.randint(1, a - 1)
    return (
        f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} are left?",
        f"{a} - {b} = {a - b}",
        a - b,
    )


def _groups(rng: random.Random, top: int, name: str, item: str) -> Problem:
    # at most `top` in a bag too: up to --max-number 3 every answer of every kind is one digit
    a, b = rng.randint(2, max(2, top // 2)), rng.randint(2, min(9, max(2, top)))
    return (
        f"{name} buys {a} bags with {b} {item} in each bag. How many {item} is that in all?",
        f"{a} * {b} = {a * b}",
        a * b,
    )


def _share(rng: random.Random, top: int, name: str, item: str) -> Problem:
    each, friends = rng.randint(1, top), rng.randint(2, 6)
    total = each * friends
    return (
        f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
        f"{total} / {friends} = {each}",
        each,
    )


def _two_steps(rng: random.Random, top: int, name: str, item: str) -> Problem:
    a, b = rng.randint(1, top), rng.randint(1, top)
    c = rng.randint(1, a + b - 1) if a + b > 1 else 0
    return (
        f"{name} has {a} {item}, buys {b} more and then gives away {c}. How many {item} does {name} have left?",
        f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}",
        a + b - c,
    )


KINDS: dict[str, Callable[[random.Random, int, str, str], Problem]] = {
    "add": _add,
    "take_away": _take_away,
    "groups": _groups,
    "share": _share,
    "two_steps": _two_steps,
}


def make_rows(n: int, *, max_number: int, rng: random.Random) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i in range(n):
        kind = list(KINDS)[i % len(KINDS)]
        question, steps, answer = KINDS[kind](rng, max_number, rng.choice(NAMES), rng.choice(ITEMS))
        rows.append(
            {
                "messages": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "answer": str(answer),
                "solution": f"{steps}\n#### {answer}",
                "kind": kind,
            }
        )
    return rows


def write_parquet(path: Path, rows: list[dict[str, object]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--train", type=int, default=2048)
    parser.add_argument("--eval", type=int, default=128)
    parser.add_argument("--max-number", type=int, default=2, help="the largest number a problem starts from")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_number < 2:
        parser.error("--max-number must be at least 2")
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_parquet(args.out / "train.parquet", make_rows(args.train, max_number=args.max_number, rng=rng))
    write_parquet(args.out / "eval.parquet", make_rows(args.eval, max_number=args.max_number, rng=rng))
    print(f"wrote {args.train} training and {args.eval} eval problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
