"""Builds the distill example's teacher: the `small` preset (6 layers, width 256, 4.8M parameters), random init,
then trained on digit_max by supervised steps until its greedy answers are right.

    python examples/distill/make_teacher.py [--out examples/models/distill_teacher] [--seed 0]

The task is examples/digit_max's: prompt `a b =`, answer max(a, b) as one digit token. Each step is AdamW on the
cross-entropy of the answer token after a batch of prompts encoded as the rollout encodes them (the tokenizer's
BOS, then the text), drawn from digit_max/train.jsonl; every `CHECK_EVERY` steps the greedy answer to each of the
100 pairs of digit_max/eval.jsonl is checked, and training stops once `--target` of them are right (or after
`--max-steps`). `small` and `tiny` come from the same 22-token word-level tokenizer (services/modelinit/init_model.py),
so the teacher can score the student's token ids, which `tandem run`'s preflight checks.

The result is an ordinary Hugging Face directory, written into a temporary sibling and renamed, so an interrupted
build leaves nothing behind; an existing model is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root, when run as a script from anywhere

DIGIT_MAX = HERE.parent / "digit_max"
PRESET = "small"
CHECK_EVERY = 25


def read_pairs(path: Path) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["prompt"], r["label"]) for r in rows]


def make_teacher(
    out: Path,
    *,
    seed: int = 0,
    lr: float = 1e-3,
    batch: int = 64,
    max_steps: int = 400,
    target: float = 0.97,
) -> tuple[Path, float, int]:
    """(the teacher's directory, its greedy eval accuracy, the steps it took). Refuses a directory holding a model."""
    from services.modelinit.init_model import init_model

    out = out.resolve()
    if (out / "config.json").exists():
        raise SystemExit(f"make_teacher: {out} already holds a model; delete it to build it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model_dir = init_model(tmp / "model", preset=PRESET, seed=seed)
        accuracy, steps = train(model_dir, seed=seed, lr=lr, batch=batch, max_steps=max_steps, target=target)
        if out.exists():
            out.rmdir()
        model_dir.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, accuracy, steps


def train(model_dir: Path, *, seed: int, lr: float, batch: int, max_steps: int, target: float) -> tuple[float, int]:
    """Supervised steps on the answer token until the greedy eval accuracy reaches `target`; saves in place."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.tokenizer import encode_texts, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    train_pairs, eval_pairs = read_pairs(DIGIT_MAX / "train.jsonl"), read_pairs(DIGIT_MAX / "eval.jsonl")
    answer = {d: tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}

    def encode(pairs: list[tuple[str, str]]) -> tuple[Any, Any]:
        # `a b =` is 4 tokens after BOS: one width
        ids = encode_texts(tokenizer, [p for p, _ in pairs], special_tokens=True)
        return torch.tensor(ids), torch.tensor([answer[label] for _, label in pairs])

    eval_ids, eval_labels = encode(eval_pairs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    accuracy, step = 0.0, 0
    while step < max_steps:
        model.train()
        pick = torch.randint(len(train_pairs), (batch,))
        ids, labels = encode([train_pairs[i] for i in pick.tolist()])
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, -1], labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % CHECK_EVERY == 0:
            model.eval()
            with torch.no_grad():
                accuracy = float((model(input_ids=eval_ids).logits[:, -1].argmax(-1) == eval_labels).float().mean())
            if accuracy >= target:
                break
    model.save_pretrained(model_dir, safe_serialization=True)
    return accuracy, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE.parent / "models" / "distill_teacher")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=400)
    args = parser.parse_args()
    start = time.monotonic()
    out, accuracy, steps = make_teacher(args.out, seed=args.seed, max_steps=args.max_steps)
    print(
        f"teacher at {out}: greedy eval accuracy {accuracy:.2f} after {steps} steps ({time.monotonic() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
