"""In-process GRPO on the digit-max task: does the example learn by RL alone, and how fast?

    python examples/digit_max/grpo_check.py [--steps 80] [--lr 1e-3] [--seed 0]

A learnability check of the task and its config without the services: the native engine samples (its
rollout log-probs are the PPO ratio's denominator), a separate HF copy of the model takes the gradient
steps, and the new weights are loaded into the engine in place after every step (the same call a weight
transfer ends in). Prints greedy eval reward every few steps and the step at which it reaches --target.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from services.contracts.config_loading import load_config  # noqa: E402
from services.contracts.sampling_spec import SamplingSpec  # noqa: E402
from services.modelinit.init_model import init_model  # noqa: E402
from services.rollout.engines.native.engine import NativeEngine  # noqa: E402
from services.rollout.rewards import resolve_reward  # noqa: E402
from services.rollout.service import load_tokenizer  # noqa: E402


def load_rows(path: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def policy_log_probs(model, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Teacher-forced log-probs of each response token (temperature 1), right-padded batch."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    return [
        logp[i, p - 1 : len(s) - 1].gather(-1, ids[i, p : len(s)].unsqueeze(-1)).squeeze(-1)
        for i, (s, p) in enumerate(zip(sequences, prompt_lens, strict=False))
    ]


def evaluate(engine, tokenizer, reward_fn, rows, max_new_tokens: int) -> float:
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    outs = engine.generate(prompts, SamplingSpec(temperature=0.0, max_new_tokens=max_new_tokens))
    scores = reward_fn.score(
        prompts=[r["prompt"] for r in rows],
        labels=[r["label"] for r in rows],
        responses=[tokenizer.decode(list(o.token_ids), skip_special_tokens=True) for o in outs],
        metadatas=[{} for _ in rows],
    )
    return sum(scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE.parent / "digit_max.yaml"))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=None, help="default: the config's trainer.lr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--eval-every", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    if not Path(cfg.model.path).exists():
        init_model(cfg.model.path, preset=cfg.model.init_preset or "tiny", body=cfg.model.init_body, seed=args.seed)
    from transformers import AutoModelForCausalLM

    engine = NativeEngine(cfg.model.path, device="cpu")
    policy = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    engine.update_weights_from_tensors(policy.named_parameters(), version=0)
    tokenizer, reward_fn = load_tokenizer(cfg.model.path), resolve_reward(cfg.rollout.reward)
    train, evals = load_rows(cfg.data.train_path), load_rows(cfg.data.eval_path or cfg.data.train_path)
    ro, algo = cfg.rollout, cfg.algorithm
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr or cfg.trainer.lr, betas=cfg.trainer.betas)
    rng, n = random.Random(args.seed), ro.n_samples_per_prompt
    start, reached = time.monotonic(), None
    print(f"{'step':>5} {'train_reward':>12} {'eval_reward':>11} {'max|dlogp|':>10} {'seconds':>8}")
    for step in range(args.steps):
        rows = rng.sample(train, ro.rollout_batch_size)
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
        sampling = SamplingSpec(
            temperature=ro.sampling.temperature,
            max_new_tokens=ro.sampling.max_new_tokens,
            seed=args.seed * 100_003 + step,
        )
        outs = engine.generate([p for p in prompts for _ in range(n)], sampling)
        rewards = torch.tensor(
            reward_fn.score(
                prompts=[r["prompt"] for r in rows for _ in range(n)],
                labels=[r["label"] for r in rows for _ in range(n)],
                responses=[tokenizer.decode(list(o.token_ids), skip_special_tokens=True) for o in outs],
                metadatas=[{} for _ in outs],
            )
        ).view(-1, n)
        adv = rewards - rewards.mean(dim=1, keepdim=True)
        if algo.normalize_advantage_std:
            adv = adv / (rewards.std(dim=1, keepdim=True) + 1e-6)
        seqs = [prompts[i // n] + list(o.token_ids) for i, o in enumerate(outs)]
        new = policy_log_probs(policy, seqs, [len(prompts[i // n]) for i in range(len(outs))])
        old = [torch.tensor(o.log_probs) for o in outs]
        drift = max(float((a.detach() - b).abs().max()) for a, b in zip(new, old, strict=False))  # on-policy: ~0
        ratio = torch.exp(torch.cat(new) - torch.cat(old))
        token_adv = torch.cat([adv.flatten()[i].expand(len(o.token_ids)) for i, o in enumerate(outs)])
        clipped = torch.clamp(ratio, 1 - algo.eps_clip, 1 + (algo.eps_clip_high or algo.eps_clip))
        loss = -torch.minimum(ratio * token_adv, clipped * token_adv).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.trainer.grad_clip)
        opt.step()
        engine.update_weights_from_tensors(((k, v.detach()) for k, v in policy.named_parameters()), version=step + 1)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            score = evaluate(engine, tokenizer, reward_fn, evals, ro.eval_sampling.max_new_tokens)
            print(
                f"{step + 1:>5} {float(rewards.mean()):>12.3f} {score:>11.3f} {drift:>10.2e} "
                f"{time.monotonic() - start:>8.1f}",
                flush=True,
            )
            if reached is None and score >= args.target:
                reached = step + 1
    took = time.monotonic() - start
    print(
        f"eval reward reached {args.target} at step {reached}"
        if reached
        else f"eval reward did not reach {args.target} in {args.steps} steps",
        f"({took:.1f}s)",
    )
    return 0 if reached else 1


if __name__ == "__main__":
    raise SystemExit(main())
