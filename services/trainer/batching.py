"""From rollout batches to micro-batches: merge, validate, drop stale samples, shard over ranks, pack.

A `TrainBatch` is the concatenation of the step's rollout batches (same flat layout as the wire format).
Every rank holds the whole batch, so global quantities (advantages, aggregation weights) are computed
identically everywhere; each rank then trains on its shard, split into micro-batches under a token budget.
Per-token tensors of a micro-batch are addressed by `token_index` into the batch's flat response arrays.

A micro-batch is rows x width tokens, width = its longest sample. Padded (the default), each row holds one sample
and shorter ones are padded to the width. Packed (`trainer.pack_sequences`), a row holds as many samples as fit
its width (first fit, longest first), each with position ids from 0, and no attention attribute: transformers then
masks attention within each sample (block-diagonal; flash_attention_2 runs it as variable-length sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from services.contracts.wire import RolloutBatchData


@dataclass(frozen=True)
class TrainBatch:
    tokens: torch.Tensor  # int64, prompt+response of every sample, concatenated
    prompt_lengths: torch.Tensor  # int64 [n]
    response_lengths: torch.Tensor  # int64 [n]
    loss_mask: torch.Tensor  # float32 [T]
    rollout_log_probs: torch.Tensor  # float32 [T]
    rewards: torch.Tensor  # float32 [n]
    group_ids: torch.Tensor  # int64 [n]
    sample_versions: torch.Tensor  # int64 [n]
    sampling_temperature: torch.Tensor  # float32 [n]: the distribution each sample was drawn from
    sampling_top_p: torch.Tensor  # float32 [n]
    sampling_top_k: torch.Tensor  # int64 [n]
    # bool [n]: the sample's rollout log-probs are of the tempered distribution (its batch's logprob_space,
    # e.g. SGLang), else of the sampling one (the native engine): the trainer scores each in its own space
    logprob_tempered: torch.Tensor | None = None
    values: torch.Tensor | None = None  # float32 [T], the critic's values (PPO actor)
    # int64 [T]: the weight version that sampled each response token (a sync may land mid-generation); None when
    # built without it (tests, benches): every token has its sample's version
    token_versions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.logprob_tempered is None:  # built without it (tests, benches): the sampling space
            object.__setattr__(self, "logprob_tempered", torch.zeros(self.num_samples, dtype=torch.bool))
        if self.token_versions is None:
            object.__setattr__(
                self, "token_versions", torch.repeat_interleave(self.sample_versions, self.response_lengths)
            )

    @property
    def versions(self) -> torch.Tensor:
        """token_versions, never None."""
        assert self.token_versions is not None
        return self.token_versions

    @property
    def tempered(self) -> torch.Tensor:
        """logprob_tempered, never None (the type checker's view of __post_init__)."""
        assert self.logprob_tempered is not None
        return self.logprob_tempered

    @property
    def num_samples(self) -> int:
        return int(self.prompt_lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_lengths.sum())

    def offsets(self) -> tuple[list[int], list[int]]:
        """Start of each sample in `tokens` and in the flat response-token arrays."""
        return _starts(self.prompt_lengths + self.response_lengths).tolist(), _starts(self.response_lengths).tolist()

    def select(self, keep: list[int]) -> TrainBatch:
        """The samples `keep` (in that order), with their tokens and per-token arrays."""
        idx = torch.tensor(keep, dtype=torch.long)
        seq, resp = self.prompt_lengths + self.response_lengths, self.response_lengths
        tok_idx = _ranges(_starts(seq)[idx], seq[idx])
        rsp_idx = _ranges(_starts(resp)[idx], resp[idx])
        return TrainBatch(
            tokens=self.tokens[tok_idx],
            prompt_lengths=self.prompt_lengths[idx],
            response_lengths=self.response_lengths[idx],
            loss_mask=self.loss_mask[rsp_idx],
            rollout_log_probs=self.rollout_log_probs[rsp_idx],
            rewards=self.rewards[idx],
            group_ids=self.group_ids[idx],
            sample_versions=self.sample_versions[idx],
            sampling_temperature=self.sampling_temperature[idx],
            sampling_top_p=self.sampling_top_p[idx],
            sampling_top_k=self.sampling_top_k[idx],
            logprob_tempered=self.tempered[idx],
            values=None if self.values is None else self.values[rsp_idx],
            token_versions=self.versions[rsp_idx],
        )

    def mask_samples(self, samples: list[int]) -> TrainBatch:
        """The batch with every response token of `samples` at loss_mask 0 (out of the loss, still in the batch)."""
        idx = torch.tensor(samples, dtype=torch.long)
        mask = self.loss_mask.clone()
        mask[_ranges(_starts(self.response_lengths)[idx], self.response_lengths[idx])] = 0.0
        return replace(self, loss_mask=mask)

    def with_values(self, values: torch.Tensor) -> TrainBatch:
        if values.shape != (self.num_response_tokens,):
            raise ValueError(
                f"critic values hold {values.shape[0]} entries, the batch has "
                f"{self.num_response_tokens} response tokens"
            )
        return replace(self, values=values.to(torch.float32))


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lengths, 0) - lengths


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of range(start, start + length) for each pair, without a Python loop."""
    if not len(lengths):
        return torch.zeros(0, dtype=torch.long)
    shift = starts - _starts(lengths)
    return torch.arange(int(lengths.sum()), dtype=torch.long) + torch.repeat_interleave(shift, lengths)


def merge_batches(batches: list[RolloutBatchData]) -> TrainBatch:
    """Concatenates rollout batches in the given order (the order the entries were named)."""
    if not batches:
        raise ValueError("empty batch: no rollout batches to train on")
    for b in batches:
        b.validate()  # mismatched lengths, NaN rewards: refuse before anything else happens

    def cat(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([np.asarray(getattr(b, name)) for b in batches])).to(dtype)

    return TrainBatch(
        tokens=cat("tokens", torch.long),
        prompt_lengths=cat("prompt_lengths", torch.long),
        response_lengths=cat("response_lengths", torch.long),
        loss_mask=cat("loss_mask", torch.float32),
        rollout_log_probs=cat("rollout_log_probs", torch.float32),
        rewards=cat("rewards", torch.float32),
        group_ids=cat("group_ids", torch.long),
        sample_versions=cat("sample_versions", torch.long),
        sampling_temperature=cat("sampling_temperature", torch.float32),
        sampling_top_p=cat("sampling_top_p", torch.float32),
        sampling_top_k=cat("sampling_top_k", torch.long),
        logprob_tempered=torch.cat([torch.full((b.num_samples,), b.logprob_space == "tempered") for b in batches]),
        token_versions=torch.from_numpy(np.concatenate([b.versions for b in batches])).to(torch.long),
    )


def check_trainable(
    batch: TrainBatch, *, vocab_size: int, max_positions: int | None, needs_rollout_log_probs: bool
) -> None:
    """Refuses a batch the model cannot train on, with a message naming the problem."""
    if batch.num_samples == 0:
        raise ValueError("empty batch: the rollout batches hold no samples")
    if (batch.prompt_lengths < 1).any():
        raise ValueError("every sample needs a prompt of at least one token (the first response token's context)")
    if batch.num_tokens and (int(batch.tokens.min()) < 0 or int(batch.tokens.max()) >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}) (the model's vocabulary); got "
            f"[{int(batch.tokens.min())}, {int(batch.tokens.max())}]"
        )
    longest = int((batch.prompt_lengths + batch.response_lengths).max())
    if max_positions is not None and longest > max_positions:
        raise ValueError(f"a sample has {longest} tokens, more than the model's {max_positions} positions")
    if not torch.isfinite(batch.rewards).all():
        raise ValueError("rewards contain NaN or inf")
    if needs_rollout_log_probs and not torch.isfinite(batch.rollout_log_probs).all():
        raise ValueError("rollout_log_probs contain NaN or inf")
    if float(batch.loss_mask.sum()) <= 0:
        raise ValueError("no trainable tokens: every response token has loss_mask 0")


def stale_samples(batch: TrainBatch, *, weight_version: int, max_staleness: int) -> list[int]:
    """Indices of samples whose oldest token was sampled more than `max_staleness` versions before `weight_version`
    (a sample's version is its oldest token's: the wire checks it)."""
    if max_staleness < 0:
        return []
    stale = (weight_version - batch.sample_versions) > max_staleness
    return torch.nonzero(stale).flatten().tolist()


def token_lag_fractions(batch: TrainBatch, *, weight_version: int) -> dict[str, float]:
    """`token_lag_frac_<k>`: the fraction of the batch's trainable tokens sampled k versions before
    `weight_version` (the policy the step starts from)."""
    trainable = batch.loss_mask > 0
    lags = (weight_version - batch.versions)[trainable]
    if not lags.numel():
        return {}
    values, counts = torch.unique(lags, return_counts=True)
    return {f"token_lag_frac_{int(v)}": float(c) / lags.numel() for v, c in zip(values, counts, strict=True)}


def shard_samples(seq_lengths: list[int], *, world_size: int, rank: int) -> list[int]:
    """Longest-first greedy assignment to the least-loaded rank: balanced tokens, deterministic."""
    loads = [0] * world_size
    mine = []
    for i in sorted(range(len(seq_lengths)), key=lambda i: (-seq_lengths[i], i)):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        loads[r] += seq_lengths[i]
        if r == rank:
            mine.append(i)
    return sorted(mine)


def pack_rows(sample_ids: list[int], seq_lengths: list[int], *, token_budget: int) -> list[list[list[int]]]:
    """Micro-batches of rows of samples: a micro-batch's width is its longest sample, each row holds samples whose
    lengths sum to at most the width, and rows x width stays within `token_budget` (first fit, longest first: a
    sample goes to the first row with room, else a new row of the first micro-batch with budget left, else a new
    micro-batch); a sample longer than the budget gets a micro-batch of its own."""
    groups: list[list[list[int]]] = []
    rooms: list[list[int]] = []  # per micro-batch, per row: the columns left
    widths: list[int] = []
    for i in sorted(sample_ids, key=lambda i: (-seq_lengths[i], i)):
        n = seq_lengths[i]
        spot = next(
            ((g, r) for g, room in enumerate(rooms) if max(room) >= n for r, left in enumerate(room) if left >= n), None
        )
        if spot is not None:
            g, r = spot
            groups[g][r].append(i)
            rooms[g][r] -= n
            continue
        g = next((g for g, w in enumerate(widths) if w * (len(groups[g]) + 1) <= token_budget), len(groups))
        if g == len(groups):
            groups.append([])
            rooms.append([])
            widths.append(n)
        groups[g].append([i])
        rooms[g].append(widths[g] - n)
    return groups


def pack_samples(sample_ids: list[int], seq_lengths: list[int], *, token_budget: int) -> list[list[int]]:
    """Groups samples so that rows x longest row stays within `token_budget` (padded cost); a sample
    longer than the budget gets a micro-batch of its own."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sorted(sample_ids, key=lambda i: (-seq_lengths[i], i)):
        width = max(longest, seq_lengths[i])
        if current and width * (len(current) + 1) > token_budget:
            groups.append(current)
            current, width = [], seq_lengths[i]
        current.append(i)
        longest = width
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [B, L], right-padded
    attention_mask: torch.Tensor  # [B, L]
    rows: torch.Tensor  # [N] row of each response token
    positions: torch.Tensor  # [N] output position that predicts it
    targets: torch.Tensor  # [N] the token id
    token_index: torch.Tensor  # [N] index into the batch's flat response-token arrays
    num_tokens: int  # real (unpadded) tokens
    position_ids: torch.Tensor | None = None  # [B, L]: packed rows (restarting per sample); None: padded rows

    def to(self, device: torch.device) -> MicroBatch:
        """On `device`, token_index included. Host tensors are pinned first, so the copies do not stall the host
        until the device has finished the work queued before them (a pageable copy would)."""
        if self.input_ids.device == device:
            return self

        def move(x: torch.Tensor) -> torch.Tensor:
            pin = pinned_copy(x, device)
            return (x.pin_memory() if pin else x).to(device, non_blocking=pin)

        return MicroBatch(
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            rows=move(self.rows),
            positions=move(self.positions),
            targets=move(self.targets),
            token_index=move(self.token_index),
            num_tokens=self.num_tokens,
            position_ids=None if self.position_ids is None else move(self.position_ids),
        )


