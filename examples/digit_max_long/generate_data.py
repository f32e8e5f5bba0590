"""Writes the long-prompt digit task of the real-size GPU examples (examples/qwen05_gpu.yaml, qwen15_gpu.yaml).

    python examples/digit_max_long/generate_data.py [--train 1280] [--digits 126] [--seed 0]
    python examples/digit_max_long/generate_data.py --lengths 16 2048 --out /tmp/tail   # long-tailed responses

A prompt is `--digits` random digits and "=" (with BOS, 128 tokens for the default: the shape issue 24 measures);
the label is the larger of the first two digits, so the answer depends on the prompt's start and the rest is
context the model must attend over. The reward (reward.py) reads only the response's first digit, since these
runs force every response to its full length (rollout.sampling.ignore_eos).

`--lengths LO HI` gives every row its own response budget (its `max_new_tokens`, which caps
rollout.sampling.max_new_tokens for its samples), drawn from a lognormal clipped to [LO, HI]: most responses short,
a few very long, as in reasoning RL (issue 33's long-tailed task; `--digits 2` makes it digit_max's "a b =").
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def example(digits: list[int]) -> dict[str, str | int]:
    return {"prompt": " ".join(map(str, digits)) + " =", "label": str(max(digits[0], digits[1]))}


def lognormal_length(rng: random.Random, low: int, high: int, *, sigma: float = 1.0) -> int:
    """A response length with median sqrt(low x high) / 4 (on the log scale a quarter of the way up from the middle
    of [low, high] towards low), spread sigma, clipped to [low, high]: a long tail towards high."""
    median = math.sqrt(low * high) / 4
    return int(min(high, max(low, round(rng.lognormvariate(math.log(max(median, low)), sigma)))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=1280, help="training prompts (20 steps of 64)")
    parser.add_argument("--eval", type=int, default=128)
    parser.add_argument("--digits", type=int, default=126)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument(
        "--lengths",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="give each training row a lognormal max_new_tokens in [LO, HI]",
    )
    args = parser.parse_args(argv)
    write(args.out, train=args.train, eval_count=args.eval, digits=args.digits, seed=args.seed, lengths=args.lengths)
    print(f"wrote {args.train} training and {args.eval} eval prompts of {args.digits} digits to {args.out}")
    return 0


def write(
    out: Path,
    *,
    train: int,
    eval_count: int,
    digits: int,
    seed: int = 0,
    lengths: tuple[int, int] | list[int] | None = None,
) -> None:
    """The data files; with `lengths`, each training row carries its own max_new_tokens (evals answer in full)."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", train), ("eval", eval_count)):
        rows = [example([rng.randrange(10) for _ in range(digits)]) for _ in range(count)]
        if lengths is not None and name == "train":
            for row in rows:
                row["max_new_tokens"] = lognormal_length(rng, *lengths)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
