"""Writes the tool-lookup task: prompt "k =", answer table[k] for a random table of ten digits per line.

    python examples/tool_lookup/generate_data.py [--train 2560] [--eval 200] [--seed 0]

The table travels as metadata (`table`), which the environment reads and the policy never sees: each line's
table is drawn afresh, so the answer is a uniformly random digit whatever the prompt says, and a policy that
does not call the lookup tool scores 0.1 in expectation, however it is trained.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def example(rng: random.Random) -> dict[str, str]:
    table = "".join(str(rng.randrange(10)) for _ in range(10))
    key = rng.randrange(10)
    return {"prompt": f"{key} =", "label": table[key], "table": table}


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2560, help="training prompts (80 steps of 32)")
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", [example(rng) for _ in range(args.train)])
    write_jsonl(args.out / "eval.jsonl", [example(rng) for _ in range(args.eval)])
    print(f"wrote {args.train} training and {args.eval} eval prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
