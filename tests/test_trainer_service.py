"""TrainerService in-process: real DeepSpeed (CPU, gloo), real redis-server, the tiny model.

Covers: loss decreasing under ZeRO 1/2/3, save → fresh engine → load reproducing the next step exactly,
exactly-once batches, bad input, staleness, the critic → actor value hand-off, offload, weight export.
"""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
import pytest
import torch
from conftest_trainer import DEVICE, harness, make_batch, tiny_model_dir  # noqa: F401

from services.buffer.stream import EntryNotFoundError
from services.contracts import checkpoints
from services.contracts.errors import FailedPrecondition
from services.contracts.gen.tandem.v1 import common_pb2
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.trainer_calls import LoadRequest, PublishRequest, SaveRequest, TrainRequest, WeightSyncRequest
from services.contracts.wire import array_to_proto, build_batch, sampling_arrays
from services.trainer.algo.critic import handoff_key, read_handoff
from services.trainer.model.flat_adamw import FlatAdamW

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize(
    "zero_stage,precision",
    [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (1, "bf16_pure"), (0, "fp32"), (0, "bf16"), (0, "bf16_pure")],
)
def test_loss_decreases_on_fixed_batch(harness, tiny_model_dir, zero_stage, precision):  # noqa: F811
    h = harness(
        trainer={
            "zero_stage": zero_stage,
            "lr": 1e-3,
            "precision": precision,
            # ZeRO-3 gathers each layer's weights again for the recomputation
            "activation_checkpointing": zero_stage == 3,
        },
        algorithm={"eps_clip": 10.0},
    )
    batch = make_batch(model_dir=tiny_model_dir)
    losses = []
    for rollout_id in range(4):
        reply = h.service.train(TrainRequest(rollout_id=rollout_id, entry_ids=(h.put(batch),)))
        losses.append(reply.metrics["loss"])
        assert reply.step == rollout_id + 1 and not reply.replayed
        assert math.isfinite(reply.metrics["grad_norm"]) and reply.metrics["grad_norm"] > 0
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    # ratio starts at exactly 1: rollout log-probs are the model's own
    first = h.service.ledger.results[0].metrics
    assert first["ppo_ratio_mean"] == pytest.approx(1.0, abs=1e-5 if precision == "fp32" else 2e-2)
    assert first["tokens"] == batch.tokens.shape[0] and first["response_tokens"] == batch.num_response_tokens
    assert h.pending() == 0  # every entry acknowledged after its step
    optimizer = h.trainer.backend.engine.optimizer  # ZeRO 1-3: DeepSpeed's wrapper around torch's AdamW
    states = [s for s in getattr(optimizer, "optimizer", optimizer).state.values() if "exp_avg" in s]
    master = torch.bfloat16 if precision == "bf16_pure" else torch.float32  # bf16 keeps fp32 masters and states
    assert states and all(s["exp_avg"].dtype == master and s["exp_avg_sq"].dtype == master for s in states)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_save_then_fresh_engine_load_reproduces_next_step(harness, tiny_model_dir, tmp_path, zero_stage):  # noqa: F811
    batches = [make_batch(rollout_id=i, seed=i, model_dir=tiny_model_dir) for i in range(3)]
    a = harness(trainer={"zero_stage": zero_stage, "lr": 3e-3, "warmup_steps": 2}, run_name="resume")
    for i in range(2):
        a.service.train(TrainRequest(rollout_id=i, entry_ids=(a.put(batches[i]),)))
    saved = a.service.save(SaveRequest(rollout_id=1, extra_state={"coordinator": '{"next": 2}'}))
    expected = a.service.train(TrainRequest(rollout_id=2, entry_ids=(a.put(batches[2]),)))
    a.close()

    b = harness(trainer={"zero_stage": zero_stage, "lr": 3e-3, "warmup_steps": 2}, run_name="resume")
    loaded = b.service.load(LoadRequest())
    assert loaded.loaded and loaded.path == saved.path and loaded.rollout_id == 1 and loaded.step == 2
    assert dict(loaded.extra_state) == {"coordinator": '{"next": 2}'}
    # a retry of a step inside the checkpoint replays its recorded result
    assert b.service.train(TrainRequest(rollout_id=1, entry_ids=("0-1",))).replayed
    again = b.service.train(TrainRequest(rollout_id=2, entry_ids=(b.put(batches[2]),)))
    for key in ("loss", "pg_loss", "grad_norm", "lr", "entropy", "ppo_ratio_mean"):
        assert again.metrics[key] == expected.metrics[key], key
    assert again.step == expected.step == 3


