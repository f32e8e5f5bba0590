"""In-process GRPO on the tool-lookup task: does the policy learn to call the tool, and how fast?

    python examples/tool_lookup/grpo_check.py [--steps 60] [--lr 1e-3] [--seed 0]

Like examples/digit_max/grpo_check.py, without the services: the native engine plays the episodes through the
same multi-turn loop the rollout service uses (services.rollout.multi_turn), a separate HF copy of the model
takes PPO steps on the policy tokens only (the observation tokens' loss_mask is 0), and the new weights are
loaded into the engine in place after every step. Prints the sampled train reward, the greedy eval reward,
how often an episode called the tool, and the no-tool ceiling (0.1) beside them.
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
from services.rollout.environment_registry import resolve_environment  # noqa: E402
from services.rollout.environments import EpisodeSample  # noqa: E402
from services.rollout.multi_turn import MultiTurnRollout  # noqa: E402
from services.rollout.service import load_tokenizer  # noqa: E402

NO_TOOL_CEILING = 0.1  # the answer is a uniform digit the prompt says nothing about


def load_rows(path: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def samples_of(rows, tokenizer, n: int) -> list[EpisodeSample]:
    return [
        EpisodeSample(
            prompt=r["prompt"],
            prompt_ids=tuple(tokenizer(r["prompt"])["input_ids"]),
            label=r["label"],
            metadata={"table": r["table"]},
            group_id=i,
            sample_index=j,
        )
        for i, r in enumerate(rows)
        for j in range(n)
    ]


def policy_log_probs(model, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    return [
        logp[i, p - 1 : len(s) - 1].gather(-1, ids[i, p : len(s)].unsqueeze(-1)).squeeze(-1)
        for i, (s, p) in enumerate(zip(sequences, prompt_lens, strict=True))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE.parent / "tool_lookup.yaml"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=None, help="default: the config's trainer.lr")
    parser.add_argument("--seed", type=int, default=0)
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
    tokenizer = load_tokenizer(cfg.model.path)
    ro, algo = cfg.rollout, cfg.algorithm
    assert ro.environment is not None
    loop = MultiTurnRollout(
        engine=engine,
        plugin=resolve_environment(ro.environment),
        max_turns=ro.max_turns,
        encode=lambda t: tokenizer(t, add_special_tokens=False)["input_ids"],
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
        step_timeout_s=ro.environment_timeout_s,
        vocab_size=len(tokenizer),
    )
    train, evals = load_rows(cfg.data.train_path), load_rows(cfg.data.eval_path or cfg.data.train_path)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr or cfg.trainer.lr, betas=cfg.trainer.betas)
    rng, n = random.Random(args.seed), ro.n_samples_per_prompt
    start = time.monotonic()
    print(
        f"{'step':>5} {'train_reward':>12} {'train_calls':>11} {'eval_reward':>11} {'eval_calls':>10} "
        f"{'no_tool_max':>11} {'seconds':>8}"
    )
    for step in range(args.steps):
        rows = rng.sample(train, ro.rollout_batch_size)
        sampling = SamplingSpec(
            temperature=ro.sampling.temperature,
            max_new_tokens=ro.sampling.max_new_tokens,
            seed=args.seed * 100_003 + step + 1,
        )
        episodes = loop.run(samples_of(rows, tokenizer, n), sampling).episodes
        rewards = torch.tensor([e.reward for e in episodes]).view(-1, n)
        adv = rewards - rewards.mean(dim=1, keepdim=True)
        if algo.normalize_advantage_std:
            adv = adv / (rewards.std(dim=1, keepdim=True) + 1e-6)
        seqs = [list(e.prompt_ids) + list(e.output.token_ids) for e in episodes]
        new = torch.cat(policy_log_probs(policy, seqs, [len(e.prompt_ids) for e in episodes]))
        old = torch.cat([torch.tensor(e.output.log_probs) for e in episodes])
        mask = torch.cat([torch.tensor(e.loss_mask, dtype=torch.float32) for e in episodes])
        token_adv = torch.cat([adv.flatten()[i].expand(len(e.loss_mask)) for i, e in enumerate(episodes)])
        ratio = torch.exp(new - old)
        clipped = torch.clamp(ratio, 1 - algo.eps_clip, 1 + (algo.eps_clip_high or algo.eps_clip))
        loss = -(torch.minimum(ratio * token_adv, clipped * token_adv) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.trainer.grad_clip)
        opt.step()
        engine.update_weights_from_tensors(((k, v.detach()) for k, v in policy.named_parameters()), version=step + 1)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            greedy = SamplingSpec(temperature=0.0, max_new_tokens=ro.eval_sampling.max_new_tokens)
            played = loop.run(samples_of(evals, tokenizer, 1), greedy).episodes
            score = sum(e.reward for e in played) / len(played)
            calls = sum(e.turns > 1 for e in played) / len(played)
            train_calls = sum(e.turns > 1 for e in episodes) / len(episodes)
            print(
                f"{step + 1:>5} {float(rewards.mean()):>12.3f} {train_calls:>11.2f} {score:>11.3f} {calls:>10.2f} "
                f"{NO_TOOL_CEILING:>11.2f} {time.monotonic() - start:>8.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
