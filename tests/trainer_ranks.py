"""N trainer ranks under a real launcher, driven in-process by rank 0 (no gRPC): for each ZeRO stage every
rank builds a TrainerService, rank 0 trains the seeded batches while the others serve relayed commands.
Rank 0 prints one JSON line: {stage: {steps: [metrics of each step], weights: {name: values}}}.

    torchrun --nproc-per-node 2 tests/trainer_ranks.py MODEL_DIR RUN_DIR REDIS_URL --stages 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from services.contracts.trainer_calls import TrainRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest_trainer import TrainerHarness, make_batch, trainer_config

from services.trainer.builder import build_trainer
from services.trainer.service import TrainerService

KEYS = (
    *("loss", "pg_loss", "grad_norm", "entropy", "ppo_ratio_mean", "pg_clipfrac", "tokens"),
    # the mismatch metrics gather every rank's tokens: the same over 1 and 2 ranks
    *("mismatch/kl", "mismatch/kl_k3", "mismatch/ppl_ratio", "mismatch/ratio_max", "mismatch/ratio_p50"),
)
# with a distillation teacher (--teacher): its per-token log-probs are summed over ranks into the advantages
DISTILL_KEYS = (*KEYS, "advantage_mean", "distill/reverse_kl", "distill/teacher_logprob_mean")


def batches(model_dir: Path, steps: int) -> list:
    return [make_batch(rollout_id=i, seed=30 + i, groups=4, model_dir=model_dir) for i in range(steps)]


def stage_config(model_dir: Path, run_dir: Path, redis_url: str, stage: int, prefix: str, teacher: Path | None = None):
    if stage == 3:
        raise ValueError("ZeRO-3 weights are gathered by all ranks: tests/test_trainer_grpc.py covers 2-rank ZeRO-3")
    return trainer_config(
        model_dir=model_dir,
        run_dir=run_dir,
        redis_url=redis_url,
        run_name=f"{prefix}-z{stage}",
        trainer={"zero_stage": stage, "micro_batch_tokens": 40, "lr": 3e-3},
        algorithm=None if teacher is None else {"distillation": {"teacher_path": str(teacher), "coef": 0.5}},
    )


def train_stage(h: TrainerHarness, data: list, keys: tuple[str, ...] = KEYS) -> dict:
    """Rank 0 (or a 1-rank reference): the metrics of each step and the final weights."""
    steps = [
        {k: h.service.train(TrainRequest(rollout_id=i, entry_ids=(h.put(b),))).metrics[k] for k in keys}
        for i, b in enumerate(data)
    ]
    return {"steps": steps, "weights": {n: t.flatten().tolist() for n, t in h.service.iter_named_weights()}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("redis_url")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prefix", default="ranks", help="run name prefix (one stream per stage)")
    parser.add_argument("--teacher", type=Path, default=None, help="algorithm.distillation's teacher, if any")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {}
    for stage in args.stages:
        config = stage_config(args.model_dir, args.run_dir, args.redis_url, stage, args.prefix, args.teacher)
        if int(os.environ["RANK"]) == 0:  # set by the launcher
            harness = TrainerHarness(config, run_dir=args.run_dir)
            keys = KEYS if args.teacher is None else DISTILL_KEYS
            out[stage] = train_stage(harness, batches(args.model_dir, args.steps), keys)
            harness.close()  # relays shutdown: the other ranks leave serve_worker
        else:
            service = TrainerService(build_trainer(config, run_dir=args.run_dir))
            service.serve_worker()
            service.close()
    if out:
        print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
