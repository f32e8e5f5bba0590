"""trainer.lora: real peft adapters on the real DeepSpeed engine (CPU, gloo), the tiny model, a real redis-server.

Covers: target validation; only the adapters require grad and hold optimizer state (ZeRO 0-3); weight specs and
synced weights are the base model's names and shapes holding W + scaling·B·A (checked against peft's own
merge_and_unload of the exported adapter); the HF export reloads to the trained model's outputs; the base weights
never change; save → fresh engine → load reproduces the next step; the KL reference is the adapter-off model; the
old actor takes merged snapshots; the critic trains its adapters and value head.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from conftest_trainer import harness, make_batch, tiny_model_dir  # noqa: F401

from services.contracts.config import ConfigError
from services.contracts.config_loading import config_from_dict
from services.contracts.errors import FailedPrecondition
from services.contracts.trainer_calls import LoadRequest, PublishRequest, SaveRequest, TrainRequest, WeightSyncRequest
from services.launcher.preflight import check_lora
from services.trainer.model.lora import AdapterOffReference, check_model_targets

pytestmark = pytest.mark.timeout(180)

LORA = {"rank": 4, "alpha": 8}
INPUTS = torch.tensor([[1, 5, 9, 4, 7, 11, 30, 6], [1, 8, 8, 3, 20, 2, 5, 17]])


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _base_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _trained_logits(h) -> torch.Tensor:
    """The trainer's own model (adapters on) on INPUTS."""
    with torch.no_grad():
        return h.trainer.backend.engine(input_ids=INPUTS, attention_mask=torch.ones_like(INPUTS)).logits.float()


def _train(h, steps: int, model_dir: Path, *, first: int = 0) -> list:
    return [
        h.service.train(
            TrainRequest(rollout_id=i, entry_ids=(h.put(make_batch(rollout_id=i, seed=i, model_dir=model_dir)),))
        )
        for i in range(first, first + steps)
    ]


def test_lora_config_and_targets_are_validated(tiny_model_dir):  # noqa: F811
    def config(lora):
        return config_from_dict(
            {"model": {"path": str(tiny_model_dir)}, "data": {"train_path": "t"}, "trainer": {"lora": lora}},
            source="test",
        )

    assert config_from_dict({"model": {"path": "m"}, "data": {"train_path": "t"}}).trainer.lora is None
    lora = config({"rank": 8}).trainer.lora
    assert lora is not None and lora.lora_alpha == 16 and lora.target_modules == ("all-linear",)
    with pytest.raises(ConfigError, match=r"trainer.lora.rank: .*greater than or equal to 1"):
        config({"rank": 0})
    with pytest.raises(ConfigError, match=r"trainer.lora.rank: required key is missing"):
        config({"alpha": 8})
    with pytest.raises(ConfigError, match=r"trainer.lora.target_modules: names a module more than once"):
        config({"rank": 8, "target_modules": ["q_proj", "q_proj"]})
    # against the model: every bad name in one message, with the names that would work
    bad = config({"rank": 8, "target_modules": ["q_proj", "qkv_proj", "mlp"]}).trainer.lora
    with pytest.raises(ConfigError) as err:
        check_model_targets(str(tiny_model_dir), bad, critic=False)
    message = str(err.value)
    assert message.startswith(
        "trainer.lora.target_modules: 'qkv_proj' names no module; 'mlp' names a LlamaMLP, "
        "not a linear layer in LlamaForCausalLM at "
    )
    assert "its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in message
    head = config({"rank": 8, "target_modules": ["all-linear", "lm_head"]}).trainer.lora
    check_model_targets(str(tiny_model_dir), head, critic=False)
    with pytest.raises(ConfigError, match="'lm_head' names no module in LlamaModel"):  # the critic has no head
        check_model_targets(str(tiny_model_dir), head, critic=True)
    # `tandem run` checks the actor's and the critic's targets before any service starts
    ppo = config_from_dict(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_path": "t"},
            "trainer": {"lora": {"rank": 8, "target_modules": ["all-linear", "lm_head"]}},
            "algorithm": {"advantage_estimator": "gae"},
        },
        source="test",
    )
    with pytest.raises(ConfigError, match="'lm_head' names no module in LlamaModel"):
        check_lora(ppo)


