"""A static-shape decode path for the native engine: preallocated KV cache, CUDA-graph-captured decode step.

Hugging Face's eager forward costs hundreds of kernel launches and a few hundred Python calls per token, so
on a GPU the decode of a ~0.5B model is bound by the host, not the device. Here the decode step is the
model's own modules (embedding, norms, projections, MLPs, rotary embedding, lm_head) driven through
fixed-shape buffers:

- `StaticKV`: one [batch, kv_heads, length, head_dim] key and value buffer per layer plus a [batch, length]
  mask of the slots that hold a real token. Prompts are left-padded to a common width, so every row writes
  decode step s into the same slot (width + s) while its rotary position counts only its own tokens.
- `StaticDecoder.prefill` runs the prompt eagerly (SDPA over the prompt's slots) and fills the cache;
  `decode` is one token for every row with attention over the cache's slots, masked by the slot mask.
  Attention in decode groups the query heads per KV head, so the cache is read once (no repeat_kv).
- `Runner` owns one cache and, on CUDA, a captured graph of `decode` (in "compile" mode of the
  torch.compile'd `decode`, whose fused kernels cut the launches a token roughly threefold); a step copies the new
  tokens and positions into the graph's inputs and replays it. A step runs over a view of the cache: the slots the
  rows have reached (`window_slots`: ~1/8 of the cache at a time) and, in continuous batching, the rows in use, a
  graph each view. Attention reads every slot it is given, so a step early in a 1,152-slot cache reads ~150 slots,
  not 1,152 (compile mode keeps the whole cache: it would compile once per view). On CPU (or with graphs off) it
  calls `decode` eagerly, which is what the CPU tests check against the model's own forward.

Only plain decoder stacks are supported (`supported()`): Llama (llama3 rope scaling included: the model's own
rotary module computes the frequencies), Qwen2 and Qwen3 (its per-head q/k RMSNorm) with full attention. Everything
else keeps the engine's dynamic-cache path, and asking for the static path names what it lacks. A runner captures
raw device pointers of the parameters, so it holds references to the tensors it was captured with; the engine drops
its runners whenever parameter storage moves (flattening, weight release) and in-place weight updates keep them
valid.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import HFCausalLM
from services.rollout.engines.engine_errors import EngineUnavailable

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE as GraphPool  # what torch.cuda.graph_pool_handle() returns
from services.tensors.sampling_dist import sampling_log_probs

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
QK_NORM_TYPES = ("qwen3",)  # RMSNorm over each head's query and key before rotary
# Rotary types whose frequencies the model recomputes from the sequence length at run time (a static step cannot)
DYNAMIC_ROPE = ("dynamic", "longrope")


def supported(model: HFCausalLM) -> str | None:
    """None when `model` can use the static path, else why not (one line naming what it does not support)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model type {cfg.model_type!r} (static decode knows {', '.join(SUPPORTED_TYPES)})"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "sliding-window layers"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in DYNAMIC_ROPE:
        return f"rope type {rope!r} (its frequencies follow the sequence length)"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "an unexpected module structure"
    attn = inner.layers[0].self_attn
    if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
        return "an unexpected attention module"
    has_qk_norm = all(hasattr(attn, a) for a in ("q_norm", "k_norm"))
    if has_qk_norm != (cfg.model_type in QK_NORM_TYPES):
        return f"{cfg.model_type} attention {'with' if has_qk_norm else 'without'} q/k norms"
    return None


