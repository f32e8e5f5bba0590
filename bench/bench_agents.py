"""What a step of agent episodes costs through the OpenAI-compatible endpoint (services/rollout/agents/), against the
same task as an environment (examples/tool_lookup): the tiny model on the CPU, the real uvicorn server and `openai`
client, examples/agent_tools/agent.py as the agent.

    python bench/bench_agents.py [--prompts 16] [--n 16] [--repeat 3]

Prints a table: per mode, the median seconds of one Generate's episodes (no Redis write), HTTP calls per second,
engine calls per step (the batcher's), and the turns per episode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.contracts.chat_messages import ChatMessage
from services.contracts.config_loading import load_config
from services.contracts.rollout_calls import PromptInput
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.builder import build_rollout
from services.rollout.environment_registry import resolve_environment
from services.rollout.prompts import validated_inputs
from services.rollout.service import RolloutService

REPO = Path(__file__).resolve().parents[1]


def prompts(count: int) -> list[PromptInput]:
    rows = [json.loads(line) for line in (REPO / "examples/tool_lookup/train.jsonl").read_text().splitlines()][:count]
    return [
        PromptInput(
            messages=(ChatMessage("user", r["prompt"]),), label=r["label"], group_id=i, metadata={"table": r["table"]}
        )
        for i, r in enumerate(rows)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=1, seed=1)
    rows = []
    agent = load_config(REPO / "examples/agent_tools.yaml", ["redis.url=redis://127.0.0.1:1"])
    service = RolloutService(build_rollout(agent))
    assert service.agents is not None
    try:
        batch = prompts(args.prompts)
        texts = validated_inputs(service.texts, service.engine, batch).texts
        seconds, calls, turns, engine = [], [], [], []
        for _ in range(args.repeat):
            before = service.agents.batcher.engine_calls
            start = time.monotonic()
            played = service.agents.play(batch, texts, args.n, sampling)
            seconds.append(time.monotonic() - start)
            done = played.finished
            calls.append(sum(e.turns for e in done))
            turns.append(calls[-1] / len(done))
            engine.append(service.agents.batcher.engine_calls - before)
        rows.append(("agent (openai client, HTTP)", seconds, calls, turns, engine))
    finally:
        service.close()
    env = load_config(REPO / "examples/tool_lookup.yaml", ["redis.url=redis://127.0.0.1:1"])
    service = RolloutService(build_rollout(env))
    try:
        from services.rollout.environments import EpisodeSample
        from services.rollout.multi_turn import MultiTurnRollout

        batch = [
            PromptInput(text=p.messages[0].content, label=p.label, group_id=p.group_id, metadata=p.metadata)
            for p in prompts(args.prompts)
        ]
        inputs = validated_inputs(service.texts, service.engine, batch)
        samples = [
            EpisodeSample(
                prompt=t, prompt_ids=tuple(ids), label=p.label, metadata=p.metadata, group_id=p.group_id, sample_index=j
            )
            for p, ids, t in zip(batch, inputs.ids, inputs.texts, strict=True)
            for j in range(args.n)
        ]
        assert env.rollout.environment is not None
        rollout = MultiTurnRollout(
            engine=service.engine,
            plugin=resolve_environment(env.rollout.environment),
            encode=service.texts.encode_text,
            decode=service.texts.decode,
            max_turns=env.rollout.max_turns,
            step_timeout_s=60,
        )
        seconds, turns = [], []
        for _ in range(args.repeat):
            start = time.monotonic()
            played_env = rollout.run(samples, sampling)
            seconds.append(time.monotonic() - start)
            turns.append(sum(e.turns for e in played_env.episodes) / len(samples))
        rows.append(("environment (in process)", seconds, [0] * args.repeat, turns, [0] * args.repeat))
    finally:
        service.close()
    print(f"{args.prompts} prompts x {args.n} episodes, tiny model, CPU, {args.repeat} runs (median)")
    print(f"| {'mode':<30} | s / step | HTTP calls / s | engine calls / step | turns / episode |")
    print(f"|{'-' * 32}|----------|----------------|---------------------|-----------------|")
    for name, secs, ncalls, nturns, nengine in rows:
        s = statistics.median(secs)
        rate = statistics.median(c / t for c, t in zip(ncalls, secs, strict=True))
        print(
            f"| {name:<30} | {s:8.2f} | {rate:14.0f} | {statistics.median(nengine):19.0f} | "
            f"{statistics.median(nturns):15.2f} |"
        )


if __name__ == "__main__":
    main()
