"""Builds the judge example's judge: the toy `tiny` preset, trained on the CPU to prefer correct answers.

    python examples/judge/warm_start.py [--out examples/models/judge] [--steps 300] [--seed 0]

The judge reads the rubric of examples/judge/rubric.j2, `<prompt> <label> <response> =` (digit-max's prompt
`a b =`, the reference answer, the policy's answer: the two to compare side by side), and writes one token: `1`
when the answer is the reference, else `0`. A random init writes any of its 22 tokens; this gives it the verdict by
supervised steps (AdamW, batches of 256, loss on the verdict token) on rubrics drawn fresh: the answer is the
reference 40% of the time, another digit 35%, a symbol 20%, nothing at all 5% (a policy sample that is a special
token decodes to nothing, and must not pass). Every token the policy can write is among the negatives: an earlier
judge that never saw `,` as an answer rewarded it, and the policy learned to answer `,` (reward hacking, as policies
do with real judges).

The judge never sees the rule (max of two digits); it compares the answer with the reference the data row carries,
as a real judge with a reference answer does. The result is an ordinary Hugging Face directory, written into a
temporary sibling and renamed; an existing model is never overwritten.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root, when run as a script from anywhere

RUBRIC = HERE / "rubric.j2"
SYMBOLS = ("+", "-", "*", "/", "=", "(", ")", ",")  # every symbol of the policy's vocabulary: a policy finds any gap


def rubric_example(rng: random.Random) -> tuple[str, str, str, int]:
    """(prompt, response, label, verdict) of one training rubric."""
    a, b = rng.randrange(10), rng.randrange(10)
    label = str(max(a, b))
    roll = rng.random()
    if roll < 0.4:
        response = label
    elif roll < 0.75:
        response = str(rng.choice([d for d in range(10) if str(d) != label]))
    elif roll < 0.95:
        response = rng.choice(SYMBOLS)
    else:
        response = ""
    return f"{a} {b} =", response, label, int(response == label)


def warm_start(out: Path, *, steps: int = 300, seed: int = 0, lr: float = 3e-3, batch: int = 256) -> Path:
    from services.modelinit.init_model import init_model

    out = out.resolve()
    if (out / "config.json").exists():
        raise SystemExit(f"warm_start: {out} already holds a model; delete it to build it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model_dir = init_model(tmp / "model", preset="tiny", seed=seed)
        accuracy = train_verdicts(model_dir, steps=steps, seed=seed, lr=lr, batch=batch)
        print(f"judge: verdict accuracy {accuracy:.3f} on 2,000 fresh rubrics")
        if out.exists():
            out.rmdir()
        model_dir.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def train_verdicts(model_dir: Path, *, steps: int, seed: int, lr: float, batch: int) -> float:
    """`steps` AdamW steps on the verdict; saves the weights in place; the greedy verdict's accuracy after."""
    import jinja2
    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.tokenizer import encode_texts, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    template = jinja2.Template(RUBRIC.read_text())
    verdict_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("0", "1")]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.set_num_threads(1)  # a 2-layer, width-64 model: more threads only contend (5x slower on a busy 2-core box)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = [rubric_example(rng) for _ in range(n)]
        texts = [template.render(prompt=p, response=r, label=lb) for p, r, lb, _ in rows]
        ids = encode_texts(tokenizer, texts, special_tokens=True)
        width = max(len(i) for i in ids)
        pad = tokenizer.pad_token_id
        x = torch.tensor([[pad] * (width - len(i)) + i for i in ids])  # left padding: the verdict follows the end
        mask = (torch.arange(width) >= torch.tensor([[width - len(i)] for i in ids])).long()
        y = torch.tensor([verdict_ids[v] for *_, v in rows])
        return x, mask, y

    model.train()
    for _ in range(steps):
        x, mask, y = draw(batch)
        logits = model(input_ids=x, attention_mask=mask).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        x, mask, y = draw(2000)
        accuracy = float((model(input_ids=x, attention_mask=mask).logits[:, -1].argmax(-1) == y).float().mean())
    model.save_pretrained(model_dir, safe_serialization=True)
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "models" / "judge")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(warm_start(args.out, steps=args.steps, seed=args.seed))


if __name__ == "__main__":
    main()
