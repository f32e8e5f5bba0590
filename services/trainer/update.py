"""The optimizer update the actor and the critic share: lockstep micro-batches, one forward/backward each, one step.

Every rank runs the same number of micro-batches (ZeRO-3 gathers parameters in each forward), padding with empty
ones whose loss is `anchor.sum() * 0` so their backward, and its ZeRO hooks, match the other ranks'. Each rank
scales its loss by the world size (DeepSpeed averages gradients over ranks) and sums its metrics; the sums are
added over ranks after the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from services.tensors.devices import cuda_peak_metrics
from services.trainer.algo.head_scoring import ChunkSetting
from services.trainer.algo.losses import aggregation_weights
from services.trainer.algo.scoring import TokenSampling
from services.trainer.batching import MicroBatch, TrainBatch, dummy_micro_batch, plan_micro_batches
from services.trainer.dist import DistInfo, all_reduce_max_int, all_reduce_sum
from services.trainer.model.backend import StepResult


class UpdateBackend(Protocol):
    """What an update asks of the model's engine (backend.UpdateBackend; a benchmark's plain torch model)."""

    dist_info: DistInfo
    parameters: int  # the model's parameter count
    vocab_size: int
    chunk_tokens: ChunkSetting  # trainer.scoring_chunk_tokens: the scoring head's tokens per chunk, or auto
    pack_sequences: bool
    compiled_scoring: bool

    @property
    def device(self) -> torch.device: ...
    @property
    def global_steps(self) -> int: ...
    def scores(
        self,
        mb: MicroBatch,
        sampling: TokenSampling,
        *,
        tempered: bool = False,
        entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def values(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]: ...
    def backward(self, loss: torch.Tensor, *, last: bool) -> None: ...
    def step(self) -> StepResult: ...


def lockstep_micro_batches(backend: UpdateBackend, batch: TrainBatch, *, token_budget: int) -> list[MicroBatch]:
    """This rank's micro-batches, padded with empty ones to the largest count over ranks."""
    info = backend.dist_info
    mbs = plan_micro_batches(
        batch, world_size=info.world_size, rank=info.rank, token_budget=token_budget, pack=backend.pack_sequences
    )
    count = all_reduce_max_int(len(mbs), info.device)
    return mbs + [dummy_micro_batch() for _ in range(count - len(mbs))]


def per_token_pass(
    num_tokens: int, mbs: list[MicroBatch], fn: Callable[[MicroBatch], torch.Tensor], *, device: torch.device
) -> torch.Tensor:
    """Runs `fn` (no grad) on every micro-batch (moved to `device`) and scatters its per-token output into a flat
    vector on `device`; entries of other ranks' tokens stay 0."""
    out = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    with torch.no_grad():
        for mb in mbs:
            dmb = mb.to(device)
            values = fn(dmb)
            if dmb.token_index.numel():
                out[dmb.token_index] = values.detach().float()
    return out


@dataclass(frozen=True)
class TokenWeights:
    """Per-token weights of the whole batch, on the device: `loss` aggregates the loss, `mean` (token_mean) the
    metrics."""

    loss: torch.Tensor
    mean: torch.Tensor

    @classmethod
    def of(cls, batch: TrainBatch, aggregation: str, device: torch.device) -> TokenWeights:
        lengths = batch.response_lengths
        return cls(
            loss=aggregation_weights(batch.loss_mask, lengths, aggregation).to(device),
            mean=aggregation_weights(batch.loss_mask, lengths, "token_mean").to(device),
        )

    def at(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """For a micro-batch on the device."""
        return self.loss[mb.token_index], self.mean[mb.token_index]


@dataclass(frozen=True)
class MicroBatchLoss:
    loss: torch.Tensor  # this micro-batch's weighted loss
    anchor: torch.Tensor  # the forward's full output (for an empty micro-batch)
    metrics: Callable[[], Mapping[str, torch.Tensor]]  # its metric sums by name, computed without grad


def optimizer_update(
    backend: UpdateBackend, mbs: list[MicroBatch], *, micro_loss: Callable[[MicroBatch], MicroBatchLoss]
) -> tuple[dict[str, float], StepResult]:
    """Backward of every micro-batch's loss, one optimizer step; ({"loss": loss, name: metric, ...}, the step),
    summed over micro-batches and ranks. `micro_loss` gets each micro-batch on the device; the per-token tensors it
    indexes should live there too, so that no host copy inside the loop stalls the queue."""
    device, world = backend.device, backend.dist_info.world_size
    names: tuple[str, ...] = ()
    totals = torch.zeros(0, dtype=torch.float64, device=device)
    for i, mb in enumerate(mbs):
        out = micro_loss(mb.to(device))
        loss = out.loss if mb.token_index.numel() else out.anchor.sum() * 0.0
        backend.backward(loss * world, last=i == len(mbs) - 1)
        with torch.no_grad():
            named = {"loss": loss, **out.metrics()}
            if i == 0:  # every rank sums the same names in the same order: its micro-losses are the same code
                names, totals = tuple(named), torch.zeros(len(named), dtype=torch.float64, device=device)
            totals += torch.stack([named[name].detach().double() for name in names])
    step = backend.step()
    return dict(zip(names, all_reduce_sum(totals).cpu().tolist(), strict=True)), step


def step_metrics(batch: TrainBatch, step: StepResult, start: float, *, parameters: int) -> dict[str, float]:
    """What every update reports beside its own sums: the batch, the step, the speed, the memory high-water mark.
    perf/train_tflops is the dense estimate 6 x parameters x tokens / seconds of all ranks together (no attention
    term, recomputation not counted): divided by the ranks' peak FLOP/s it is the MFU bench/ reports."""
    seconds = time.monotonic() - start
    return {
        "tokens": float(batch.num_tokens),
        "response_tokens": float(batch.num_response_tokens),
        "response_len_mean": float(batch.response_lengths.double().mean()),
        "reward_mean": float(batch.rewards.double().mean()),
        "samples": float(batch.num_samples),
        "grad_norm": step.grad_norm,
        "lr": step.lr,
        "perf/train_update_s": seconds,
        "perf/train_tokens_per_s": batch.num_tokens / seconds if seconds else 0.0,
        "perf/train_tflops": 6 * parameters * batch.num_tokens / seconds / 1e12 if seconds else 0.0,
        **cuda_peak_metrics(),
    }
