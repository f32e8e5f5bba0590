"""Names for the values whose type a third-party library leaves open (typed `Any` there), so that a signature says
which value it is instead of `Any`. Each says which library leaves it open and who checks its shape.

A public signature under services/ names `Any` only through these (tests/test_layering.py checks it).
"""

from __future__ import annotations

from typing import Any, TypeAlias

# json.loads and yaml.safe_load type what they parse as Any: a JSON/YAML object whose values the reader checks
# (config validation, a relayed command's decoder, a checkpoint's state files).
JsonObject: TypeAlias = dict[str, Any]
# One value of such an object (a key's value before it is checked).
JsonValue: TypeAlias = Any
# redis-py types a command's reply as Any (its ResponseT): the buffer's decoders check the shape.
RedisReply: TypeAlias = Any
# A Hugging Face causal LM of a family a decoder knows (llama, qwen2): torch.nn.Module types the submodules it reaches
# by name (model.layers[i].self_attn, lm_head) as Tensor | Module, so they are only known once the family is checked.
HFCausalLM: TypeAlias = Any
# The context a torch.autograd.Function's forward and backward share: torch types it Any, and each Function keeps
# its own fields on it.
AutogradContext: TypeAlias = Any
