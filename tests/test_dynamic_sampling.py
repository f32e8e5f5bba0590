"""DAPO dynamic sampling, the overlong filter and the soft overlong penalty, below the coordinator: the shared rule
against plain-Python references (the paper's formulas), the config's refusals, the rollout writing shaped rewards
and informative counts (real tiny model, real redis-server), and the trainer's selection in a real DeepSpeed step
on CPU. The coordinator's rounds are tested with fakes in tests/test_coordinator_loop.py; a `tandem run` with
dynamic sampling in tests/test_run_e2e.py."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import pytest
import torch
from conftest_trainer import harness, tiny_model_dir  # noqa: F401

from services.buffer.stream import RolloutBuffer, connect
from services.contracts import dapo
from services.contracts.config import ConfigError, TandemConfig
from services.contracts.config_loading import config_from_dict
from services.contracts.errors import FailedPrecondition
from services.contracts.rollout_calls import EvaluateRequest, GenerateRequest
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.trainer_calls import TrainRequest
from services.contracts.wire import RolloutBatchData, build_batch
from services.modelinit.init_model import init_model
from services.rollout.builder import build_rollout
from services.rollout.rewards import digit_task
from services.rollout.service import PromptInput, RolloutService
from services.trainer import commands

torch.set_num_threads(1)


# ---- the rule, against references written from the paper -------------------------------------------------


def reference_informative(rewards: list[float], group_ids: list[int], min_std: float) -> list[int]:
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        groups.setdefault(g, []).append(float(np.float32(r)))  # what the wire carries
    return [g for g, rs in groups.items() if statistics.pstdev(rs) > min_std]


def reference_penalty(length: int, *, l_max: int, l_cache: int, factor: float) -> float:
    """DAPO eq. 13: 0 up to L_max - L_cache, then linear down to -1 at L_max, -1 past it (times the factor)."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache * factor
    return -factor


def test_informative_groups_match_the_reference_on_random_rewards():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n_groups, size = int(rng.integers(1, 8)), int(rng.integers(1, 6))
        levels = rng.choice([0.0, 0.5, 0.7, 1.0], size=(n_groups, 1 + int(rng.integers(0, 2))))
        rewards = [float(rng.choice(levels[g])) for g in range(n_groups) for _ in range(size)]
        ids = [100 + g for g in range(n_groups) for _ in range(size)]
        assert dapo.informative_groups(
            np.asarray(rewards, np.float32), np.asarray(ids), min_std=1e-6
        ) == reference_informative(rewards, ids, 1e-6)


def test_float_noise_and_groups_of_one_are_uniform():
    sevens = np.full(7, 0.7, dtype=np.float32)
    assert float(np.std(sevens)) > 0  # verl's `std > 0` on float32 scores keeps this group
    assert dapo.informative_groups(sevens, np.zeros(7, np.int64), min_std=1e-6) == []
    assert dapo.informative_groups(np.asarray([1.0], np.float32), np.asarray([3]), min_std=1e-6) == []


def test_selected_samples_drop_uniform_groups_and_the_surplus_in_order():
    rewards = np.asarray([1, 0, 0, 0, 1, 1, 0, 1, 1, 0], np.float32)
    ids = np.asarray([5, 5, 6, 6, 7, 7, 8, 8, 9, 9])
    assert dapo.selected_samples(rewards, ids, min_std=1e-6, max_groups=2) == ([0, 1, 6, 7], 2, 1)
    assert dapo.selected_samples(rewards, ids, min_std=1e-6, max_groups=None) == ([0, 1, 6, 7, 8, 9], 2, 0)


def test_overlong_penalty_matches_the_paper():
    for l_max, l_cache, factor in [(16, 4, 1.0), (20480, 4096, 1.0), (3, 2, 0.5), (5, 5, 2.0)]:
        lengths = np.arange(0, l_max + 1)
        got = dapo.overlong_penalty(lengths, max_new_tokens=l_max, buffer=l_cache, factor=factor)
        want = [reference_penalty(int(n), l_max=l_max, l_cache=l_cache, factor=factor) for n in lengths]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="overlong buffer 9"):
        dapo.overlong_penalty(np.asarray([1]), max_new_tokens=8, buffer=9, factor=1.0)


# ---- config ---------------------------------------------------------------------------------------------------


