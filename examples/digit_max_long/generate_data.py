"""Writes the long-prompt digit task of the real-size GPU examples (examples/qwen05_gpu.yaml, qwen15_gpu.yaml).

    python examples/digit_max_long/generate_data.py [--train 1280] [--digits 126] [--seed 0]

A prompt is `--digits` random digits and "=" (with BOS, 128 tokens for the default: the shape issue 24 measures);
the label is the larger of the first two digits, so the answer depends on the prompt's start and the rest is
context the model must attend over. The reward (reward.py) reads only the response's first digit, since these
runs force every response to its full length (rollout.sampling.ignore_eos).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def example(digits: list[int]) -> dict[str, str]:
    return {"prompt": " ".join(map(str, digits)) + " =", "label": str(max(digits[0], digits[1]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=1280, help="training prompts (20 steps of 64)")
    parser.add_argument("--eval", type=int, default=128)
    parser.add_argument("--digits", type=int, default=126)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", args.train), ("eval", args.eval)):
        rows = [example([rng.randrange(10) for _ in range(args.digits)]) for _ in range(count)]
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {args.train} training and {args.eval} eval prompts of {args.digits} digits to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
