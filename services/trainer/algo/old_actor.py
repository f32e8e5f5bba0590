"""keep_old_actor: score each sample under the weights that generated it, in the trainer's own numerics.

Every PublishWeights snapshots the policy's weights (the version the engines now serve) on every rank, in host
memory, keyed by that version. A Train then computes each sample's "old" log-probs (the PPO ratio's
denominator, and TIS's numerator) with the snapshot of each token's version (`token_versions`), loaded into
a frozen copy of the model. Compared with rollout log-probs, the ratio is then free of the engine's numerics
(kernels, dtype, KV cache): TIS corrects that part separately.

Keyed by version rather than miles' rotating old_actor / rollout_actor tags, so every loop mode is covered:
one step off (the version before the last), sync, and fully_async (up to max_staleness + 1 versions kept).

Costs, chosen so the step itself is untouched: one gather of the full weights and a device-to-host copy per
publish (under ZeRO-3 a collective, like the weight export), `keep` copies of the weights in host memory per
rank, one model on the device (like the reference model), and per Train one host-to-device load plus a
no-grad forward. A snapshot taken at the current optimizer step equals the current weights, so then the current
policy is used and nothing is loaded (sync mode costs only the snapshot). Snapshots are not checkpointed, and a
Load drops them: after a restart, samples of versions from before it fall back to the current policy and are
counted (`old_actor_fallback_frac`). Like the reference model, the frozen copy stays on the device through an
Offload.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.contracts.config import TandemConfig


@dataclass(frozen=True)
class Snapshot:
    version: int
    optimizer_step: int  # the trainer's optimizer step count when it was taken
    weights: dict[str, torch.Tensor]  # HF names -> host tensors in the trainer's parameter dtype


def snapshots_to_keep(config: TandemConfig) -> int:
    """One step off needs the version before the last; fully_async and streaming up to max_staleness versions back."""
    if config.loop.mode in ("fully_async", "streaming"):
        return max(2, config.loop.max_staleness + 1)
    return 2


class OldActor:
    def __init__(self, *, config: TandemConfig, device: torch.device, dtype: torch.dtype, keep: int):
        self.config, self.device, self.dtype, self.keep = config, device, dtype, keep
        self.snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self._module: torch.nn.Module | None = None
        self._loaded: int | None = None

    def take_snapshot(self, *, version: int, weights: Iterator[tuple[str, torch.Tensor]], optimizer_step: int) -> None:
        """Every rank, walking the exported weights in self.dtype (a collective under ZeRO-3); with LoRA they are
        the merged weights, which the frozen base model takes."""
        pin = self.device.type == "cuda"
        host_weights = {}
        for name, tensor in weights:
            host = tensor.to("cpu", copy=True)
            host_weights[name] = host.pin_memory() if pin else host
        self.snapshots[version] = Snapshot(version=version, optimizer_step=optimizer_step, weights=host_weights)
        self.snapshots.move_to_end(version)
        while len(self.snapshots) > self.keep:
            dropped, _ = self.snapshots.popitem(last=False)
            if dropped == self._loaded:
                self._loaded = None

    def clear(self) -> None:
        """A Load rolls the weights back: snapshots of the discarded history must not score anything."""
        self.snapshots.clear()
        self._loaded = None

    def get(self, version: int) -> Snapshot | None:
        return self.snapshots.get(version)

    def module_for(self, snapshot: Snapshot) -> torch.nn.Module:
        """The frozen model holding `snapshot`'s weights (loaded only when another version is in it)."""
        if self._module is None:
            from services.trainer.model.backend import load_frozen_causal_lm

            self._module = load_frozen_causal_lm(self.config, self.device)
        if self._loaded != snapshot.version:
            with torch.no_grad():
                params = dict(self._module.named_parameters())
                missing = sorted(set(params) - set(snapshot.weights))
                if missing:
                    raise RuntimeError(f"old-actor snapshot v{snapshot.version} lacks parameters {missing[:5]}")
                for name, param in params.items():
                    param.copy_(snapshot.weights[name], non_blocking=True)
            self._loaded = snapshot.version
        return self._module