def config(**sections: dict[str, Any]) -> TandemConfig:
    data: dict[str, dict[str, Any]] = {
        "model": {"path": "m"},
        "data": {"train_path": "d.jsonl"},
        "rollout": {"dynamic_sampling": {"enabled": True}},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return config_from_dict(data)


@pytest.mark.parametrize(
    "sections, fragment",
    [
        ({"loop": {"mode": "fully_async"}}, "needs loop.mode async or sync"),
        ({"algorithm": {"advantage_estimator": "gae"}}, "gae's baseline is the critic's values"),
        ({"algorithm": {"advantage_estimator": "reinforce_pp"}}, "reinforce_pp's baseline is the whole batch"),
        ({"rollout": {"dynamic_sampling": {"enabled": True}, "n_samples_per_prompt": 1}}, "n_samples_per_prompt >= 2"),
        (
            {
                "rollout": {"dynamic_sampling": {"enabled": True, "max_rounds": 3}},
                "services": {"rollout": [{"port": 0}, {"port": 0}]},
            },
            "3 x 2 rollout replica(s) = 6 buffer entries for one step, more than redis.max_buffered_batches (4)",
        ),
        (
            {"rollout": {"overlong_penalty": {"enabled": True, "buffer_tokens": 20}}},
            "buffer_tokens (20) must not exceed rollout.sampling.max_new_tokens (16)",
        ),
    ],
)
def test_config_refuses_what_dynamic_sampling_cannot_do(sections, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        config(**sections)


def test_dapo_options_are_off_by_default():
    cfg = config_from_dict({"model": {"path": "m"}, "data": {"train_path": "d.jsonl"}})
    assert not cfg.rollout.dynamic_sampling.enabled and not cfg.rollout.overlong_penalty.enabled
    assert not cfg.algorithm.overlong_filter


# ---- the rollout: shaped rewards and informative counts in what it writes ---------------------------------------


def test_the_rollout_adds_the_overlong_penalty_before_writing_and_counts_informative_groups(
    tmp_path, redis_server, stream
):
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    cfg = config_from_dict(
        {
            "run_name": "dapo-rollout",
            "model": {"path": str(model)},
            "data": {"train_path": "unused.jsonl"},
            "rollout": {
                "device": "cpu",
                "n_samples_per_prompt": 4,
                "reward": "digit_task",
                "sampling": {"temperature": 1.0, "max_new_tokens": 3, "seed": 3},
                "overlong_penalty": {"enabled": True, "buffer_tokens": 2, "factor": 0.5},
            },
            "redis": {"url": redis_server.url},
        }
    )
    svc = RolloutService(build_rollout(cfg, replica=0))
    try:
        prompts = [PromptInput(text=f"{i} {9 - i} =", label=str(max(i, 9 - i)), group_id=i) for i in range(6)]
        result = svc.generate(GenerateRequest(rollout_id=0, prompts=tuple(prompts), stream=stream))
        buf = RolloutBuffer(connect(redis_server.url), stream, groups=("actor",), group="actor", consumer="t")
        batch = buf.read([result.entry_id], timeout_s=10)[0].batch
        buf.ack([result.entry_id])
        lengths = batch.response_lengths.tolist()
        for i, (_, r_sl, _) in enumerate(batch.sample_slices()):
            response = svc.texts.decode(batch.tokens[r_sl].tolist())
            task = digit_task(prompts[i // 4].text, response, prompts[i // 4].label, {})
            assert batch.rewards[i] == pytest.approx(
                task + reference_penalty(lengths[i], l_max=3, l_cache=2, factor=0.5)
            ), i
        assert result.num_groups == 6
        assert result.informative_groups == len(
            reference_informative(batch.rewards.tolist(), batch.group_ids.tolist(), 1e-6)
        )
        penalties = [reference_penalty(n, l_max=3, l_cache=2, factor=0.5) for n in lengths]
        assert min(penalties) < 0  # some responses reached the buffer
        assert result.metrics["overlong_penalty_mean"] == pytest.approx(float(np.mean(penalties)))
        assert result.metrics["reward_mean"] == pytest.approx(float(batch.rewards.mean()))
        evaluated = svc.evaluate(
            EvaluateRequest(prompts=tuple(prompts[:2]), n_samples_per_prompt=1)
        )  # evals score the task alone
        assert 0.0 <= evaluated.metrics["eval/reward_mean"] <= 1.0
    finally:
        svc.close()


# ---- the trainer: selection in a real DeepSpeed step ------------------------------------------------------------


def make_entry(
    rollout_id: int,
    groups: list[tuple[int, list[float]]],
    *,
    truncated: frozenset[int] = frozenset(),
    all_truncated: bool = False,
) -> RolloutBatchData:
    """Prompts and responses drawn from each group id's own seed, so a group has the same tokens in any batch."""
    prompts, responses, rewards, ids = [], [], [], []
    for gid, group_rewards in groups:
        rng = np.random.default_rng(gid)
        prompt = [1, *rng.integers(4, 32, size=3).tolist()]
        for r in group_rewards:
            prompts.append(prompt)
            responses.append(rng.integers(4, 32, size=int(rng.integers(2, 5))).tolist())
            rewards.append(r)
            ids.append(gid)
    n = len(ids)
    reasons = ["length" if all_truncated or i in truncated else "stop" for i in range(n)]
    return build_batch(
        rollout_id=rollout_id,
        policy_version=0,
        prompts=prompts,
        responses=responses,
        log_probs=[[-1.0] * len(r) for r in responses],
        rewards=rewards,
        group_ids=ids,
        finish_reasons=reasons,
        sampling=SamplingSpec(temperature=1.0),
    )


def test_the_trainer_drops_uniform_and_surplus_groups_masks_truncated_samples_and_acks_every_entry(harness):  # noqa: F811
    h = harness(
        rollout={"rollout_batch_size": 2, "n_samples_per_prompt": 4, "dynamic_sampling": {"enabled": True}},
        algorithm={"overlong_filter": True},
    )
    relayed: list[commands.Train] = []
    run = h.service.ranks.run

    def spy(command):
        if isinstance(command, commands.Train):
            relayed.append(command)
        return run(command)

    h.service.ranks.run = spy
    # Two rounds of one step: groups 10 and 14 informative (kept), 15 informative but surplus (the target is 2),
    # 11, 12 and 13 uniform (13: four rewards of 0.7). Sample 1 (in 10) stopped at max_new_tokens, so did sample 8
    # of the second entry (in 15, dropped anyway).
    first = h.put(make_entry(0, [(10, [1, 0, 1, 0]), (11, [0, 0, 0, 0]), (12, [1, 1, 1, 1])], truncated=frozenset({1})))
    second = h.put(make_entry(0, [(13, [0.7] * 4), (14, [1, 0, 0, 0]), (15, [0, 1, 1, 1])], truncated=frozenset({8})))
    reply = h.service.train(TrainRequest(rollout_id=0, entry_ids=(first, second)))
    assert (reply.step, reply.samples_trained, reply.samples_filtered, reply.samples_dropped_stale) == (1, 8, 16, 0)
    assert {
        k: reply.metrics[k] for k in ("groups_uniform", "groups_surplus", "overlong_masked", "samples_filtered")
    } == {"groups_uniform": 3.0, "groups_surplus": 1.0, "overlong_masked": 1.0, "samples_filtered": 16.0}
    [step] = relayed
    batch = step.batch
    assert batch.group_ids.tolist() == [10] * 4 + [14] * 4
    assert batch.rewards.tolist() == [1, 0, 1, 0, 1, 0, 0, 0]
    lengths = batch.response_lengths.tolist()
    per_sample = [float(m.sum()) for m in torch.split(batch.loss_mask, lengths)]
    assert per_sample == [lengths[0], 0.0, *map(float, lengths[2:])]  # the truncated sample: out of the loss
    # the books: both entries acknowledged and gone, none pending; a retry replays; a second delivery is refused
    assert h.client.xlen(h.stream) == 0 and h.pending() == 0
    assert h.service.train(TrainRequest(rollout_id=0, entry_ids=(first, second))).replayed
    with pytest.raises(FailedPrecondition, match="already trained"):
        h.service.train(TrainRequest(rollout_id=1, entry_ids=(first,)))

    # Every kept sample cut off: nothing to learn from, so no optimizer step; all filtered, still acknowledged.
    cut = h.put(make_entry(2, [(20, [1, 0, 1, 1]), (21, [0, 0, 1, 0])], all_truncated=True))
    reply = h.service.train(TrainRequest(rollout_id=2, entry_ids=(cut,)))
    assert (reply.step, reply.samples_trained, reply.samples_filtered) == (1, 0, 8)
    assert len(relayed) == 1 and h.client.xlen(h.stream) == 0 and h.pending() == 0
    # and the next step trains again, from step 1
    reply = h.service.train(
        TrainRequest(rollout_id=3, entry_ids=(h.put(make_entry(3, [(30, [1, 0, 0, 1]), (31, [0, 1, 0, 0])])),))
    )
    assert (reply.step, reply.samples_trained, reply.samples_filtered) == (2, 8, 0)


def test_without_dynamic_sampling_the_trainer_keeps_uniform_groups(harness):  # noqa: F811
    h = harness(rollout={"rollout_batch_size": 1, "n_samples_per_prompt": 4})
    reply = h.service.train(
        TrainRequest(rollout_id=0, entry_ids=(h.put(make_entry(0, [(1, [0, 0, 0, 0]), (2, [1, 0, 1, 0])])),))
    )
    assert (reply.step, reply.samples_trained, reply.samples_filtered) == (1, 8, 0)
    assert "groups_uniform" not in reply.metrics
