"""Micro-batch planning, sharding, staleness and the lr schedule (pure functions, no engine)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import build_batch
from services.trainer.batching import (
    build_micro_batch,
    merge_batches,
    pack_rows,
    pack_samples,
    pinned_copy,
    shard_samples,
    stale_samples,
    token_lag_fractions,
)
from services.trainer.model.backend import lr_lambda


def _batch():
    return merge_batches(
        [
            build_batch(
                rollout_id=0,
                policy_version=0,
                prompts=[[1, 5], [1, 6, 7]],
                responses=[[8, 9, 10], [11]],
                log_probs=[[-0.1, -0.2, -0.3], [-0.4]],
                rewards=[1.0, 0.0],
                group_ids=[0, 0],
                finish_reasons=["stop", "length"],
                sample_versions=[3, 1],
                token_versions=[[3, 4, 4], [1]],
                sampling=SamplingSpec(temperature=0.7, top_p=0.9),
            ),
            build_batch(
                rollout_id=1,
                policy_version=0,
                prompts=[[1]],
                responses=[[12, 13]],
                log_probs=[[-0.5, -0.6]],
                rewards=[0.5],
                group_ids=[1],
                finish_reasons=["stop"],
                sample_versions=[2],
                sampling=SamplingSpec(temperature=0.0),
            ),  # no token_versions: each token its sample's
        ]
    )


def test_merge_and_select_keep_per_token_arrays_aligned():
    batch = _batch()
    assert batch.num_samples == 3 and batch.num_response_tokens == 6 and batch.num_tokens == 12
    picked = batch.select([2, 0])
    assert picked.tokens.tolist() == [1, 12, 13, 1, 5, 8, 9, 10]
    assert picked.rollout_log_probs.tolist() == pytest.approx([-0.5, -0.6, -0.1, -0.2, -0.3])
    assert picked.response_lengths.tolist() == [2, 3] and picked.rewards.tolist() == [0.5, 1.0]
    assert picked.sampling_temperature.tolist() == pytest.approx([0.0, 0.7])
    assert picked.sampling_top_p.tolist() == pytest.approx([1.0, 0.9]) and picked.sampling_top_k.tolist() == [0, 0]
    assert batch.versions.tolist() == [3, 4, 4, 1, 2, 2] and picked.versions.tolist() == [2, 2, 3, 4, 4]


def test_micro_batch_positions_predict_response_tokens():
    batch = _batch()
    mb = build_micro_batch(batch, [0, 2])
    assert mb.input_ids.tolist() == [[1, 5, 8, 9, 10], [1, 12, 13, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # output position p-1+j predicts response token j; token_index points into the flat response arrays
    assert mb.positions.tolist() == [1, 2, 3, 0, 1]
    assert mb.targets.tolist() == [8, 9, 10, 12, 13]
    assert mb.token_index.tolist() == [0, 1, 2, 4, 5]
    assert mb.num_tokens == 8


def test_only_host_tensors_bound_for_a_gpu_are_pinned():
    """bench_train_step's torch_bf16 on CUDA moved a batch already on cuda:0 to "cuda" again, and pinned a GPU
    tensor ("cannot pin 'torch.cuda.LongTensor'"). A meta tensor stands in for one already on an accelerator."""
    host, elsewhere = torch.zeros(2), torch.zeros(2, device="meta")
    assert pinned_copy(host, torch.device("cuda"))
    assert not pinned_copy(elsewhere, torch.device("cuda"))
    assert not pinned_copy(elsewhere, torch.device("cuda", 0))
    assert not pinned_copy(host, torch.device("cpu"))
    mb = build_micro_batch(_batch(), [0, 2])
    moved = mb.to(torch.device("meta"))  # no pinning on the way, and a second move is the batch itself
    assert moved.input_ids.device.type == "meta" and moved.to(torch.device("meta")) is moved


def test_pack_respects_padded_token_budget():
    lengths = [10, 3, 7, 2, 2, 30]
    groups = pack_samples(list(range(6)), lengths, token_budget=20)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 20
    assert [5] in groups  # longer than the budget: alone


def test_packed_rows_fill_the_width_of_the_longest_sample_within_the_budget():
    lengths = [10, 3, 7, 2, 2, 30, 6, 4]
    groups = pack_rows(list(range(8)), lengths, token_budget=20)
    assert sorted(i for g in groups for row in g for i in row) == list(range(8))
    assert groups[0] == [[5]]  # longer than the budget: alone
    for g in groups[1:]:
        width = max(lengths[row[0]] for row in g)
        assert all(sum(lengths[i] for i in row) <= width for row in g) and len(g) * width <= 20
    assert groups[1:] == [[[0], [2, 1]], [[6], [7, 3], [4]]]  # 3 fills the first row with room, 4 a new row


def test_a_packed_micro_batch_restarts_positions_per_sample():
    mb = build_micro_batch(_batch(), [[0, 2], [1]])
    assert mb.input_ids.tolist() == [[1, 5, 8, 9, 10, 1, 12, 13], [1, 6, 7, 11, 0, 0, 0, 0]]
    assert mb.position_ids is not None  # the padding is a block of its own, from 0
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert mb.positions.tolist() == [1, 2, 3, 5, 6, 2] and mb.rows.tolist() == [0, 0, 0, 0, 0, 1]
    assert mb.targets.tolist() == [8, 9, 10, 12, 13, 11] and mb.token_index.tolist() == [0, 1, 2, 4, 5, 3]
    assert mb.num_tokens == 12 and build_micro_batch(_batch(), [0, 2]).position_ids is None


def test_shards_are_disjoint_balanced_and_cover_everything():
    lengths = [9, 1, 5, 5, 3, 8, 2]
    shards = [shard_samples(lengths, world_size=3, rank=r) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(7))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)
    assert shard_samples(lengths, world_size=1, rank=0) == list(range(7))


def test_stale_samples_go_by_their_oldest_token():
    batch = _batch()  # sample 0's tokens: versions 3, 4, 4 (a sync landed mid-generation)
    assert stale_samples(batch, weight_version=3, max_staleness=1) == [1]
    assert stale_samples(batch, weight_version=3, max_staleness=0) == [1, 2]
    assert stale_samples(batch, weight_version=4, max_staleness=0) == [0, 1, 2]
    assert stale_samples(batch, weight_version=3, max_staleness=-1) == []


def test_token_lag_fractions_count_trainable_tokens_by_their_own_version():
    batch = _batch()  # token versions 3 4 4 | 1 | 2 2; the last token masked out
    batch = dataclasses.replace(batch, loss_mask=torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0]))
    assert token_lag_fractions(batch, weight_version=4) == {
        "token_lag_frac_0": 2 / 5,
        "token_lag_frac_1": 1 / 5,
        "token_lag_frac_2": 1 / 5,
        "token_lag_frac_3": 1 / 5,
    }


def test_merge_rejects_inconsistent_batches():
    good = build_batch(
        rollout_id=0,
        policy_version=0,
        prompts=[[1]],
        responses=[[2]],
        log_probs=[[-1.0]],
        rewards=[1.0],
        group_ids=[0],
        finish_reasons=["stop"],
        sampling=SamplingSpec(),
    )
    from dataclasses import replace

    with pytest.raises(ValueError, match="rewards"):
        merge_batches([replace(good, rewards=good.rewards * float("nan"))])
    with pytest.raises(ValueError, match="one per response token"):
        merge_batches([replace(good, loss_mask=good.loss_mask[:0])])
    with pytest.raises(ValueError, match="empty batch"):
        merge_batches([])


def test_lr_schedules():
    warm_const = lr_lambda(schedule="constant", warmup_steps=4, total_steps=None, lr=1.0, min_lr=0.0)
    assert [warm_const(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = lr_lambda(schedule="cosine", warmup_steps=0, total_steps=10, lr=1e-3, min_lr=1e-4)
    assert cosine(0) == pytest.approx(1.0) and cosine(10) == pytest.approx(0.1) and cosine(50) == pytest.approx(0.1)
    assert cosine(5) == pytest.approx(0.55)
    linear = lr_lambda(schedule="linear", warmup_steps=2, total_steps=12, lr=1.0, min_lr=0.0)
    assert linear(1) == 1.0 and linear(7) == pytest.approx(0.5) and linear(12) == 0.0
    with pytest.raises(ValueError, match="total_steps"):
        lr_lambda(schedule="cosine", warmup_steps=0, total_steps=None, lr=1.0, min_lr=0.0)


def test_lr_schedule_drives_torch_scheduler():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(schedule="constant", warmup_steps=2, total_steps=None, lr=0.1, min_lr=0.0)
    )
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1])
