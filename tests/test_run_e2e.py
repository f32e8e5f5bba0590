"""`tandem run` end to end: every service a separate process, a real redis-server, DeepSpeed on CPU."""

import json
import subprocess
import time
from pathlib import Path

import pytest
from reliability_kit import buffer_leftovers, final_checkpoint_state
from tandem_runs import (
    alive,
    assert_above,
    assert_below,
    checkpoints,
    children_of,
    coordinator_target,
    ctl,
    learning_curve,
    metrics,
    start_run,
    stop_run,
    supervisor_log,
    wait_status,
    window_mean,
)

pytestmark = pytest.mark.slow


def test_gspo_with_rloo_and_geometric_rejection_learns_digit_max_with_two_token_answers(tmp_path):
    """One run for three: GSPO's sequence ratio, RLOO's leave-one-out advantages, and rollout correction's geometric
    rejection (a sequence whose geometric-mean ratio pi_trainer / pi_behaviour leaves [0.9, 1.1] drops out of the
    loss; in async mode every batch is one version stale, so the ratio moves). Two tokens per answer (the digit,
    then EOS or another special token that decodes to nothing), so a sequence's ratio is a geometric mean over tokens
    and its length varies: with one token GSPO would be PPO. 50 steps, sampling seeds 1, 11, 21, 31, 41
    (bench/e2e_rollout_correction_seeds.py, bench/RESULTS.md): greedy eval 0.0 untrained, 0.65-0.88 trained (seed 11:
    0.74 without the rejection); mean reward of the last 5 steps 0.29-0.36 against 0.01-0.02 of the first 5; the
    rejection dropped 10-12% of the sequences over a run, up to 49% in a step. The one-token task learns faster but
    would not exercise the sequence ratio. The mismatch metrics of every step are in metrics.jsonl and on its
    rl.train span (traces.jsonl)."""
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        "loop.num_rollout=50",
        "loop.eval_interval=25",
        "algorithm.policy_loss=gspo",
        "algorithm.advantage_estimator=rloo",
        "algorithm.rollout_correction={rejection: geometric, low: 0.9, high: 1.1}",
        "rollout.sampling.max_new_tokens=2",
        "rollout.eval_sampling.max_new_tokens=2",
        "tracing.exporter=file",
    )
    assert proc.wait(timeout=600) == 0, supervisor_log(run_dir)
    evals, steps = learning_curve(run_dir)
    assert [r["rollout_id"] for r in evals] == [-1, 24, 49] and len(steps) == 50
    untrained, trained = evals[0]["eval/reward_mean"], evals[-1]["eval/reward_mean"]
    assert_below("untrained eval reward", untrained, 0.1, evals)
    assert_above("trained eval reward", trained, 0.5, evals)
    first, last = window_mean(steps[:5], "rollout/reward_mean"), window_mean(steps[-5:], "rollout/reward_mean")
    assert_above("reward: last 5 steps - first 5", last - first, 0.15, (first, last))
    # sequences of one and two tokens: no step longer than two, and over the run both lengths occur
    assert all(1.0 <= r["train/response_len_mean"] <= 2.0 for r in steps), steps
    mean_len = window_mean(steps, "train/response_len_mean")
    assert_above("response_len_mean over the run", mean_len, 1.0)
    assert_below("response_len_mean over the run", mean_len, 2.0)
    mismatch = ("kl", "kl_k3", "ppl_ratio", "chi2", "ratio_min", "ratio_p50", "ratio_max", "seq_masked_frac")
    for r in steps:
        assert all(f"mismatch/{k}" in r for k in mismatch), r
        assert r["mismatch/ratio_min"] <= r["mismatch/ratio_p50"] <= r["mismatch/ratio_max"], r
        assert r["train/tis_masked_frac"] == pytest.approx(r["mismatch/token_masked_frac"], abs=1e-6), r
    # the one-step-stale ratios left [0.9, 1.1] for 0-49% of a step's sequences in the seeds tried (0 on the
    # first step: on-policy); the run learned with them dropped
    assert_above("seq_masked_frac, mean over the run", window_mean(steps, "mismatch/seq_masked_frac"), 0.01)
    spans = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    trains = [s["attributes"] for s in spans if s["name"] == "rl.train" and s["service"] == "tandem-coordinator"]
    assert len(trains) == 50 and all("rl.mismatch.kl" in a and "rl.mismatch.seq_masked_frac" in a for a in trains)
    for a, r in zip(trains, steps, strict=True):  # the span of step k carries step k's metrics
        assert a["rl.rollout_id"] == r["rollout_id"] and a["rl.mismatch.kl"] == r["mismatch/kl"], (a, r)