@pytest.mark.parametrize("zero_stage,checkpointing", [(0, False), (1, False), (2, True), (3, True)])
def test_only_adapters_are_trained_and_hold_optimizer_state(
    harness,  # noqa: F811
    tiny_model_dir,  # noqa: F811
    zero_stage,
    checkpointing,
):
    h = harness(
        trainer={"zero_stage": zero_stage, "lora": LORA, "activation_checkpointing": checkpointing},
        algorithm={"eps_clip": 10.0},
    )
    engine = h.trainer.backend.engine
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:4]
    adapted = {n.split(".lora_")[0] for n in trainable}
    assert len(adapted) == 2 * 7  # every linear layer of both blocks, not the head
    adapter_numel = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    base = {n: t.clone() for n, t in h.service.iter_named_weights()}
    batch = make_batch(model_dir=tiny_model_dir)
    losses = [h.service.train(TrainRequest(rollout_id=i, entry_ids=(h.put(batch),))).metrics["loss"] for i in range(3)]
    assert losses[2] < losses[1] < losses[0], losses
    # Adam's state (two moments) exists for the adapters' elements only, whatever ZeRO flattened them into
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state_numel = sum(s["exp_avg"].numel() for s in inner.state.values())
    assert state_numel == adapter_numel
    # the frozen base weights did not move; the merged ones did (B left 0)
    frozen = {n: p for n, p in engine.module.named_parameters() if not p.requires_grad}
    reference = dict(_base_model(tiny_model_dir).named_parameters())
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(frozen.values()), enabled=zero_stage == 3):
        for name, p in frozen.items():
            hf_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p.detach(), reference[hf_name].detach()), name
    merged = dict(h.service.iter_named_weights())
    moved = [n for n in merged if not torch.equal(merged[n], base[n])]
    assert len(moved) == len(adapted) and all(n.endswith("proj.weight") for n in moved)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_synced_and_exported_weights_are_the_merged_model(harness, tiny_model_dir, zero_stage):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from services.weights import WeightReceiver, tensor_checksum

    h = harness(
        trainer={"zero_stage": zero_stage, "lora": LORA},
        algorithm={"use_rollout_logprobs": False, "keep_old_actor": True},
    )
    _train(h, 2, tiny_model_dir)
    base = _base_model(tiny_model_dir)
    specs = h.service.weight_specs()
    assert [(s.name, tuple(s.shape)) for s in specs] == [(n, tuple(p.shape)) for n, p in base.named_parameters()]
    saved = h.service.save(SaveRequest(rollout_id=1, export_hf=True))
    # the independent reference: peft's own merge of the exported adapter into the base model
    adapter_dir = Path(saved.hf_path) / "adapter"
    merged = PeftModel.from_pretrained(_base_model(tiny_model_dir), str(adapter_dir)).merge_and_unload()
    expected = {n: p.detach() for n, p in merged.named_parameters()}
    assert list(expected) == [s.name for s in specs]
    # the engine's copy of the base model receives the merged weights (disk transport, verified)
    engine_model = _base_model(tiny_model_dir)
    engine = dict(engine_model.named_parameters())
    plan = h.service.prepare_weight_sync(
        WeightSyncRequest(version=1, transport="disk", engine_world_size=1, verify=True)
    )
    receiver = WeightReceiver(accepted_trainer_id=h.service.trainer_id)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(stats=receiver.receive(plan, 1, engine)))
    thread.start()
    h.service.publish_weights(PublishRequest(version=1))
    thread.join(30)
    receiver.close()
    assert got["stats"].checksums == {m.name: m.checksum for b in plan.buckets for m in b.tensors}
    for name, p in engine.items():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6, msg=name)
    # the HF export is the same merged model; it and the engine compute what the trained model computes
    reloaded = AutoModelForCausalLM.from_pretrained(
        saved.hf_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert {n: tensor_checksum(p.detach()) for n, p in reloaded.named_parameters()} == got["stats"].checksums
    trained = _trained_logits(h)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=INPUTS).logits, trained, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(engine_model(input_ids=INPUTS).logits, trained, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(base(input_ids=INPUTS).logits, trained, atol=1e-4)  # it trained
    # the old actor's snapshot of v1 is the merged model too, and its frozen copy takes it
    snapshot = h.trainer.old_actor.get(1)
    assert snapshot is not None and list(snapshot.weights) == list(expected)
    with torch.no_grad():
        old = h.trainer.old_actor.module_for(snapshot)(input_ids=INPUTS).logits
    torch.testing.assert_close(old, trained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_lora_save_then_fresh_engine_load_reproduces_next_step(harness, tiny_model_dir, zero_stage):  # noqa: F811
    trainer = {"zero_stage": zero_stage, "lr": 3e-3, "warmup_steps": 2, "lora": LORA}
    batches = [make_batch(rollout_id=i, seed=i, model_dir=tiny_model_dir) for i in range(3)]
    a = harness(trainer=trainer, run_name="lora-resume")
    for i in range(2):
        a.service.train(TrainRequest(rollout_id=i, entry_ids=(a.put(batches[i]),)))
    saved = a.service.save(SaveRequest(rollout_id=1))
    expected = a.service.train(TrainRequest(rollout_id=2, entry_ids=(a.put(batches[2]),)))
    expected_weights = dict(a.service.iter_named_weights())
    a.close()
    # the shards hold the adapters and their optimizer state, not the frozen base
    base_bytes = sum(p.numel() * 4 for p in _base_model(tiny_model_dir).parameters())
    model_states = sum(f.stat().st_size for f in (Path(saved.path) / "ds").glob("*model_states.pt"))
    assert model_states < base_bytes / 3, (model_states, base_bytes)

    b = harness(trainer=trainer, run_name="lora-resume")
    loaded = b.service.load(LoadRequest())
    assert loaded.loaded and loaded.path == saved.path and loaded.step == 2
    again = b.service.train(TrainRequest(rollout_id=2, entry_ids=(b.put(batches[2]),)))
    for key in ("loss", "pg_loss", "grad_norm", "lr", "entropy", "ppo_ratio_mean"):
        assert again.metrics[key] == expected.metrics[key], key
    got = dict(b.service.iter_named_weights())
    assert all(torch.equal(got[n], expected_weights[n]) for n in expected_weights)
    # a trainer with other adapters (or none) refuses the checkpoint, naming why
    for other in ({**trainer, "lora": {"rank": 8}}, {**trainer, "lora": None}):
        c = harness(trainer=other, run_name="lora-resume")
        with pytest.raises(FailedPrecondition, match=r"was trained with trainer.lora \{'rank': 4"):
            c.service.load(LoadRequest())
        c.close()


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_kl_reference_is_the_model_with_adapters_off(harness, tiny_model_dir, zero_stage):  # noqa: F811
    from services.trainer.algo.actor import frozen_pass
    from services.trainer.algo.scoring import TokenSampling
    from services.trainer.batching import merge_batches
    from services.trainer.model.backend import load_frozen_causal_lm
    from services.trainer.update import lockstep_micro_batches

    # the output head adapted too: its LoRA path is scored as extra columns (a ZeRO-3 leaf, gathered whole)
    lora = {**LORA, "target_modules": ["all-linear", "lm_head"]}
    h = harness(trainer={"zero_stage": zero_stage, "lora": lora}, algorithm={"kl_coef": 0.1})
    ref = h.trainer.step.ref_model
    assert isinstance(ref, AdapterOffReference) and not list(ref.parameters())  # no second copy
    first, second = (r.metrics for r in _train(h, 2, tiny_model_dir))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the policy is the reference
    assert second["kl"] > 1e-6
    assert all(p.requires_grad for n, p in h.trainer.backend.module.named_parameters() if "lora_" in n)
    # after training, the view still scores like a fresh copy of the base model
    backend = h.trainer.backend
    batch = merge_batches([make_batch(seed=7, model_dir=tiny_model_dir)])
    mbs = lockstep_micro_batches(backend, batch, token_budget=64)
    sampling = TokenSampling.of(batch)
    frozen = load_frozen_causal_lm(h.config, backend.device)
    expected = frozen_pass(frozen, backend, batch.num_response_tokens, mbs, sampling, tempered=True)
    got = frozen_pass(ref, backend, batch.num_response_tokens, mbs, sampling, tempered=True)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    before = dict(h.service.iter_named_weights())
    _train(h, 1, tiny_model_dir, first=2)
    after = dict(h.service.iter_named_weights())
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the adapters still train


def test_critic_with_lora_trains_adapters_and_value_head(harness, tiny_model_dir):  # noqa: F811
    from transformers import AutoModel

    gae = {"advantage_estimator": "gae"}
    critic = harness(role="critic", run_name="lora-ppo", algorithm=gae, trainer={"lora": LORA})
    actor = harness(run_name="lora-ppo", algorithm=gae, trainer={"lora": LORA})
    module = critic.trainer.backend.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trainable
    assert all(n.startswith("value_head.") or "lora_" in n for n in trainable)
    for rollout_id in range(2):
        entry = critic.put(make_batch(rollout_id=rollout_id, seed=rollout_id, model_dir=tiny_model_dir))
        c = critic.service.train(TrainRequest(rollout_id=rollout_id, entry_ids=(entry,)))
        actor.service.train(TrainRequest(rollout_id=rollout_id, entry_ids=(entry,), use_critic_values=True))
    assert c.metrics["value_mean"] != 0.0 and c.metrics["value_loss"] > 0
    saved = critic.service.save(SaveRequest(rollout_id=1, export_hf=True))
    hf = Path(saved.hf_path)
    assert (hf / "value_head.safetensors").is_file() and (hf / "adapter" / "adapter_config.json").is_file()
    backbone = AutoModel.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = backbone(input_ids=INPUTS).last_hidden_state
        expected = critic.trainer.backend.engine(input_ids=INPUTS, attention_mask=torch.ones_like(INPUTS))
        head = module.value_head
        torch.testing.assert_close(head(hidden).squeeze(-1).float(), expected, rtol=1e-5, atol=1e-5)


def test_lora_offload_moves_the_frozen_base_too_and_training_goes_on(harness, tiny_model_dir):  # noqa: F811
    h = harness(trainer={"zero_stage": 2, "lora": LORA})
    _train(h, 1, tiny_model_dir)
    before = {n: t.detach().cpu().clone() for n, t in h.service.iter_named_weights()}
    on_gpu = h.trainer.dist.device.type == "cuda"
    resident = torch.cuda.memory_allocated() if on_gpu else 0
    assert h.service.offload().endswith("moved to host memory")
    frozen = [p for p in h.trainer.backend.module.parameters() if not p.requires_grad]
    assert frozen and all(p.device.type == "cpu" for p in frozen)
    if on_gpu:  # DeepSpeed's offload moves the adapters' states; the base weights leave the device as well
        assert resident - torch.cuda.memory_allocated() >= sum(p.numel() * p.element_size() for p in frozen)
    assert h.service.onload().startswith("states reloaded to")
    assert all(p.device == h.trainer.dist.device for p in h.trainer.backend.module.parameters())
    after = {n: t.detach().cpu() for n, t in h.service.iter_named_weights()}
    assert all(torch.equal(before[n], after[n]) for n in before)
    h.service.offload()
    assert _train(h, 1, tiny_model_dir, first=1)[0].step == 2  # onloads by itself
    zero3 = harness(run_name="lora-z3", trainer={"zero_stage": 3, "lora": LORA})
    with pytest.raises(NotImplementedError, match=r"needs trainer\.zero_stage 1 or 2"):
        zero3.service.offload()
    with pytest.raises(ConfigError, match=r"needs trainer\.zero_stage 1 or 2"):
        config_from_dict(
            {
                "model": {"path": "m"},
                "data": {"train_path": "t"},
                "loop": {"offload_train": True},
                "trainer": {"zero_stage": 3, "lora": LORA},
            }
        )
