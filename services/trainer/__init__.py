"""The trainer service: DeepSpeed policy training (GRPO, PPO-clip), the PPO critic, checkpoints.

Start it (the CLI dispatches to `server.main`):

    tandem trainer CONFIG --role actor|critic                       # 1 rank, or re-runs itself under torchrun
                                                                    # when trainer.num_ranks > 1
    torchrun --nproc-per-node N -m services.cli trainer CONFIG      # N ranks (what `tandem run` does)
    deepspeed --no_local_rank --num_gpus N --module services.cli trainer CONFIG

Rank 0 serves gRPC (`server.TrainerServicer` -> `service.TrainerService`) and runs each step on every rank as a
typed command (`commands`: frozen dataclasses, a JSON + raw-bytes codec over `dist.CommandRelay`'s gloo group,
executed in lockstep with `match`).

Modules (each is listed; a test keeps this list whole):
- flat: `server` (gRPC), `service` (TrainerService, the facade: train/save/load/prepare_weight_sync/
  publish_weights/offload/onload/get_state), `builder` (TrainerParts from the config), `parts` (the five parts, one
  Protocol each), `ranks` (a command run on every rank over the parts), `commands`, `ledger` (exactly-once records of
  Train, checkpointed), `training` (rank 0's Redis side of Train; every rank's step), `checkpointing` (Save/Load,
  layout files, retention, RNG), `publishing` (weight sync to the engines, old-actor snapshots), `update` (the
  micro-batch loop and optimizer step the actor and critic share), `batching` (merge, validate, shard, token-budget
  micro-batches), `dist` (process group, relay).
- `algo/`: `actor` and `critic` (their losses over `update`), `losses`, `advantages`, `estimators` (the algorithm
  table's functions: an advantage estimator and a policy loss per name), `rollout_correction` (importance weights,
  rejection and veto on the trainer/behaviour ratio; the mismatch metrics), `scoring`, `head_math` and
  `head_scoring` (log-probs chunked over the LM head), `old_actor`, `selection` (stale filter, dynamic sampling,
  overlong filter), `distillation` (on-policy distillation's teacher and its two modes).
- `model/`: `backend` (DeepSpeed engine, value model, lr schedule), `flat_adamw`, `weight_export` (HF-named full
  tensors, ZeRO-3 gathers), `lora` (trainer.lora through peft: targets, merged export, adapter-off reference,
  adapter files).

PPO: the critic's Train publishes V(s_t) (and its GAE advantages/returns) for the rollout under the Redis
key `<stream>:adv:<rollout_id>` as TensorData protobufs; the actor's Train with use_critic_values reads them,
recomputes GAE (adding KL reward shaping when configured) and deletes the key once its step is committed.
"""
