"""bench_train_step's model bodies and variants: the Qwen2 shapes over Tandem's toy vocabulary (`--presets`) and each
variant's trainer settings (`--variants`). bench_checksums and op_counts read them too.
"""

from __future__ import annotations

from typing import Any

import torch

# Qwen2 bodies over Tandem's 22-token vocabulary (services/modelinit/init_model.py VOCAB)
SHAPES: dict[str, dict[str, Any]] = {
    "small": dict(
        hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4
    ),
    "q05": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    "q15": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
    # q05's 24 layers and 291 tensors at a width a CPU steps through in milliseconds: the host work per tensor
    # (what made q05 L=1 launch-bound on the H200) without the FLOPs
    "q05_narrow": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2
    ),
    # two narrow layers: a step whose ops are mostly the loss, the head and the optimizer (tests/test_op_budget.py)
    "tiny": dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    ),
}
VARIANTS: dict[str, dict[str, Any]] = {
    "ds_z1_bf16": {"kind": "ds", "zero_stage": 1, "precision": "bf16"},
    "ds_z1_bf16_8k": {"kind": "ds", "zero_stage": 1, "precision": "bf16", "micro_batch_tokens": 8192},
    "ds_z1_bf16_eager": {"kind": "ds", "zero_stage": 1, "precision": "bf16", "fused_kernels": "off"},
    # ZeRO-0: Tandem's flat AdamW (services/trainer/model/flat_adamw.py) under the DeepSpeed engine
    "ds_z0_bf16": {"kind": "ds", "zero_stage": 0, "precision": "bf16"},
    "ds_z0_bf16_64k": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "micro_batch_tokens": 65536},
    "ds_z0_bf16_128k": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "micro_batch_tokens": 131072},
    # issue 39: the head as before it, 1,024- (its default) or 8,192-token chunks over 8,192-column blocks (whatever
    # --chunk-tokens says)
    "ds_z0_bf16_c1024": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "chunk_tokens": 1024},
    "ds_z0_fp32_c1024": {"kind": "ds", "zero_stage": 0, "precision": "fp32", "chunk_tokens": 1024},
    "ds_z0_bf16_c8192": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "chunk_tokens": 8192},
    # the auto head's table as before its 1 GiB cap (1/32 of the GPU's memory: 4,372 rows at 151,936 on an H100); run
    # in a process of its own (it sets head_scoring's module budget for the rest of the process)
    "ds_z0_bf16_share32": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "auto_gpu_logits": 2**62},
    "ds_z0_bf16pure_ac_share32": {
        "kind": "ds",
        "zero_stage": 0,
        "precision": "bf16_pure",
        "activation_checkpointing": True,
        "auto_gpu_logits": 2**62,
    },
    "ds_z0_bf16_32k": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "micro_batch_tokens": 32768},
    # the smallest q05 peak for the "<= 0.5x TRL's" goal: 8,192-token micro-batches (TRL's) and 512 MiB head tables
    "ds_z0_bf16pure_ac_8k_cap512m": {
        "kind": "ds",
        "zero_stage": 0,
        "precision": "bf16_pure",
        "activation_checkpointing": True,
        "micro_batch_tokens": 8192,
        "auto_gpu_logits": 2**27,
    },
    # the same at 16,384-token micro-batches: 8.28 GiB with 1 GiB tables (6.77 s), 7.10 with both changes (16.2 s)
    "ds_z0_bf16pure_ac_cap512m": {
        "kind": "ds",
        "zero_stage": 0,
        "precision": "bf16_pure",
        "activation_checkpointing": True,
        "auto_gpu_logits": 2**27,
    },
    "ds_z0_bf16pure": {"kind": "ds", "zero_stage": 0, "precision": "bf16_pure"},
    "ds_z0_bf16pure_nocheck": {"kind": "ds", "zero_stage": 0, "precision": "bf16_pure", "skip_nonfinite_steps": False},
    "ds_z0_fp32": {"kind": "ds", "zero_stage": 0, "precision": "fp32"},
    # issue 31: scoring through full logits (the old path), activation checkpointing, packed rows
    "ds_z0_fp32_old": {"kind": "ds", "zero_stage": 0, "precision": "fp32", "scoring": "old"},
    "ds_z0_fp32_ac": {"kind": "ds", "zero_stage": 0, "precision": "fp32", "activation_checkpointing": True},
    "ds_z0_fp32_packed": {"kind": "ds", "zero_stage": 0, "precision": "fp32", "pack_sequences": True},
    "ds_z0_bf16_old": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "scoring": "old"},
    "ds_z0_bf16_ac": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "activation_checkpointing": True},
    "ds_z0_bf16_packed": {"kind": "ds", "zero_stage": 0, "precision": "bf16", "pack_sequences": True},
    "ds_z0_bf16pure_old": {"kind": "ds", "zero_stage": 0, "precision": "bf16_pure", "scoring": "old"},
    "ds_z0_bf16pure_ac": {"kind": "ds", "zero_stage": 0, "precision": "bf16_pure", "activation_checkpointing": True},
    "ds_z2_bf16": {"kind": "ds", "zero_stage": 2, "precision": "bf16"},
    "ds_z1_bf16_32k": {"kind": "ds", "zero_stage": 1, "precision": "bf16", "micro_batch_tokens": 32768},
    "ds_z1_bf16_nocheck": {"kind": "ds", "zero_stage": 1, "precision": "bf16", "skip_nonfinite_steps": False},
    "ds_z1_bf16pure": {"kind": "ds", "zero_stage": 1, "precision": "bf16_pure"},
    "ds_z1_bf16pure_32k": {"kind": "ds", "zero_stage": 1, "precision": "bf16_pure", "micro_batch_tokens": 32768},
    "ds_z1_fp32": {"kind": "ds", "zero_stage": 1, "precision": "fp32"},
    # trainer.lora: rank-16 / rank-64 adapters on every linear layer (not the head), the base frozen
    "ds_z1_bf16_lora16": {"kind": "ds", "zero_stage": 1, "precision": "bf16", "lora": {"rank": 16}},
    "ds_z1_bf16_lora64": {"kind": "ds", "zero_stage": 1, "precision": "bf16", "lora": {"rank": 64}},
    "ds_z3_bf16_lora16": {"kind": "ds", "zero_stage": 3, "precision": "bf16", "lora": {"rank": 16}},
    "torch_bf16": {"kind": "torch", "param_dtype": torch.bfloat16, "autocast": False},
    "torch_bf16_fused": {"kind": "torch", "param_dtype": torch.bfloat16, "autocast": False, "fused": True},
    "torch_bf16_32k": {"kind": "torch", "param_dtype": torch.bfloat16, "autocast": False, "micro_batch_tokens": 32768},
    "torch_amp": {"kind": "torch", "param_dtype": torch.float32, "autocast": True},
    "hf_fwd_bwd": {"kind": "floor"},
}
