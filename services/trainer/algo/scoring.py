"""Log-probs of sampled tokens under the distribution each was drawn from, scored from the model's last hidden
states chunk by chunk (services/trainer/algo/head_scoring.py: no [tokens x vocab] table outlives a chunk).

Each sample carries its sampling parameters (temperature, top-p, top-k; `RolloutBatch.sampling_*`), so a batch
may mix distributions (eval-style greedy samples next to T=0.7 ones, two replicas with different settings).
Two views are needed, and one forward gives both per token (`TokenScores` rows of the head's [3, N] output):

- the sampling distribution (the shared `services.tensors.sampling_dist` definition, truncation included): the
  entropy, and the PPO ratio, TIS and the log-prob mismatch of samples whose engine reports that distribution
  (the native engine), so an on-policy ratio is exactly 1;
- the tempered distribution (logits / T without truncation): the KL to the reference model (truncated, it would
  be infinite wherever the trained policy picks a token outside the reference's nucleus; tempered it is finite,
  and 0 while the policy equals the reference), and the ratio, TIS and mismatch of samples whose engine reports
  the tempered distribution (SGLang 0.5.x: `RolloutBatch.logprob_space` TEMPERED).

"The trainer scores what the engine reports": each token's behaviour space is its batch's stamp
(`TrainBatch.logprob_tempered`), so the ratio compares like with like whichever engine sampled (docs/algorithms.md).
A token outside its row's support has log-prob -inf in the sampling space; it is floored at LOG_PROB_FLOOR.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.contracts.sampling_spec import SamplingSpec
from services.tensors.sampling_dist import RowSampling
from services.trainer.algo.advantages import per_token
from services.trainer.algo.head_scoring import LOG_PROB_FLOOR, ChunkSetting, ScoreRequest, chunk_layout
from services.trainer.batching import MicroBatch, TrainBatch

__all__ = ["LOG_PROB_FLOOR", "MIXED", "SAMPLING", "TEMPERED", "TokenSampling", "score_request"]

# A batch's behaviour log-prob space (TokenSampling.space): every token's, or a mix.
SAMPLING, TEMPERED, MIXED = "sampling", "tempered", "mixed"


@dataclass(frozen=True)
class TokenSampling:
    """Per response token: which of the batch's distinct sampling distributions its sample was drawn from.

    The distinct distributions are found once per batch, over samples (a handful of keys), so a micro-batch of a
    batch drawn under one distribution (the usual case) costs no host work or device sync to score."""

    specs: tuple[SamplingSpec, ...]  # the batch's distinct distributions
    group: torch.Tensor  # int64 [N]: each token's index into `specs`
    temperature: torch.Tensor  # float32 [N]
    top_p: torch.Tensor  # float32 [N]
    top_k: torch.Tensor  # int64 [N]
    tempered: torch.Tensor  # bool [N]: the token's behaviour space is the tempered one
    space: str = SAMPLING  # the batch's: SAMPLING, TEMPERED (every token) or MIXED (host side)

    @classmethod
    def of(cls, batch: TrainBatch) -> TokenSampling:
        return cls.per_row(
            batch.sampling_temperature,
            batch.sampling_top_p,
            batch.sampling_top_k,
            lengths=batch.response_lengths,
            tempered=batch.tempered,
        )

    @classmethod
    def per_row(
        cls,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        top_k: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        tempered: torch.Tensor | None = None,
    ) -> TokenSampling:
        """From one (T, top-p, top-k) per sample, repeated `lengths` times (once per row when None); `tempered`
        (bool per sample, default none): samples whose rollout log-probs are of the tempered distribution."""
        index: dict[tuple[float, float, int], int] = {}
        # float32 values, as the rollout's tensors used them
        keys = zip(temperature.tolist(), top_p.tolist(), top_k.tolist(), strict=True)
        sample_group = torch.tensor(
            [index.setdefault((t, p, int(k)), len(index)) for t, p, k in keys], dtype=torch.long
        )
        specs = tuple(SamplingSpec(temperature=t, top_p=p, top_k=k) for t, p, k in index)
        columns = [
            sample_group,
            temperature.to(torch.float32),
            top_p.to(torch.float32),
            top_k.to(torch.long),
            torch.zeros(len(temperature), dtype=torch.bool) if tempered is None else tempered.to(torch.bool),
        ]
        space = TEMPERED if bool(columns[4].all()) else MIXED if bool(columns[4].any()) else SAMPLING
        if lengths is not None:
            columns = [per_token(x, lengths) for x in columns]
        group, temps, ps, ks, tempered_space = columns
        return cls(
            specs=specs, group=group, temperature=temps, top_p=ps, top_k=ks, tempered=tempered_space, space=space
        )

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenSampling:
        return TokenSampling(
            specs=self.specs,
            group=fn(self.group),
            temperature=fn(self.temperature),
            top_p=fn(self.top_p),
            top_k=fn(self.top_k),
            tempered=fn(self.tempered),
            space=self.space,
        )

    def at(self, index: torch.Tensor) -> TokenSampling:
        return self._map(lambda x: x[index])

    def to(self, device: torch.device) -> TokenSampling:
        return self._map(lambda x: x.to(device))

    def rows(self, vocab: int) -> RowSampling:
        """These tokens' distributions as the scoring head takes them (device work only, no host copy)."""
        return RowSampling.of_rows(self.temperature, self.top_k, self.top_p, specs=self.specs, vocab=vocab)


def score_request(
    mb: MicroBatch,
    sampling: TokenSampling,
    *,
    vocab: int,
    chunk_tokens: ChunkSetting,
    tempered: bool = False,
    entropy: bool = False,
    entropy_grad: bool = False,
    compiled: bool = False,
) -> ScoreRequest:
    """What to score for micro-batch `mb` (on the device; `sampling` = its tokens' sampling, on the device too):
    each token's log-prob in its behaviour space, or (`tempered`: the KL to the reference) of logits / T for every
    token; the entropy of the sampling distribution when asked (`entropy_grad`: it is in the loss); `compiled`:
    the untruncated blocks' math through torch.compile (on a GPU); `chunk_tokens`: trainer.scoring_chunk_tokens."""
    space = torch.ones_like(sampling.tempered) if tempered else sampling.tempered
    rows, block = chunk_layout(chunk_tokens, vocab, mb.targets.device)
    return ScoreRequest(
        rows=mb.rows,
        positions=mb.positions,
        targets=mb.targets,
        sampling=sampling.rows(vocab),
        tempered_space=space,
        chunk_tokens=rows,
        vocab_block=block,
        sampling_space=not tempered and sampling.space != TEMPERED,
        entropy=entropy,
        entropy_grad=entropy and entropy_grad,
        compiled=compiled,
    )