OFFLOADED = "parameters, gradients and optimizer states moved to host memory"  # what Offload answers


def test_micro_batch_split_does_not_change_the_update(harness, tiny_model_dir):  # noqa: F811
    """~One sample per micro-batch, the whole batch in one, and packed rows (several samples per row) with
    activation checkpointing and one-token scoring chunks: the same update."""
    batch = make_batch(groups=4, model_dir=tiny_model_dir, sampling=SamplingSpec(temperature=0.8, top_p=0.9))
    results = []
    for name, trainer in (
        ("budget16", {"micro_batch_tokens": 16}),
        ("budget4096", {"micro_batch_tokens": 4096}),
        (
            "packed",
            {
                "micro_batch_tokens": 48,
                "pack_sequences": True,
                "scoring_chunk_tokens": 1,
                "activation_checkpointing": True,
            },
        ),
    ):
        h = harness(run_name=name, trainer=trainer)
        reply = h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(batch),)))
        results.append((reply.metrics, dict(h.service.iter_named_weights())))
        h.close()
    (m_small, w_small), *others = results
    for m_big, w_big in others:
        for key in ("loss", "grad_norm", "entropy"):
            assert m_small[key] == pytest.approx(m_big[key], rel=1e-5), key
        # Adam's first step moves every weight by about lr (1e-2) whatever the gradient's size, so
        # near-zero gradients turn float-order noise into small absolute differences (seen on an H200: up to
        # 1.3e-4 in 1 of 8192 elements, from cuBLAS' shape-dependent reduction order; a tenth of lr still
        # catches a micro-batch that is dropped or counted twice)
        atol = 5e-5 if DEVICE == "cpu" else 1e-3
        for name in w_small:
            torch.testing.assert_close(w_small[name], w_big[name], rtol=1e-4, atol=atol)


def test_half_written_checkpoint_is_ignored_and_retention_keeps_last(harness, tmp_path):  # noqa: F811
    h = harness(trainer={"keep_last_checkpoints": 2})
    batch = make_batch()
    paths = []
    for i in range(3):
        h.service.train(TrainRequest(rollout_id=i, entry_ids=(h.put(batch),)))
        paths.append(h.service.save(SaveRequest(rollout_id=i)).path)
    root = tmp_path / "checkpoints" / "actor"
    assert [p.name for _, p in checkpoints.list_checkpoints(root)] == ["rollout_00000001", "rollout_00000002"]
    # a crash while writing rollout 7: its directory exists without the COMPLETE marker
    half = root / "rollout_00000007"
    (half / "ds").mkdir(parents=True)
    (half / checkpoints.STATE).write_text("{}")
    loaded = h.service.load(LoadRequest())
    assert loaded.path == paths[2] and loaded.rollout_id == 2
    with pytest.raises(FileNotFoundError, match="incomplete"):
        h.service.load(LoadRequest(path=str(half)))
    # a retried Save of the same step is a no-op that answers the same path
    assert h.service.save(SaveRequest(rollout_id=2)).path == paths[2]


def test_batch_delivered_twice_is_trained_once(harness):  # noqa: F811
    h = harness()
    first_id, second_id = h.put(make_batch(seed=1)), h.put(make_batch(seed=2))
    first = h.service.train(TrainRequest(rollout_id=0, entry_ids=(first_id,)))
    retry = h.service.train(TrainRequest(rollout_id=0, entry_ids=(first_id,)))
    assert retry.replayed and retry.step == first.step == 1
    assert dict(retry.metrics) == dict(first.metrics)
    with pytest.raises(FailedPrecondition, match="already trained"):
        h.service.train(TrainRequest(rollout_id=1, entry_ids=(first_id,)))
    mixed = h.service.train(TrainRequest(rollout_id=1, entry_ids=(first_id, second_id)))
    assert list(mixed.entry_ids) == [second_id] and mixed.metrics["entries_skipped_duplicate"] == 1
    assert h.service.ledger.step == 2 and h.pending() == 0