def pinned_copy(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether moving `tensor` to `device` goes through pinned host memory: a host tensor bound for a GPU. A tensor
    already on a GPU cannot be pinned (a batch moved to "cuda:0" and asked for "cuda" again is one)."""
    return device.type == "cuda" and tensor.device.type == "cpu"


def build_micro_batch(batch: TrainBatch, sample_ids: list[int] | list[list[int]]) -> MicroBatch:
    """One sample per row (a list of sample ids), or packed rows (a list of rows, each a list of sample ids)."""
    packed = bool(sample_ids) and isinstance(sample_ids[0], list)
    layout: list[list[int]] = [list(r) for r in sample_ids] if packed else [[i] for i in sample_ids]  # type: ignore
    flat = [i for row in layout for i in row]
    ids = torch.tensor(flat, dtype=torch.long)
    prompts, resps = batch.prompt_lengths[ids], batch.response_lengths[ids]
    seqs = prompts + resps
    row_of_sample = torch.tensor([r for r, row in enumerate(layout) for _ in row], dtype=torch.long)
    # each sample's first column in its row: after the samples before it in the same row
    lengths, starts, width = iter(seqs.tolist()), [], 0
    for row in layout:
        column = 0
        for _ in row:
            starts.append(column)
            column += next(lengths)
        width = max(width, column)
    row_start = torch.tensor(starts, dtype=torch.long)
    tok_start = _starts(batch.prompt_lengths + batch.response_lengths)[ids]
    resp_start = _starts(batch.response_lengths)[ids]
    # (row, column) of every real token, then of every response token's predicting position
    row_of_tok = torch.repeat_interleave(row_of_sample, seqs)
    in_sample = torch.arange(int(seqs.sum())) - torch.repeat_interleave(_starts(seqs), seqs)
    col_of_tok = in_sample + torch.repeat_interleave(row_start, seqs)
    input_ids = torch.zeros(len(layout), width, dtype=torch.long)
    attention = torch.zeros(len(layout), width, dtype=torch.long)
    input_ids[row_of_tok, col_of_tok] = batch.tokens[_ranges(tok_start, seqs)]
    attention[row_of_tok, col_of_tok] = 1
    rows = torch.repeat_interleave(row_of_sample, resps)
    positions = _ranges(row_start + prompts - 1, resps)
    position_ids = None
    if packed:  # positions from 0 in each sample; a row's padding is a block of its own (0, 1, ...)
        position_ids = torch.arange(width).repeat(len(layout), 1) - attention.sum(dim=1, keepdim=True)
        position_ids[row_of_tok, col_of_tok] = in_sample
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        rows=rows,
        positions=positions,
        targets=input_ids[rows, positions + 1],
        token_index=_ranges(resp_start, resps),
        num_tokens=int(seqs.sum()),
        position_ids=position_ids,
    )


def dummy_micro_batch() -> MicroBatch:
    """Two tokens, no response token: keeps ranks with less data in lockstep (ZeRO-3 gathers every forward)."""
    empty = torch.zeros(0, dtype=torch.long)
    return MicroBatch(
        input_ids=torch.zeros(1, 2, dtype=torch.long),
        attention_mask=torch.ones(1, 2, dtype=torch.long),
        rows=empty,
        positions=empty,
        targets=empty,
        token_index=empty,
        num_tokens=0,
    )


def plan_micro_batches(
    batch: TrainBatch, *, world_size: int, rank: int, token_budget: int, pack: bool = False
) -> list[MicroBatch]:
    """This rank's micro-batches (not yet padded to the other ranks' count); `pack`: several samples per row."""
    seq = (batch.prompt_lengths + batch.response_lengths).tolist()
    mine = shard_samples(seq, world_size=world_size, rank=rank)
    groups: list[list[int]] | list[list[list[int]]] = (
        pack_rows(mine, seq, token_budget=token_budget) if pack else pack_samples(mine, seq, token_budget=token_budget)
    )
    return [build_micro_batch(batch, g) for g in groups]