def test_reinforce_pp_learns_at_temperature_0_7_with_top_p_scored_on_policy(tmp_path):
    """Samples drawn at T=0.7 with top-p 0.9 are scored under that distribution: in sync mode every step is
    on-policy, so each token's ratio is 1 (to float precision), nothing clips, and the policy learns. One run for
    two things: the advantages are REINFORCE++'s (rewards whitened over the whole batch, no group), whose mean over
    the batch's tokens is 0 on every step; it learned to 0.74-0.96 in 25 async steps at T=1 in the seeds tried."""
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        "loop.mode=sync",
        "loop.num_rollout=30",
        "loop.eval_interval=30",
        "rollout.sampling.temperature=0.7",
        "rollout.sampling.top_p=0.9",
        "algorithm.advantage_estimator=reinforce_pp",
    )
    assert proc.wait(timeout=600) == 0, supervisor_log(run_dir)
    rows = metrics(run_dir)
    steps = [r for r in rows if "train/ppo_ratio_mean" in r]
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    assert len(steps) == 30 and len(evals) == 2
    for r in steps:
        assert r["train/ppo_ratio_mean"] == pytest.approx(1.0, abs=1e-4), r
        assert r["train/pg_clipfrac"] == 0.0 and r["train/rollout_logprob_abs_diff"] < 1e-4, r
        assert abs(r["train/advantage_mean"]) < 1e-4, r  # whitened over the batch's tokens
    first, last = window_mean(steps[:5], "rollout/reward_mean"), window_mean(steps[-5:], "rollout/reward_mean")
    assert_above("reward: last 5 steps - first 5", last - first, 0.2, (first, last))
    assert_below("untrained eval reward", evals[0], 0.3, evals)  # greedy eval: untrained ~0.05, trained ~0.85
    assert_above("trained eval reward", evals[-1], 0.5, evals)
    state = _coordinator_state(checkpoints(run_dir)[-1])  # the final checkpoint: nothing lost in sync mode
    assert state["next_rollout_id"] == 30
    assert state["samples_trained"] == state["samples_generated"] == 30 * 32 * 8


def test_dynamic_sampling_filters_uniform_groups_keeps_the_books_and_learns(tmp_path):
    """DAPO dynamic sampling on digit_max: the untrained policy gets most groups all wrong, so steps take extra
    rounds; each Train names every round's entries, the trainer keeps rollout_batch_size informative groups, and
    every generated sample is trained or filtered, acknowledged, and gone from Redis at the end."""
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "loop.num_rollout=20", "loop.eval_interval=20", "rollout.dynamic_sampling.enabled=true")
    assert proc.wait(timeout=600) == 0, supervisor_log(run_dir)
    rows = metrics(run_dir)
    steps = [r for r in rows if "rollout/dynamic_rounds" in r]
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    assert len(steps) == 20 and len(evals) == 2
    # ~60% of the untrained policy's groups are uniform: the first 3 steps filter some (together, not each)
    assert_above("filtered_group_frac, first 3 steps", window_mean(steps[:3], "rollout/filtered_group_frac"), 0.0)
    assert any(r["rollout/dynamic_rounds"] > 1 and r["rollout/extra_samples"] > 0 for r in steps)
    assert all(r["rollout/informative_groups"] >= 32 or r["rollout/groups_short"] > 0 for r in steps)
    trainer, state = final_checkpoint_state(run_dir)
    generated = sum(r["rollout/num_samples"] for r in steps)
    assert state["samples_generated"] == generated > 20 * 32 * 8  # more than one round's worth
    assert state["samples_filtered"] == sum(r["rollout/filtered_samples"] for r in steps) > 0
    assert (
        state["samples_trained"]
        + state["samples_filtered"]
        + state["samples_dropped_stale"]
        + state["samples_critic_only"]
        == generated
    )
    assert trainer["samples_trained"] == state["samples_trained"] <= 20 * 32 * 8
    assert buffer_leftovers(run_dir) == (0, 0)  # every entry, filtered groups included, acknowledged and deleted
    assert_below("untrained eval reward", evals[0], 0.3, evals)  # untrained ~0.05; trained ~0.95 here
    assert_above("trained eval reward", evals[-1], 0.6, evals)