def _raw_payload(*, rewards: list[float], response_lengths: list[int]) -> bytes:
    """A batch encoded without the producer-side validation (what a buggy producer could write)."""
    n = len(rewards)
    sampling = sampling_arrays(n, SamplingSpec())
    msg = common_pb2.RolloutBatch(
        rollout_id=0,
        num_samples=n,
        tokens=array_to_proto(np.arange(4, 4 + 4 * n, dtype=np.int32) % 30),
        prompt_lengths=array_to_proto(np.full(n, 2, np.int32)),
        response_lengths=array_to_proto(np.asarray(response_lengths, np.int32)),
        loss_mask=array_to_proto(np.ones(2 * n, np.uint8)),
        rollout_log_probs=array_to_proto(np.full(2 * n, -1.0, np.float32)),
        rewards=array_to_proto(np.asarray(rewards, np.float32)),
        group_ids=array_to_proto(np.zeros(n, np.int64)),
        sample_versions=array_to_proto(np.zeros(n, np.int64)),
        sampling_temperature=array_to_proto(sampling["sampling_temperature"]),
        sampling_top_p=array_to_proto(sampling["sampling_top_p"]),
        sampling_top_k=array_to_proto(sampling["sampling_top_k"]),
        finish_reasons=[common_pb2.FINISH_REASON_STOP] * n,
    )
    return msg.SerializeToString()


def test_bad_input_gives_clear_errors_and_takes_no_step(harness):  # noqa: F811
    h = harness()
    with pytest.raises(ValueError, match="empty batch"):
        h.service.train(TrainRequest(rollout_id=0))
    with pytest.raises(EntryNotFoundError, match="not in stream"):
        h.service.train(TrainRequest(rollout_id=0, entry_ids=("12345-0",)))
    nan_id = h.producer.put_payload(
        _raw_payload(rewards=[1.0, float("nan")], response_lengths=[2, 2]), rollout_id=0, policy_version=0
    )
    with pytest.raises(EntryNotFoundError, match="NaN"):
        h.service.train(TrainRequest(rollout_id=0, entry_ids=(nan_id,)))
    bad_len = h.producer.put_payload(
        _raw_payload(rewards=[1.0, 0.0], response_lengths=[2, 3]), rollout_id=0, policy_version=0
    )
    with pytest.raises(EntryNotFoundError, match="tokens"):
        h.service.train(TrainRequest(rollout_id=0, entry_ids=(bad_len,)))
    # decodes fine but cannot be trained: ids beyond the vocabulary, no trainable token
    oov = h.put(
        build_batch(
            rollout_id=0,
            policy_version=0,
            prompts=[[1, 2]],
            responses=[[99]],
            log_probs=[[-1.0]],
            rewards=[1.0],
            group_ids=[0],
            finish_reasons=["stop"],
            sampling=SamplingSpec(),
        )
    )
    with pytest.raises(ValueError, match="vocabulary"):
        h.service.train(TrainRequest(rollout_id=0, entry_ids=(oov,)))
    masked = h.put(
        build_batch(
            rollout_id=0,
            policy_version=0,
            prompts=[[1, 2]],
            responses=[[5, 6]],
            log_probs=[[-1.0, -1.0]],
            rewards=[1.0],
            group_ids=[0],
            finish_reasons=["stop"],
            loss_masks=[[0, 0]],
            sampling=SamplingSpec(),
        )
    )
    with pytest.raises(ValueError, match="no trainable tokens"):
        h.service.train(TrainRequest(rollout_id=0, entry_ids=(masked,)))
    assert h.service.ledger.step == 0 and h.trainer.backend.global_steps == 0 and not h.service.ledger.results
    assert h.pending() == 2  # the two valid-but-untrainable entries stay pending: nothing was acked
    good = h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(make_batch()),)))
    assert good.step == 1


def test_stale_samples_are_dropped_and_counted(harness):  # noqa: F811
    h = harness()
    h.service.ledger.weight_version = 3  # what PublishWeights(v3) leaves behind
    batch = make_batch(groups=2, group_size=2, sample_versions=[0, 1, 2, 3])
    reply = h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(batch),), max_staleness=1))
    assert reply.samples_dropped_stale == 2 and reply.samples_trained == 2 and reply.step == 1
    assert reply.metrics["samples_dropped_stale"] == 2
    all_stale = h.service.train(
        TrainRequest(rollout_id=1, entry_ids=(h.put(make_batch(sample_versions=[0] * 12)),), max_staleness=0)
    )
    assert all_stale.samples_trained == 0 and all_stale.samples_dropped_stale == 12 and all_stale.step == 1
    assert h.pending() == 0  # dropped samples are consumed, not redelivered


