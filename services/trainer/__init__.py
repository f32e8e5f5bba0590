"""The trainer service: DeepSpeed policy training (GRPO, PPO-clip), the PPO critic, checkpoints.

Start it (the CLI dispatches to `server.main`):

    tandem trainer CONFIG --role actor|critic                       # 1 rank, or re-runs itself under torchrun
                                                                    # when trainer.num_ranks > 1
    torchrun --nproc-per-node N -m services.cli trainer CONFIG      # N ranks (what `tandem run` does)
    deepspeed --no_local_rank --num_gpus N --module services.cli trainer CONFIG

Rank 0 serves gRPC (`server.TrainerServicer` → `service.TrainerService`) and relays each command to the
other ranks (`dist.CommandRelay`, JSON + raw bytes over a gloo group), which execute it in lockstep.

Modules: `service` (TrainerService: train/save/load/prepare_weight_sync/publish_weights/offload/onload/
get_state), `backend` (DeepSpeed engine, value model, lr schedule), `actor` and `critic` (one update each),
`losses`, `advantages`, `batching` (merge, validate, stale filter, shard, token-budget micro-batches),
`checkpoint` (layout, COMPLETE marker, retention, RNG), `weight_export` (HF-named full tensors, ZeRO-3
gathers), `dist` (process group, relay).

PPO: the critic's Train publishes V(s_t) (and its GAE advantages/returns) for the rollout under the Redis
key `<stream>:adv:<rollout_id>` as TensorData protobufs; the actor's Train with use_critic_values reads them,
recomputes GAE (adding KL reward shaping when configured) and deletes the key once its step is committed.
"""