def sample_race(
    logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like sampling.sample_next, without a host sync: torch.multinomial(p, 1) is the race argmax(p / E),
    E ~ Exp(1), but first checks p on the host; this draws the same race directly. Without top-k / top-p the
    race runs on the logits (argmax(x - log E)) and the chosen token's log-prob is x[t] - logsumexp(x): the
    same distribution and log-probs as sampling_log_probs, without writing the [batch, vocab] log-probs."""
    if plain_sampling(sampling, logits.shape[-1]):
        return race_from_noise(logits, exp_noise(logits, generator), float(sampling.temperature))
    log_probs = sampling_log_probs(logits, sampling)
    if sampling.greedy:
        tokens = torch.argmax(log_probs, dim=-1)
    else:
        noise = torch.empty_like(log_probs).exponential_(generator=generator)
        tokens = torch.argmax(log_probs.exp() / noise, dim=-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def plain_sampling(sampling: SamplingSpec, vocab: int) -> bool:
    """Temperature sampling without top-k / top-p truncation."""
    return not sampling.greedy and not (0 < sampling.top_k < vocab) and sampling.top_p >= 1.0


def exp_noise(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator)


def race_from_noise(logits: torch.Tensor, noise: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax(x - log E) with x = logits / temperature, and x[t] - logsumexp(x): pure tensor math, so
    torch.compile fuses it into a couple of passes over the logits."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    lse = torch.logsumexp(x, dim=-1)
    tokens = torch.argmax(x - torch.log(noise), dim=-1)
    return tokens, x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class StaticKV:
    """Per-layer key/value buffers and the mask of filled slots (zeros, so masked slots never hold NaN)."""

    def __init__(
        self,
        *,
        layers: int,
        batch: int,
        length: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (batch, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.valid = torch.zeros((batch, length), dtype=torch.bool, device=device)
        self.batch, self.length = batch, length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def window(self, rows: int, slots: int) -> StaticKV:
        """The first `rows` rows and `slots` slots of this cache, as views (a runner over them reads and writes this
        one)."""
        view = object.__new__(StaticKV)
        view.k, view.v = [t[:rows, :, :slots] for t in self.k], [t[:rows, :, :slots] for t in self.v]
        view.valid, view.batch, view.length = self.valid[:rows, :slots], rows, slots
        return view


WINDOW_GRANULE = 32  # slots: a window's length is a multiple of this, and of about 1/8 of the cache's length


def window_slots(need: int, length: int) -> int:
    """The slots a decode step attends over when every row writes below slot `need`: a multiple of ~1/8 of the
    cache (so a cache has at most ~8 windows, a graph each), never more than `length`. Attention reads every slot
    of its window, so a step early in a long cache costs what its tokens need, not what the longest could."""
    granule = max(WINDOW_GRANULE, -(-length // (8 * WINDOW_GRANULE)) * WINDOW_GRANULE)
    return min(length, -(-need // granule) * granule)


class StaticDecoder:
    """The model's modules, called in a fixed-shape order (see the module docstring)."""

    def __init__(self, model: HFCausalLM):
        why = supported(model)
        if why:
            raise ValueError(f"static decode does not support {why}")
        self.model = model
        self.inner = model.model
        cfg = model.config
        attn = self.inner.layers[0].self_attn
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.groups = self.heads // self.kv_heads
        self.qk_norm = cfg.model_type in QK_NORM_TYPES

    def cache_bytes(self, batch: int, length: int) -> int:
        """What new_cache(batch, length) allocates: keys and values of every layer, and the slot mask."""
        p = self.inner.embed_tokens.weight
        per_slot = 2 * len(self.inner.layers) * self.kv_heads * self.head_dim * p.element_size() + 1
        return batch * length * per_slot

    def new_cache(self, batch: int, length: int) -> StaticKV:
        p = self.inner.embed_tokens.weight
        return StaticKV(
            layers=len(self.inner.layers),
            batch=batch,
            length=length,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=p.dtype,
            device=p.device,
        )

    def _qkv(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = attn.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3: per-head RMSNorm before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def prefill(self, kv: StaticKV, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T] left-padded prompts into slots 0..T-1; returns the last position's logits [B, vocab]."""
        t = ids.shape[1]
        kv.valid.zero_()
        kv.valid[:, :t] = mask.bool()
        h = self._prefill_layers(kv, slice(None), ids, positions, kv.valid[:, :t])
        return self.model.lm_head(self.inner.norm(h[:, -1:]))[:, -1]

    def prefill_rows(self, kv: StaticKV, rows: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[n, T] right-padded sequences (row i's `lengths[i]` tokens first) into cache rows `rows`, slots 0..T-1,
        leaving the other rows as they are (continuous batching); returns each row's last token's logits [n, vocab]."""
        n, t = ids.shape
        real = torch.arange(t, device=ids.device)[None, :] < lengths[:, None]
        kv.valid[rows] = False
        kv.valid[rows, :t] = real
        positions = torch.arange(t, device=ids.device).expand(n, t)
        h = self._prefill_layers(kv, rows, ids, positions, real)
        return self.model.lm_head(self.inner.norm(h[torch.arange(n, device=ids.device), lengths - 1]))

    def _prefill_layers(
        self, kv: StaticKV, rows: torch.Tensor | slice, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor
    ) -> torch.Tensor:
        """The prompt's hidden states [B, T, hidden] (SDPA over its own slots, causal, `real` [B, T] the slots that
        hold a token), writing its keys and values into cache rows `rows`, slots 0..T-1."""
        b, t = ids.shape
        slots = torch.arange(t, device=ids.device)
        causal = slots[None, :] <= slots[:, None]  # [T query, T key]
        allowed = (real[:, None, None, :] & causal) | torch.eye(t, dtype=torch.bool, device=ids.device)
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, positions)
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
            kv.k[i][rows, :, :t] = k
            kv.v[i][rows, :, :t] = v
            if self.groups > 1:
                k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scaling)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def decode(self, kv: StaticKV, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """One token per row ([B] ids at rotary [B] positions) written into each row's cache slot `slot` ([B] long,
        a device tensor so a captured graph can replay it); returns logits [B, vocab]."""
        b = tokens.shape[0]
        kv.valid.scatter_(1, slot[:, None], True)
        hidden = ~kv.valid[:, None, None, :]  # [B, 1, 1, L]: slots without a token
        h = self.inner.embed_tokens(tokens[:, None])
        cos, sin = self.inner.rotary_emb(h, positions[:, None])
        at = slot[:, None, None, None].expand(b, self.kv_heads, 1, self.head_dim)
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
            kv.k[i].scatter_(2, at, k)
            kv.v[i].scatter_(2, at, v)
            # query heads grouped per KV head, the scale folded into the (small) query. The scores stay in the
            # model's dtype, as the matmul rounded them, and are masked in place; softmax accumulates in float32
            # inside its kernel: float32 copies of the [B, heads, L] scores were ~4 extra passes a layer
            q = q.reshape(b, self.kv_heads, self.groups, self.head_dim) * self.scaling
            scores = torch.matmul(q, kv.k[i].transpose(-1, -2)).masked_fill_(hidden, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), kv.v[i])  # [B, kv_heads, groups, head_dim]
            h = h + attn.o_proj(out.reshape(b, 1, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(self.inner.norm(h))[:, 0]


class Runner:
    """One cache of a fixed (batch, length) and its decode step: a CUDA graph replay, or eager. A step runs over a
    view of the cache (`view`): its first rows and slots, a graph each, so it computes the rows in use and attends
    over the slots written so far, not the whole cache."""

    def __init__(
        self,
        decoder: StaticDecoder,
        *,
        batch: int,
        length: int,
        graph: bool,
        pool: GraphPool | None = None,
        decode_fn: Callable[..., torch.Tensor] | None = None,
        view_of: Runner | None = None,
    ):
        """`view_of`: a runner over the first `batch` rows and `length` slots of that one's cache and inputs."""
        self.decoder = decoder
        self.decode_fn = decode_fn or decoder.decode  # torch.compile'd decode in "compile" mode
        self.batch, self.length = batch, length
        self.pool = pool
        self.views: dict[tuple[int, int], Runner] = {}  # on the whole cache's runner: its views by (rows, slots)
        self.windowed = decode_fn is None  # compile mode keeps one shape (it would compile once per view)
        self.kv: StaticKV
        self.tokens: torch.Tensor
        self.positions: torch.Tensor
        self.slot: torch.Tensor
        self._out: torch.Tensor | None = None  # the views' logits, one buffer for all of them (see _capture)
        self._no_view: set[tuple[int, int]] = set()  # views whose capture failed: the whole cache steps instead
        if view_of is not None:
            self.kv = view_of.kv.window(batch, length)
            self.tokens, self.positions = view_of.tokens[:batch], view_of.positions[:batch]
            self.slot = view_of.slot[:batch]
        else:
            self.kv = decoder.new_cache(batch, length)
            device = self.kv.valid.device
            self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
            self.positions = torch.zeros(batch, dtype=torch.long, device=device)
            self.slot = torch.zeros(batch, dtype=torch.long, device=device)  # each row's write slot, in every window
        # the graph reads these storages by address: keep them alive as long as the graph is
        self._params = [p.data for p in decoder.model.parameters()]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if graph:
            self._capture(pool, view_of)

    def _capture(self, pool: GraphPool | None, view_of: Runner | None) -> None:
        device = self.kv.valid.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (and compile) outside the capture
                warm = self.decode_fn(self.kv, self.tokens, self.positions, self.slot)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if view_of is None:
            with torch.cuda.graph(graph, pool=pool):
                self.logits = self.decode_fn(self.kv, self.tokens, self.positions, self.slot)
            self.kv.valid.zero_()  # the warm-up wrote each row's next slot of a fresh cache
        else:
            # a view's logits go to its base's one buffer: what the step made is freed inside the capture, so the
            # pool lends it to the next view's capture (a graph each of ~8 windows x row counts, not a logits each)
            out = view_of.out_like(warm)
            with torch.cuda.graph(graph, pool=pool):
                out[: self.batch].copy_(self.decode_fn(self.kv, self.tokens, self.positions, self.slot))
            self.logits = out[: self.batch]
            # the warm-up and the capture wrote each row's next slot from its current inputs: what the step that
            # wanted this view writes again (a live row), or a free row's slot 0 (cleared when a sample takes it)
        self.graph = graph

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.decoder.prefill(self.kv, ids, positions, mask)

    def current(self) -> bool:
        """The model's parameters still live where this runner captured them (not re-pointed since)."""
        return all(
            p.data_ptr() == q.data_ptr() for p, q in zip(self.decoder.model.parameters(), self._params, strict=True)
        )

    def out_like(self, logits: torch.Tensor) -> torch.Tensor:
        """The views' logits buffer, [batch, vocab] of `logits`' dtype (allocated by the first view)."""
        if self._out is None:
            self._out = logits.new_empty((self.batch, *logits.shape[1:]))
        return self._out

    def view(self, rows: int, slots: int) -> Runner:
        """The runner over this cache's first `rows` rows and `slots` slots (made once, a graph on a GPU); this one
        for the whole cache, in compile mode, or when capturing a view fails. Its inputs must be set first: the
        capture's warm-up steps them."""
        key = (rows, slots)
        if key == (self.batch, self.length) or not self.windowed or key in self._no_view:
            return self
        found = self.views.get(key)
        if found is None:
            try:
                found = Runner(
                    self.decoder, batch=rows, length=slots, graph=self.graph is not None, pool=self.pool, view_of=self
                )
            except Exception:
                log.exception(
                    "CUDA graph capture over %d rows x %d slots failed; stepping the whole cache", rows, slots
                )
                self._no_view.add(key)  # not self in `views`: that cycle would hold the cache past a drop
                return self
            self.views[key] = found
        return found

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """Every row writes slot `slot`; rows beyond tokens.shape[0] (batch padding) keep their previous inputs;
        returns [batch, vocab]."""
        n = tokens.shape[0]
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.slot.fill_(slot)
        return self.view(self.batch, window_slots(slot + 1, self.length))._run()

    def prefill_rows(self, rows: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded sequences into cache rows `rows` (the others untouched); the rows' next slot is their length."""
        logits = self.decoder.prefill_rows(self.kv, rows, ids, lengths)
        self.slot[rows] = lengths
        return logits

    def step_rows(
        self, rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *, first_rows: int, below_slot: int
    ) -> torch.Tensor:
        """Rows `rows` feed `tokens` at rotary `positions`, each into its own next slot, which then moves on. The
        step runs over the cache's first `first_rows` rows (the others in it compute too, their results unread)
        and every row in them must write below slot `below_slot` (free rows write slot 0: `free_rows`). Returns
        the rows' logits [len(rows), vocab]."""
        self.tokens[rows] = tokens
        self.positions[rows] = positions
        logits = self.view(first_rows, window_slots(below_slot, self.length))._run()[rows]
        self.slot[rows] = (self.slot[rows] + 1).clamp(max=self.length - 1)  # a finished row may linger a few steps
        return logits

    def free_rows(self, rows: torch.Tensor) -> None:
        """Rows no sample holds write slot 0 (inside every window) until a sample takes them."""
        self.slot[rows] = 0

    def take_rows_from(self, other: Runner) -> None:
        """Every row's keys, values and next slot from a shorter runner of the same batch (the cache grew)."""
        n = other.length
        for mine, theirs in zip(self.kv.k + self.kv.v, other.kv.k + other.kv.v, strict=True):
            mine[:, :, :n].copy_(theirs)
        self.kv.valid.zero_()
        self.kv.valid[:, :n].copy_(other.kv.valid)
        self.slot.copy_(other.slot)

    def _run(self) -> torch.Tensor:
        if self.graph is None:
            return self.decoder.decode(self.kv, self.tokens, self.positions, self.slot)
        self.graph.replay()
        assert self.logits is not None
        return self.logits


class RunnerCache:
    """The engine's runners by (batch, length) bucket, least recently used dropped beyond `keep`."""

    def __init__(self, model: HFCausalLM, *, graphs: bool, compile: bool = False, keep: int = 2):
        self.decoder = StaticDecoder(model)
        self.graphs = graphs
        self.keep = keep
        self._runners: dict[tuple[int, int], Runner] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        # inductor fuses the norms, rotary and softmax into a few kernels a layer; the graph then replays those
        self._compiled = torch.compile(self.decoder.decode, dynamic=False) if compile and graphs else None
        self._sampler = torch.compile(race_from_noise, dynamic=False) if compile and graphs else None

    def sample(
        self, logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """sample_race; in "compile" mode plain temperature sampling runs fused (same noise, same math)."""
        if self._sampler is None or not plain_sampling(sampling, logits.shape[-1]):
            return sample_race(logits, sampling, generator)
        noise = exp_noise(logits, generator)
        try:
            return self._sampler(logits, noise, float(sampling.temperature))
        except Exception:
            log.exception("torch.compile of the sampler failed; sampling eagerly")
            self._sampler = None
            return race_from_noise(logits, noise, float(sampling.temperature))

    @staticmethod
    def bucket(batch: int, length: int) -> tuple[int, int]:
        b = 1
        while b < batch:
            b *= 2
        return b, -(-length // 128) * 128

    def get(self, batch: int, length: int) -> Runner:
        key = self.bucket(batch, length)
        runner = self._runners.pop(key, None)
        if runner is None:
            while len(self._runners) >= self.keep:
                self._runners.pop(next(iter(self._runners)))
            runner = self._new_runner(*key)
        self._runners[key] = runner  # most recently used last
        return runner

    def _new_runner(self, batch: int, length: int) -> Runner:
        check_cache_fits(self.decoder, batch, length)
        if self._compiled is not None:
            try:
                return Runner(
                    self.decoder, batch=batch, length=length, graph=True, pool=self._pool, decode_fn=self._compiled
                )
            except Exception:
                log.exception(
                    "torch.compile of the decode step failed (batch %d, length %d); "
                    "continuing with the eager step in a CUDA graph",
                    batch,
                    length,
                )
                self._compiled = None
        if self.graphs:
            try:
                return Runner(self.decoder, batch=batch, length=length, graph=True, pool=self._pool)
            except Exception:
                log.exception(
                    "CUDA graph capture of the decode step failed (batch %d, length %d); continuing without graphs",
                    batch,
                    length,
                )
                self.graphs = False
        return Runner(self.decoder, batch=batch, length=length, graph=False)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def clear(self) -> None:
        self._runners.clear()

    def __len__(self) -> int:
        return len(self._runners)


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new tensor may take on `device`: the driver's free memory plus what torch's allocator holds unused;
    None off CUDA (no bound is checked there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_cache_fits(decoder: StaticDecoder, batch: int, length: int) -> None:
    """One clear message, before allocating, when a static cache cannot fit (instead of an out-of-memory error
    from inside a decode step)."""
    device = decoder.inner.embed_tokens.weight.device
    free = free_device_bytes(device)
    need = decoder.cache_bytes(batch, length)
    if free is not None and need > free:
        raise EngineUnavailable(
            f"the native engine's static KV cache of {batch} rows x {length} slots needs {need / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB is free on {device}: lower rollout.max_batch_size or the new tokens a sample "
            "may make (rollout.sampling.max_new_tokens, rollout.max_context_length), or set rollout.decode: dynamic"
        )