def test_critic_values_feed_the_actor(harness, tiny_model_dir):  # noqa: F811
    gae = {"advantage_estimator": "gae", "gamma": 0.9, "lambd": 0.8}
    critic = harness(role="critic", run_name="ppo", algorithm=gae)
    actor = harness(run_name="ppo", algorithm=gae)
    batch = make_batch(model_dir=tiny_model_dir)
    entry = critic.put(batch)
    with pytest.raises(FailedPrecondition, match="use_critic_values"):
        actor.service.train(TrainRequest(rollout_id=0, entry_ids=(entry,)))
    with pytest.raises(FailedPrecondition, match="no critic values"):
        actor.service.train(TrainRequest(rollout_id=0, entry_ids=(entry,), use_critic_values=True))
    c = critic.service.train(TrainRequest(rollout_id=0, entry_ids=(entry,)))
    assert c.metrics["value_mean"] == 0.0  # zero-initialised head
    handoff = read_handoff(critic.client, stream=critic.stream, rollout_id=0)
    assert handoff.entry_ids == (entry,) and handoff.values.shape == (batch.num_response_tokens,)
    # V = 0 before the critic's first update: advantages are the discounted rewards-to-go
    last = np.cumsum(batch.response_lengths) - 1
    assert handoff.advantages[last].tolist() == pytest.approx(batch.rewards.tolist())
    a = actor.service.train(TrainRequest(rollout_id=0, entry_ids=(entry,), use_critic_values=True))
    assert a.metrics["advantage_mean"] == pytest.approx(c.metrics["advantage_mean"], abs=1e-6)
    assert not critic.client.exists(handoff_key(critic.stream, 0))  # consumed
    assert critic.pending("critic") == 0 and actor.pending("actor") == 0
    # second step: the critic has learned, its values are no longer zero
    entry = critic.put(make_batch(rollout_id=1, seed=1, model_dir=tiny_model_dir))
    c1 = critic.service.train(TrainRequest(rollout_id=1, entry_ids=(entry,)))
    assert c1.metrics["value_mean"] != 0.0 and c1.metrics["value_loss"] > 0