def test_lora_policy_learns_digit_max(tmp_path):
    """trainer.lora: rank-8 adapters on every linear layer and the output head, everything else frozen. The
    engines get the merged weights each step with nothing new on their side, so their greedy eval rises; the final
    checkpoint holds the adapter in peft's format beside the merged HF model."""
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        "loop.num_rollout=20",
        "loop.eval_interval=10",
        "trainer.lr=1e-2",
        "trainer.lora.rank=8",
        "trainer.lora.target_modules=[all-linear, lm_head]",
    )
    assert proc.wait(timeout=600) == 0, supervisor_log(run_dir)
    rows = metrics(run_dir)
    evals = [r for r in rows if "eval/reward_mean" in r]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in evals] == [-1, 9, 19] and len(steps) == 20
    # Untrained 0.05; after 20 steps 0.65-0.84 over four seeds tried (full fine-tuning at lr 1e-3: 0.86).
    untrained, trained = evals[0]["eval/reward_mean"], evals[-1]["eval/reward_mean"]
    assert_below("untrained eval reward", untrained, 0.3, evals)
    assert_above("trained eval reward", trained, 0.5, evals)
    first, last = window_mean(steps[:5], "rollout/reward_mean"), window_mean(steps[-5:], "rollout/reward_mean")
    assert_above("reward: last 5 steps - first 5", last - first, 0.2, (first, last))  # seen: ~0.05 -> 0.4-0.5
    hf = checkpoints(run_dir)[-1] / "hf"
    assert (hf / "model.safetensors").is_file() and (hf / "adapter" / "adapter_model.safetensors").is_file()


def test_control_api_save_eval_sentinel_stop_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    sentinel = tmp_path / "save.now"
    common = ("loop.num_rollout=100000", f"loop.save_trigger_sentinel={sentinel}")
    proc = start_run(run_dir, *common)
    try:
        target = coordinator_target(run_dir)
        wait_status(target, lambda s: s.state == "running" and s.rollout_id >= 2, what="running")
        assert ctl(target, "pause")["ok"]
        paused = wait_status(target, lambda s: s.state == "paused", what="paused")
        time.sleep(0.5)
        assert int(ctl(target, "status")["rollout_id"]) == paused.rollout_id  # no step ran while paused
        result = ctl(target, "eval")
        assert 0.0 <= result["metrics"]["eval/reward_mean"] <= 1.0
        assert ctl(target, "resume")["ok"]

        assert ctl(target, "save")["ok"]
        _wait(lambda: len(checkpoints(run_dir)) >= 1, what="checkpoint from `tandem ctl save`")
        sentinel.touch()
        _wait(lambda: not sentinel.exists() and len(checkpoints(run_dir)) >= 2, what="checkpoint from the sentinel")

        assert ctl(target, "stop")["ok"]
        assert proc.wait(timeout=120) == 0, supervisor_log(run_dir)
    finally:
        stop_run(proc)
    final = checkpoints(run_dir)[-1]
    stopped_at = int(final.name.split("_")[1])
    done = [r["rollout_id"] for r in metrics(run_dir) if "rollout/reward_mean" in r]
    assert done[-1] == stopped_at  # the final checkpoint is of the last step trained

    saved = _coordinator_state(final)
    assert saved["next_rollout_id"] == stopped_at + 1
    # three more steps; the last step of a run with save_interval set is always saved
    proc = start_run(run_dir, f"loop.num_rollout={stopped_at + 4}", "loop.save_interval=100000")
    assert proc.wait(timeout=300) == 0, supervisor_log(run_dir)
    log = (run_dir / "logs" / "coordinator.log").read_text()
    assert f"at rollout {stopped_at + 1}" in log
    assert f"initial weights pushed: version {saved['weight_version']} " in log
    resumed = [r["rollout_id"] for r in metrics(run_dir) if "rollout/reward_mean" in r][len(done) :]
    assert resumed == [stopped_at + 1, stopped_at + 2, stopped_at + 3]
    last = checkpoints(run_dir)[-1]
    assert last.name == f"rollout_{stopped_at + 3:08d}"
    after = _coordinator_state(last)
    batch = 32  # rollout.rollout_batch_size of the example
    assert after["cursor"]["consumed"] == saved["cursor"]["consumed"] + 3 * batch
    assert after["weight_version"] == saved["weight_version"] + 3


