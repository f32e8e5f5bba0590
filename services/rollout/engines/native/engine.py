"""The `native` engine: a Hugging Face causal LM driven by a batched, KV-cached sampling loop in torch.

Runs anywhere torch runs (CPU in CI, one GPU for real work). Prompts are left-padded into one batch.
Two decode paths (`decode=`):
- "dynamic": the model's own forward with a Hugging Face DynamicCache; finished rows are dropped from the
  batch (and its KV cache) as they finish, so short answers do not pay for long ones. The CPU default.
- "graph" (the CUDA default for Llama/Qwen2/Qwen3) / "compile" / "static": a preallocated KV cache of a fixed
  (batch, length) bucket and, for "graph", a CUDA-graph-captured decode step (static_decode.py); "compile"
  captures the torch.compile'd step instead (fewer, fused kernels; its first call per bucket compiles);
  sampling stays on the device and the loop checks for finished rows every few tokens. The loops are in decode.py.
Calls are served one at a time, or with `continuous_batching` as one shared batch whose rows pass from finished
samples to waiting ones (continuous.py; on any decode path: row_kv.py keeps the rows in a DynamicCache or in one
static cache whose decode step is the graph replay); a `DecodeGate` (gate.py) implements pause/resume (a weight
update may land between two decode steps: rollout.inflight_update) and keeps weight loads from overlapping a forward
pass. For cuda_ipc weight syncs the parameters are re-pointed once into flat buffers
laid out like the trainer's buckets (`flatten_parameters`), so each later sync is one copy per bucket.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.contracts import runfacts
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.engine_errors import EngineUnavailable
from services.rollout.engines.gate import DecodeGate, check_pause_mode
from services.rollout.engines.interface import (
    Engine,
    SampleOutput,
    WeightLoadStats,
    normalize_memory_tags,
)
from services.rollout.engines.native import kv_rows
from services.rollout.engines.native.continuous import ContinuousBatcher
from services.rollout.engines.native.decode import Hooks, decode_dynamic, decode_static, prepare_chunk
from services.rollout.engines.native.row_kv import DynamicStore, RowStore, StaticStore
from services.rollout.engines.native.sampler import make_generator
from services.rollout.engines.native.static_decode import RunnerCache, supported
from services.rollout.engines.native.stop_strings import Detokenizer, StopStringTables
from services.tensors import fused

if TYPE_CHECKING:
    from services.contracts.weight_plan import WeightSyncPlan
    from services.weights.front_ends import WeightReceiver
    from services.weights.layout import Layout
    from services.weights.transport_base import SyncStats

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DECODE_MODES = ("auto", "dynamic", "static", "graph", "compile")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"rollout.device is {device!r} but CUDA is not available here")
    return dev


def _load_model(
    path: Path, device: torch.device, *, dtype: str, attn_implementation: str, fused_kernels: str
) -> Any:  # a transformers model: its attributes are looked up by name
    """The model of `path` on `device` for inference, with the fused kernels where they apply."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {path} does not exist or has no config.json "
            f"(create one with `tandem init-model {path} --preset tiny`)"
        )
    hf_logging.disable_progress_bar()
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path, dtype=_DTYPES[dtype], attn_implementation=attn_implementation
    )
    model = loaded.to(device).eval()
    model.requires_grad_(False)
    if fused.enabled(fused_kernels, device=device, dtype=_DTYPES[dtype]):
        # the decode step is ~1,000 small kernels; RMSNorm is 8 of them 49 times in a 0.5B model
        fused.patch_model(model)
        fused.warm_up(model, device)
    return model