def test_kl_entropy_tis_and_recomputed_logprobs(harness, tiny_model_dir):  # noqa: F811
    h = harness(
        algorithm={
            "kl_coef": 0.1,
            "kl_estimator": "k3",
            "entropy_coef": 0.01,
            "use_tis": True,
            "use_rollout_logprobs": False,
            "dual_clip_c": 3.0,
            "eps_clip_high": 0.28,
            "loss_aggregation": "seq_mean_token_mean",
        }
    )
    batch = make_batch(model_dir=tiny_model_dir)
    first = h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(batch),))).metrics
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert first["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # rollout log-probs are the model's own
    assert first["ppo_ratio_mean"] == pytest.approx(1.0, abs=1e-6) and first["pg_clipfrac"] == 0.0  # recomputed
    second = h.service.train(TrainRequest(rollout_id=1, entry_ids=(h.put(batch),))).metrics
    assert second["kl"] > 0 and 0 < second["tis_weight_mean"] <= 2.0
    shaped = harness(run_name="shaped", algorithm={"kl_coef": 0.1, "kl_mode": "reward", "kl_estimator": "k1"})
    m = shaped.service.train(TrainRequest(rollout_id=0, entry_ids=(shaped.put(batch),))).metrics
    assert math.isfinite(m["loss"]) and m["kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_offload_onload_keeps_training(harness, zero_stage):  # noqa: F811
    h = harness(trainer={"zero_stage": zero_stage})
    batch = make_batch()
    h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(batch),)))
    before = {n: t.detach().cpu().clone() for n, t in h.service.iter_named_weights()}
    on_gpu = h.trainer.dist.device.type == "cuda"
    resident = torch.cuda.memory_allocated() if on_gpu else 0
    reserved = h.service.get_state().gpu_memory_reserved_bytes
    assert h.service.offload() == OFFLOADED and h.service.get_state().offloaded
    if on_gpu:  # parameters, fp32 master copies and both Adam moments left the device
        param_bytes = sum(math.prod(s.shape) * 4 for s in h.service.weight_specs())
        assert resident - torch.cuda.memory_allocated() >= 4 * param_bytes
        # ... and the allocator handed the blocks back: other processes on this GPU can have them
        assert h.service.get_state().gpu_memory_reserved_bytes < reserved
    else:
        assert reserved == 0 and h.service.get_state().gpu_memory_reserved_bytes == 0
    assert h.service.onload().startswith("states reloaded to") and not h.service.get_state().offloaded
    after = {n: t.detach().cpu() for n, t in h.service.iter_named_weights()}
    assert all(torch.equal(before[n], after[n]) for n in before)
    h.service.offload()
    assert h.service.train(TrainRequest(rollout_id=1, entry_ids=(h.put(batch),))).step == 2  # onloads by itself


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_offload_cycles_train_exactly_like_no_offload(harness, zero_stage):  # noqa: F811
    """Offload/onload around every step (as loop.offload_train does) changes nothing: the weights after three
    steps equal those of a trainer that never offloaded, bit for bit (with the backend's start-up objects
    frozen, so DeepSpeed's collections do not see them)."""
    plain = harness(run_name="plain", trainer={"zero_stage": zero_stage})
    cycled = harness(run_name="cycled", trainer={"zero_stage": zero_stage})
    for rollout_id in range(3):
        batch = make_batch(rollout_id=rollout_id, seed=rollout_id)
        plain.service.train(TrainRequest(rollout_id=rollout_id, entry_ids=(plain.put(batch),)))
        cycled.service.train(TrainRequest(rollout_id=rollout_id, entry_ids=(cycled.put(batch),)))
        assert cycled.service.offload() == OFFLOADED and cycled.service.onload().startswith("states reloaded to")
    expected = {n: t.detach().cpu().clone() for n, t in plain.service.iter_named_weights()}
    got = {n: t.detach().cpu() for n, t in cycled.service.iter_named_weights()}
    assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n]) for n in expected)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_weight_export_matches_hf_reload_and_syncs_to_an_engine(harness, tiny_model_dir, zero_stage):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from services.weights import WeightReceiver, tensor_checksum

    h = harness(trainer={"zero_stage": zero_stage})
    h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(make_batch()),)))
    saved = h.service.save(SaveRequest(rollout_id=0, export_hf=True))
    reloaded = AutoModelForCausalLM.from_pretrained(saved.hf_path, dtype=torch.float32)
    reference = {n: tensor_checksum(p.detach()) for n, p in reloaded.named_parameters()}
    specs = h.service.weight_specs()
    named = list(h.service.iter_named_weights())
    assert [s.name for s in specs] == [n for n, _ in named] == list(reference)
    assert all(tuple(s.shape) == tuple(t.shape) for s, (_, t) in zip(specs, named, strict=True))
    assert {n: tensor_checksum(t) for n, t in named} == reference
    # a rollout engine's copy of the original model receives the trained weights (disk transport)
    engine = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = dict(engine.named_parameters())
    assert any(tensor_checksum(params[n].detach()) != c for n, c in reference.items())  # it trained
    plan = h.service.prepare_weight_sync(
        WeightSyncRequest(version=1, transport="disk", engine_world_size=1, verify=True)
    )
    assert len(plan.buckets) >= 1 and all(len({m.dtype for m in b.tensors}) == 1 for b in plan.buckets)
    assert {m.name: m.checksum for b in plan.buckets for m in b.tensors} == reference
    got: dict = {}
    receiver = WeightReceiver(accepted_trainer_id=h.service.trainer_id)
    thread = threading.Thread(target=lambda: got.update(stats=receiver.receive(plan, 1, params)))
    thread.start()
    sent = h.service.publish_weights(PublishRequest(version=1))
    thread.join(30)
    assert sent.version == 1 and sent.bytes_sent == plan.total_bytes > 0
    assert got["stats"].checksums == reference
    assert {n: tensor_checksum(p.detach()) for n, p in engine.named_parameters()} == reference
    assert h.service.get_state().weight_version == 1
    with pytest.raises(FailedPrecondition, match="PrepareWeightSync"):
        h.service.publish_weights(PublishRequest(version=2))
    receiver.close()


@pytest.mark.parametrize("saved_at,loaded_at", [(1, 0), (0, 1)])
def test_a_checkpoint_of_another_zero_stage_is_refused_naming_the_key(
    harness,  # noqa: F811
    tiny_model_dir,  # noqa: F811
    saved_at,
    loaded_at,
):
    """Stage 0 keeps the flat AdamW's state in the model file, stages 1-3 DeepSpeed's shards: a resume must use the
    stage the checkpoint was written with, and is told so."""
    a = harness(trainer={"zero_stage": saved_at}, run_name="cross")
    a.service.train(TrainRequest(rollout_id=0, entry_ids=(a.put(make_batch(model_dir=tiny_model_dir)),)))
    a.service.save(SaveRequest(rollout_id=0))
    a.close()
    b = harness(trainer={"zero_stage": loaded_at}, run_name="cross")
    with pytest.raises(
        FailedPrecondition, match=f"written at trainer.zero_stage {saved_at}; this trainer runs at {loaded_at}"
    ):
        b.service.load(LoadRequest())
    # the optimizer's own check, for checkpoints that do not record their stage
    with pytest.raises(ValueError, match="zero_stage must match"):
        FlatAdamW(
            [("w", torch.nn.Parameter(torch.zeros(2)))],
            precision="fp32",
            lr=1e-3,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            max_grad_norm=1.0,
            skip_nonfinite=True,
        ).load_state_dict(None)
