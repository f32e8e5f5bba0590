"""The RL algorithm: advantages, policy and value losses (the algorithm table's functions), rollout correction, the
actor's and critic's steps, scoring log-probs under the sampling distribution (chunked over the LM head), the frozen
old actor, and which samples a step trains on."""