class NativeEngine(Engine):
    name = "native"

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        max_batch_size: int = 512,
        max_context_length: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        decode: str = "auto",
        fused_kernels: str = "off",
        continuous_batching: bool = False,
        detokenizer: Detokenizer | None = None,
    ):
        """`eos_token_ids`: the ids that end a sample (default: the model's config and generation config);
        `detokenizer`: the run's tokenizer, needed by requests with stop strings (stop_strings.py)."""
        self._model_path = str(model_path)
        self.device = resolve_device(device)
        self.model = _load_model(
            Path(model_path),
            self.device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            fused_kernels=fused_kernels,
        )
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self._max_context = runfacts.context_length(
            configured=max_context_length, model_positions=getattr(cfg, "max_position_embeddings", None)
        )
        self.max_batch_size = max_batch_size
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else _eos_ids(self.model)
        self.pad_token_id = _pad_id(self.model, self.eos_token_ids)
        self._stop_tables = (
            StopStringTables(detokenizer, vocab_size=self.vocab_size, device=self.device)
            if detokenizer is not None
            else None
        )
        self._gate: DecodeGate = DecodeGate(engine="rollout engine", shared=continuous_batching)
        self._version = 0
        self._generated = 0
        self._released: set[str] = set()
        self._params_without_values: set[str] = set()  # after release_memory("weights") on CPU
        self._offloaded: dict[str, tuple[torch.device, torch.Size]] = {}  # released weights: where, what shape
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns); 5.1x knows only the old.
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        self.decode_mode = self._resolve_decode(decode)
        self._runners: RunnerCache | None = None  # static/graph decode: caches (and graphs) by bucket
        self._row_store: StaticStore | None = None  # continuous batching's rows on the static path
        self._batcher = self._continuous_batcher() if continuous_batching else None
        # after flatten_parameters: (layout key, FlatParams of every parameter, or None when some slot of the
        # layout is not one of ours: then a receive plans its copies per tensor)
        self._flat: tuple[Any, Any] | None = None

    def _continuous_batcher(self) -> ContinuousBatcher:
        store: RowStore
        if self.decode_mode == "dynamic":
            from transformers import DynamicCache

            probe = DynamicCache(config=self.model.config)
            why = kv_rows.check_supported(probe) if probe.layers else None
            if why:
                raise ValueError(f"continuous batching does not support this model: {why}")
            store = DynamicStore(self._forward, lambda: DynamicCache(config=self.model.config))
        else:  # the static cache's rows, stepped by the decode step (a CUDA graph replay on a GPU)
            self._row_store = store = StaticStore(self._runner_cache, max_rows=self.max_batch_size, device=self.device)
        return ContinuousBatcher(
            store=store,
            hooks=self._hooks(),
            device=self.device,
            max_rows=self.max_batch_size,
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            max_context=self._max_context,
            stop_tables=self._stop_tables,
        )

    def _hooks(self) -> Hooks:
        return Hooks(boundary=self._gate.boundary, version=lambda: self._version)

    def _resolve_decode(self, decode: str) -> str:
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
        why = supported(self.model)
        if decode == "auto":
            if self.device.type == "cuda" and why is None:
                return "graph"
            if self.device.type == "cuda":
                log.info(
                    "native engine: decoding with the dynamic cache, without CUDA graphs: the static decode "
                    "path does not support %s",
                    why,
                )
            return "dynamic"
        if decode in ("static", "graph", "compile") and why is not None:
            raise ValueError(f"decode={decode!r}: the static decode path does not support {why}")
        if decode in ("graph", "compile") and self.device.type != "cuda":
            raise ValueError(f"decode={decode!r} needs a CUDA device (use 'static' for the same path without graphs)")
        return decode

    def _drop_runners(self) -> None:
        """Parameter storage moved (or memory is being released): captured graphs point at the old one."""
        if self._runners is not None:
            self._runners.clear()
        self._runners = None
        if self._row_store is not None:
            self._row_store.drop()

    def _runner_cache(self) -> RunnerCache:
        if self._runners is None:
            self._runners = RunnerCache(
                self.model, graphs=self.decode_mode in ("graph", "compile"), compile=self.decode_mode == "compile"
            )
        return self._runners

    # ---- properties --------------------------------------------------------------------------------

    @property
    def model_path(self) -> str:
        return self._model_path

    @property
    def device_label(self) -> str:
        return str(self.device)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under every name it has (tied weights appear under each), for receivers that
        copy in place."""
        return dict(self.model.named_parameters(remove_duplicate=False))

    # ---- generation --------------------------------------------------------------------------------

    def validate_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        super().validate_prompts(prompts)
        for i, prompt in enumerate(prompts):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary (size {self.vocab_size})")

    def _generate_admitted(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, budgets: Sequence[int]
    ) -> list[SampleOutput]:
        self._check_servable()
        if sampling.stop and self._stop_tables is None:
            raise ValueError(
                "sampling.stop: this native engine was built without the tokenizer (detokenizer=), "
                "which stop strings are matched with"
            )
        if self._batcher is not None:
            return self._generate_shared(prompts, sampling, budgets)
        version = self._version
        generator = make_generator(sampling.seed, self.device)
        out: list[SampleOutput] = []
        with torch.inference_mode():
            for start in range(0, len(prompts), self.max_batch_size):
                end = start + self.max_batch_size
                out += self._generate_chunk(prompts[start:end], sampling, generator, version, budgets[start:end])
        self._generated += len(out)
        return out

    def _generate_shared(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, budgets: Sequence[int]
    ) -> list[SampleOutput]:
        """Continuous batching: the samples join the shared batch; this call steps it in its turns until they are
        done (continuous.py)."""
        assert self._batcher is not None
        ticket = self._batcher.submit(prompts, sampling, budgets=budgets, version=self._version)
        out = self._batcher.serve(ticket, self._computing)
        self._generated += len(out)
        return out

    @contextlib.contextmanager
    def _computing(self) -> Iterator[None]:
        with self._gate.computing(), torch.inference_mode():
            self._check_servable()
            yield

    def _check_servable(self) -> None:
        if self._released:
            raise EngineUnavailable(
                f"rollout engine memory is released ({', '.join(sorted(self._released))}); call ResumeMemory first"
            )
        if self._params_without_values:
            raise EngineUnavailable(
                f"{len(self._params_without_values)} parameters have no values since "
                "release_memory('weights'); load or receive weights first"
            )

    def _generate_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSpec,
        generator: torch.Generator | None,
        version: int,
        budgets: Sequence[int],
    ) -> list[SampleOutput]:
        chunk = prepare_chunk(
            prompts,
            sampling,
            device=self.device,
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            max_context=self._max_context,
            budgets=budgets,
        )
        stops = self._stop_tables.for_request(sampling.stop) if sampling.stop and self._stop_tables else None
        hooks = self._hooks()
        if self.decode_mode == "dynamic":
            from transformers import DynamicCache

            decoded = decode_dynamic(
                chunk,
                sampling,
                generator,
                forward=self._forward,
                hooks=hooks,
                new_cache=lambda: DynamicCache(config=self.model.config),
                stops=stops,
            )
        else:
            # the runners are passed on: a weight update while parked may drop self._runners
            decoded = decode_static(chunk, sampling, generator, runners=self._runner_cache(), hooks=hooks, stops=stops)
        return decoded.samples(version)

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :]

    # ---- weights -----------------------------------------------------------------------------------

    def update_weights_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None
    ) -> WeightLoadStats:
        start = time.monotonic()
        count = nbytes = 0
        # A failure part-way leaves a mix of old and new tensors under the old version: load again.
        with self._gate.exclusive(), torch.no_grad():
            self._check_weights_resident()
            targets = self._weight_targets()
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    raise KeyError(f"weight {name!r} is not a parameter or buffer of the model")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"weight {name!r}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                self._params_without_values.discard(name)
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
            if version is not None:
                self._version = int(version)
        return WeightLoadStats(version=self._version, tensors=count, bytes=nbytes, seconds=time.monotonic() - start)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], *, version: int) -> WeightLoadStats:
        """A full update: every parameter must be present (aliases of tied weights may be omitted)."""
        missing = [n for n, p in self.model.named_parameters() if n not in state_dict]
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
        return self.update_weights_from_tensors(state_dict.items(), version=version)

    def update_weights_from_disk(self, path: str | Path, *, version: int) -> WeightLoadStats:
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f), device="cpu"))
        return self.load_state_dict(state, version=version)

    @property
    def compute_device(self) -> torch.device:
        return self.device

    def receive_weights(self, plan: WeightSyncPlan, *, rank_offset: int, receiver: WeightReceiver) -> SyncStats:
        with self._gate.exclusive():
            self._check_weights_resident()
            if plan.transport == "cuda_ipc" and self.device.type == "cuda":
                from services.weights.layout import layout_from_plan

                self.flatten_parameters(layout_from_plan(plan))
            params = (
                self._flat[1]
                if self._flat is not None and self._flat[1] is not None
                else {n: p.data for n, p in self.named_parameters().items()}
            )
            stats = receiver.receive(plan, rank_offset, params)
            names = {m.name for b in plan.buckets for m in b.tensors}
            self._params_without_values -= names
            self._version = int(plan.version)
        return stats

    def flatten_parameters(self, layout: Layout) -> int:
        """Re-point every parameter the layout names (same dtype and shape) to a view of one flat buffer laid
        out like the trainer's buckets (cuda_ipc.flat_views), so a cuda_ipc receive copies each bucket with
        one copy. Values are kept. Idempotent for the same layout; returns how many parameters moved.
        Call it where no forward pass runs (receive_weights does, under the gate)."""
        from services.weights.transports.cuda_ipc import FlatParams, flat_views

        if self._flat is not None and self._flat[0] == layout.key:
            return 0
        params = self.named_parameters()
        by_name = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
        wanted = [
            s
            for s in layout.order
            if s.name in params and params[s.name].dtype == s.dtype and tuple(params[s.name].shape) == s.shape
        ]
        flat, views = flat_views(layout, self.device, names={s.name for s in wanted})
        moved, seen = 0, set()
        with torch.no_grad():
            for slot in wanted:
                param = by_name[slot.name]
                if id(param) in seen:  # a tied weight named twice: it lives in its first slot
                    continue
                seen.add(id(param))
                views[slot.name].copy_(param.data)
                param.data = views[slot.name]
                moved += 1
        complete = len(wanted) == len(layout.order)
        self._flat = (
            layout.key,
            FlatParams({n: p.data for n, p in self.named_parameters().items()}, flat=flat, layout_key=layout.key)
            if complete
            else None,
        )
        self._drop_runners()
        return moved

    def _check_weights_resident(self) -> None:
        if "weights" in self._released:
            raise EngineUnavailable("rollout engine weights are released; call ResumeMemory before loading weights")

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        targets = {n: p.data for n, p in self.named_parameters().items()}
        for n, b in self.model.named_buffers():
            targets.setdefault(n, b)
        return targets

    # ---- pause / memory / state --------------------------------------------------------------------

    def pause(self, mode: str = "drain", *, timeout_s: float | None = None) -> None:
        self._gate.pause(check_pause_mode(mode), timeout_s)

    def resume(self) -> None:
        self._gate.open()

    def release_memory(self, tags: Sequence[str] = ()) -> None:
        tags = normalize_memory_tags(tags)
        with self._gate.exclusive():
            before = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
            if "weights" in tags and "weights" not in self._released:
                self._release_weights()
            # Static caches and CUDA graphs live in the runners (dropped here: any release frees them); the
            # dynamic KV cache lives only inside a generate call. Then the allocator's cached blocks go back.
            self._drop_runners()
            self._released.update(tags)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                self._freed_bytes = max(0, before - torch.cuda.memory_reserved(self.device))

    def _release_weights(self) -> None:
        # On a GPU the weights move to host memory (kept); on CPU there is nowhere cheaper to put them,
        # so their storage is freed (an empty tensor keeps the Parameter object and its name) and they
        # must be loaded again before the next generate.
        for name, p in self.model.named_parameters():
            self._offloaded[name] = (p.device, p.shape)
            p.data = p.data.to("cpu") if self.device.type == "cuda" else torch.empty(0, dtype=p.dtype)
        self._flat = None  # the flat buffer goes with them; the next cuda_ipc receive flattens again

    def resume_memory(self, tags: Sequence[str] = ()) -> None:
        tags = normalize_memory_tags(tags)
        with self._gate.exclusive():
            if "weights" in tags and "weights" in self._released:
                for name, p in self.model.named_parameters():
                    device, shape = self._offloaded[name]
                    if self.device.type == "cuda":
                        p.data = p.data.to(device)
                    else:
                        p.data = torch.empty(shape, dtype=p.dtype, device=device)
                        self._params_without_values.add(name)
                self._offloaded.clear()
                self._drop_runners()
            self._released.difference_update(tags)

    def close(self) -> None:
        self._drop_runners()
        self._flat = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _eos_ids(model: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def _pad_id(model: Any, eos: tuple[int, ...]) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None and model.generation_config is not None:
        pad = model.generation_config.pad_token_id
    return int(pad) if pad is not None else (eos[0] if eos else 0)