def test_a_dead_service_fails_the_run_and_leaves_no_orphans(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "loop.num_rollout=100000")
    try:
        target = coordinator_target(run_dir)
        wait_status(target, lambda s: s.state == "running" and s.rollout_id >= 1, what="running")
        kids = children_of(proc.pid)
        rollout = [p for p in kids if b"rollout" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert rollout, kids
        subprocess.run(["kill", "-9", str(rollout[0])], check=True)
        assert proc.wait(timeout=120) == 1
    finally:
        stop_run(proc)
    assert "rollout-0 exited with -9" in supervisor_log(run_dir)
    _wait(lambda: not any(alive(p) for p in kids), what="all children gone", timeout_s=30)


def _coordinator_state(checkpoint):
    state = json.loads((checkpoint / "tandem_state.json").read_text())
    return json.loads(state["extra_state"]["coordinator"])


def _wait(predicate, *, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.mark.parametrize(
    "name, overrides",
    [
        # (sync mode: test_reinforce_pp_learns_at_temperature_0_7_with_top_p_scored_on_policy runs it to completion)
        # colocated-style: trainer and engine hand their memory to each other every step
        (
            "sync_offload",
            ["loop.mode=sync", "loop.offload_train=true", "loop.offload_rollout=true", "tracing.exporter=file"],
        ),
        ("fully_async", ["loop.mode=fully_async", "loop.max_staleness=0"]),
        # one run for two things: more critic-only steps than the buffer holds (the actor's share of those batches
        # must not hold the bound), and two replicas taking verified weights from disk (the actor's only: the critic
        # publishes none)
        (
            "ppo_critic_two_replicas_disk_verified",
            [
                "algorithm.advantage_estimator=gae",
                "algorithm.num_critic_only_steps=3",
                "algorithm.lambd=0.95",
                "redis.max_buffered_batches=2",
                "redis.put_timeout_s=60",
                "services.rollout=[{port: 0}, {port: 0}]",
                "weights.transport=disk",
                "weights.check_weight_update_equal=true",
            ],
        ),
    ],
)
def test_loop_modes_run_to_completion(tmp_path, name, overrides):
    run_dir = tmp_path / name
    proc = start_run(run_dir, "loop.num_rollout=6", "loop.save_interval=3", "loop.eval_interval=6", *overrides)
    assert proc.wait(timeout=600) == 0, supervisor_log(run_dir)
    steps = [r for r in metrics(run_dir) if "perf/step_time_s" in r]
    assert [r["rollout_id"] for r in steps] == list(range(6))
    state = _coordinator_state(checkpoints(run_dir)[-1])
    assert state["next_rollout_id"] == 6
    # nothing lost: every generated sample was trained or dropped as stale (and counted)
    assert state["samples_generated"] == 6 * 32 * 8
    assert (
        state["samples_trained"] + state["samples_dropped_stale"] + state["samples_critic_only"]
        == state["samples_generated"]
    )
    assert state["samples_critic_only"] == (3 * 32 * 8 if "ppo_critic" in name else 0)
    if name.startswith("sync"):
        assert {r["rollout/staleness"] for r in steps} == {0.0}
    if name == "sync_offload":
        assert all(r["perf/rollout_release_s"] > 0 for r in steps)
        evals = [r["eval/reward_mean"] for r in metrics(run_dir) if "eval/reward_mean" in r]
        assert len(evals) == 2 and all(0.0 <= e <= 1.0 for e in evals)  # the engine evaluates after every resume
        assert all(r["perf/trainer_offload_s"] > 0 and r["memory/trainer_gpu_gb_offloaded"] >= 0 for r in steps)
        assert all(r["perf/trainer_onload_s"] > 0 for r in steps[1:]) and "perf/trainer_onload_s" not in steps[0]
        # one offload and one onload per step: the trainer stays offloaded from after the sync until the next
        # train (it once offloaded after train and onloaded again for the sync, so generation got nothing)
        spans = sorted(
            (json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()),
            key=lambda s: s["start_ns"],
        )
        order = [
            s["name"].removeprefix("rl.")
            for s in spans
            if (
                s["service"] == "tandem-coordinator" and s["name"] in ("rl.train", "rl.sync", "rl.offload", "rl.onload")
            )
            or (s["service"] == "tandem-rollout" and s["name"] == "rl.sample")
        ]
        steady = ["sample", "onload", "train", "sync", "offload"]
        assert order == ["sync", "sample", "train", "sync", "offload", *steady * 5]
    if name == "fully_async":
        assert state["samples_dropped_stale"] > 0
        assert steps[-1]["rollout/stale_dropped_total"] == state["samples_dropped_stale"]
    if "ppo_critic" in name:
        assert all("critic/value_loss" in r and "train/loss" not in r for r in steps[:3])  # critic-only warm-up
        assert "train/loss" in steps[-1]
        assert len(checkpoints(run_dir, "critic")) == 2
    if "two_replicas_disk_verified" in name:
        assert steps[-1]["weights/verified_tensors"] > 0
        assert (run_dir / "logs" / "rollout-1.log").exists()
