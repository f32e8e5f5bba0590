"""What `tandem run` checks before any service starts.

A run that would fail on its inputs fails here, in about a second, with one line naming the config key (or the
file and line / row of a bad prompt: empty, too long for the context with the chat template applied, or one the
template fails on), instead of after every service has loaded its model. Problems that do not stop a run (text the
tokenizer cannot encode, a label key no row has) are returned as warnings.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.contracts import runfacts
from services.contracts.config import ConfigError, TandemConfig
from services.coordinator.data import DataSource, PromptRecord, load_prompts
from services.coordinator.datafiles import data_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.rollout.chat_template import ChatTemplate

log = logging.getLogger("tandem.preflight")

MAX_TOKENIZER_CHECKS = 20000  # prompts and labels looked at for unknown tokens (every prompt's length is checked)
ENCODE_BATCH = 8192  # prompts the tokenizer encodes in one call
BOUND_SAMPLE = 1000  # prompts always encoded, checking the length bound (measure_prompts)
SHOWN_LINES = 5  # line numbers named besides the first offending one


def check_run_inputs(config: TandemConfig, *, init_model: bool = False) -> list[str]:
    """Raises ConfigError for the first input that would stop the run; returns warnings."""
    check_engine(config)
    check_model(config, init_model=init_model)
    check_lora(config)
    records = check_data(config)
    _check_reward(config.rollout.reward)
    if config.rollout.eval_reward:
        _check_reward(config.rollout.eval_reward)
    _check_reward_models(config)
    _check_environment(config.rollout.environment)
    _check_agents(config)
    from services.rollout.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path)
    check_teacher(config, tokenizer)
    prompts = model_prompts(config, records, tokenizer)
    check_prompt_lengths(config, records, prompts)
    return unencodable_text(config, records, prompts, tokenizer) + missing_labels(config, records)


@dataclass(frozen=True)
class PromptLimit:
    tokens: int  # the most a prompt of this data file may have
    why: str  # where that number comes from, for the message


def prompt_limit(config: TandemConfig, key: str) -> PromptLimit:
    """The context (runfacts.context_length) minus the max_new_tokens of the data file's sampling."""
    context = runfacts.context_length(
        configured=config.rollout.max_context_length, model_positions=runfacts.model_positions(config.model.path)
    )
    context_from = (
        "rollout.max_context_length"
        if config.rollout.max_context_length and context == config.rollout.max_context_length
        else "the model's max_position_embeddings"
    )
    sampling, sampling_key = (
        (config.rollout.eval_sampling, "rollout.eval_sampling")
        if key == "data.eval_path"
        else (config.rollout.sampling, "rollout.sampling")
    )
    return PromptLimit(
        tokens=context - sampling.max_new_tokens,
        why=f"a context of {context} tokens, from {context_from}, minus {sampling_key}.max_new_tokens "
        f"{sampling.max_new_tokens}",
    )


@dataclass(frozen=True)
class ModelPrompts:
    """A data file's prompts as the model reads them (the chat template applied), and how many tokens each has."""

    texts: list[str]
    lengths: list[int]  # exact for the encoded rows; for the others a bound within the limit
    ids: dict[int, list[int]]  # the encoded rows: the first ones, and every one a bound does not show fits


def model_prompts(
    config: TandemConfig, records: dict[str, list[PromptRecord]], tokenizer: PreTrainedTokenizerBase
) -> dict[str, ModelPrompts]:
    """Every prompt of every data file through the rollout's own path (rendered, then encoded where its length is
    not known to fit: measure_prompts); ConfigError naming the file and line / row of a prompt the chat template
    fails on."""
    from services.rollout.chat_template import ChatTemplate, ChatTemplateError

    # the unknown-token scan reads the first MAX_TOKENIZER_CHECKS prompts' ids; else a sample checks the bound
    exact = MAX_TOKENIZER_CHECKS if tokenizer.unk_token_id is not None else BOUND_SAMPLE
    try:
        chat = ChatTemplate.from_config(tokenizer, config)
        out = {}
        for key, rows in records.items():
            try:
                texts = render_prompts(chat, rows)
            except ChatTemplateError as exc:
                if exc.index is None:
                    raise
                path = getattr(config.data, key.split(".")[1])
                raise ConfigError(f"{key}: {data_file(path).where(rows[exc.index].line)}: {exc}") from None
            out[key] = measure_prompts(
                tokenizer, texts, [bool(r.messages) for r in rows], limit=prompt_limit(config, key).tokens, exact=exact
            )
    except ChatTemplateError as exc:
        raise ConfigError(str(exc)) from None
    return out


def render_prompts(chat: ChatTemplate, rows: list[PromptRecord]) -> list[str]:
    """Every prompt's text as the rollout renders it, ENCODE_BATCH at a time (~50k chats a second).
    ChatTemplateError.index: the row of `rows` the template failed on."""
    from services.rollout.chat_template import ChatTemplateError
    from services.rollout.tokenizer import prompt_texts

    texts: list[str] = []
    for start in range(0, len(rows), ENCODE_BATCH):
        try:
            texts += prompt_texts(chat, rows[start : start + ENCODE_BATCH])
        except ChatTemplateError as exc:
            raise ChatTemplateError(str(exc), index=None if exc.index is None else start + exc.index) from None
    return texts


def measure_prompts(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], chats: list[bool], *, limit: int, exact: int
) -> ModelPrompts:
    """Token counts of every prompt, encoding (ENCODE_BATCH at a time, as the rollout does) only the first `exact`
    prompts and those whose length bound (tokenizer.length_bounds) exceeds `limit`: the others fit for certain.
    Encoding is ~100 µs a prompt, nearly all of preflight's time on a 100k-row file. Should an encoded prompt
    exceed its bound (a tokenizer the bound does not know), every prompt is encoded."""
    from services.rollout.tokenizer import encode_prompt_texts, length_bounds

    bounds = length_bounds(tokenizer, texts, chats)
    ids: dict[int, list[int]] = {}

    def encode(rows: list[int]) -> None:
        for start in range(0, len(rows), ENCODE_BATCH):
            chunk = rows[start : start + ENCODE_BATCH]
            ids.update(
                zip(
                    chunk,
                    encode_prompt_texts(tokenizer, [texts[i] for i in chunk], [chats[i] for i in chunk]),
                    strict=True,
                )
            )

    encode(sorted(set(range(min(exact, len(texts)))) | {i for i, b in enumerate(bounds) if b is None or b > limit}))
    if any(len(row) > bound for i, row in ids.items() if (bound := bounds[i]) is not None):
        encode([i for i in range(len(texts)) if i not in ids])
    lengths = [len(ids[i]) if bound is None or i in ids else bound for i, bound in enumerate(bounds)]
    return ModelPrompts(texts=texts, lengths=lengths, ids=ids)


def _empty(row: PromptRecord) -> bool:
    return not any(m.content.strip() for m in row.messages) if row.messages else not row.text.strip()


def check_prompt_lengths(
    config: TandemConfig, records: dict[str, list[PromptRecord]], prompts: dict[str, ModelPrompts]
) -> None:
    """ConfigError naming file:line (or file: row) of the first prompt that is empty or leaves no room for
    max_new_tokens in the context (runfacts.context_length), with the limits and how many more are like it."""
    for key, rows in records.items():
        limit = prompt_limit(config, key)
        bad = [
            (row, length)
            for row, length in zip(rows, prompts[key].lengths, strict=True)
            if length > limit.tokens or _empty(row)
        ]
        if not bad:
            continue
        first, tokens = bad[0]
        templated = " with the chat template applied" if first.messages else ""
        if _empty(first):
            problem = "the prompt is empty"
        else:
            problem = (
                f"the prompt has {tokens} tokens{templated}, more than the {limit.tokens} a prompt may have "
                f"({limit.why})"
            )
        file = data_file(getattr(config.data, key.split(".")[1]))
        raise ConfigError(
            f"{key}: {file.where(first.line)}: {problem}{_others([row.line for row, _ in bad[1:]], unit=file.unit)}"
        )


def _others(lines: list[int], *, unit: str) -> str:
    if not lines:
        return ""
    shown = ", ".join(str(n) for n in lines[:SHOWN_LINES]) + (", …" if len(lines) > SHOWN_LINES else "")
    return f"; {len(lines)} more {unit}{'s' if len(lines) > 1 else ''} empty or too long ({unit} {shown})"


def check_engine(config: TandemConfig) -> None:
    """Settings the rollout engine cannot honour, one line each (SGLang would fail them after its 70-130 s start,
    or silently report other log-probs)."""
    if config.rollout.engine != "sglang":
        return
    import os

    from services.rollout.engines.sglang.http import is_loopback
    from services.rollout.engines.sglang.launch import launch_problems
    from services.rollout.engines.sglang.protocol import inflight_refusal

    problems = []
    if config.weights.check_weight_update_equal:
        problems.append(
            "weights.check_weight_update_equal: not supported with rollout.engine sglang (SGLang exposes "
            "no bit-exact checksums of the tensors it loaded: its /weights_checker hashes its own, "
            "possibly fused ones); set it to false"
        )
    if config.weights.transport == "cuda_ipc":
        remote = [u for u in config.rollout.sglang.urls if not is_loopback(u)]
        if remote:
            problems.append(
                f"weights.transport: cuda_ipc needs SGLang on the trainer's host (CUDA IPC handles open "
                f"only there), and rollout.sglang.urls names {', '.join(remote)}; use nccl or disk"
            )
        if config.trainer.device == "cpu":
            problems.append("weights.transport: cuda_ipc needs the trainer on a GPU (trainer.device is cpu)")
    problems += launch_problems(tuple(config.rollout.sglang.launch_args), dict(os.environ))
    if not config.rollout.sglang.urls:  # servers the user runs are checked when the engine connects
        launch = config.rollout.sglang.launch_args
        refusal = inflight_refusal(
            config.rollout.inflight_update,
            radix_cache_off="--disable-radix-cache" in launch,
            where="the SGLang server rollout.sglang.launch_args start",
        )
        problems += [refusal] if refusal else []
    if problems:
        raise ConfigError("\n".join(problems))


def check_data(config: TandemConfig) -> dict[str, list[PromptRecord]]:
    """The data files load, and one step's batch fits the training set."""
    train = _load("data.train_path", config.data.train_path, config)
    try:
        DataSource(train, batch_size=config.rollout.rollout_batch_size, shuffle=False, seed=0, num_epochs=1)
    except ValueError as exc:
        raise ConfigError(f"{exc} (data.train_path {config.data.train_path})") from None
    records = {"data.train_path": train}
    if config.data.eval_path:
        records["data.eval_path"] = _load("data.eval_path", config.data.eval_path, config)
    return records


def check_model(config: TandemConfig, *, init_model: bool) -> None:
    """model.path must hold a model; a random one is built there only when asked (`--init-model`)."""
    path = Path(config.model.path)
    if (path / "config.json").is_file():
        return
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    if not init_model:
        hint = _near_miss(path)
        raise ConfigError(
            f"model.path: {path} holds no model{hint}; point model.path at a Hugging Face model "
            f"directory, build a random-init one with `tandem init-model {path}`, or pass "
            "--init-model to `tandem run`"
        )
    from services.modelinit.init_model import init_model as build

    preset, body = config.model.init_preset or "tiny", config.model.init_body
    log.warning(
        "--init-model: building a random-init %s model%s at %s", preset, f" ({body} body)" if body else "", path
    )
    build(path, preset=preset, body=body)


def check_teacher(config: TandemConfig, student: PreTrainedTokenizerBase) -> None:
    """algorithm.distillation's teacher is a model whose tokenizer is the student's: it scores the student's token
    ids, so another tokenizer would read them as other text."""
    distill = config.algorithm.distillation
    if distill is None:
        return
    from services.contracts.algorithm_config import TEACHER_KEY
    from services.rollout.tokenizer import load_tokenizer, tokenizer_mismatch

    try:
        distill.check_teacher_dir()
        teacher = load_tokenizer(distill.teacher_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc) if str(exc).startswith(TEACHER_KEY) else f"{TEACHER_KEY}: {exc}") from None
    problem = tokenizer_mismatch(student, teacher)
    if problem:
        raise ConfigError(
            f"{TEACHER_KEY}: the teacher at {distill.teacher_path} does not share the student's tokenizer "
            f"({config.model.tokenizer_path or config.model.path}): {problem}; distil from a teacher of the same "
            "tokenizer (a model of the same family)"
        )


def check_lora(config: TandemConfig) -> None:
    """trainer.lora's target_modules name linear layers of the model (and of the critic's backbone)."""
    lora = config.trainer.lora
    if lora is None:
        return
    from services.trainer.model.lora import check_model_targets

    for critic in (False, True) if config.algorithm.uses_critic else (False,):
        check_model_targets(config.model.path, lora, critic=critic)


def already_finished(config: TandemConfig, *, run_dir: Path) -> str | None:
    """The message to exit with when run_dir's latest checkpoint is of the run's last step (the coordinator
    checks the same after loading it, for deployments without `tandem run`)."""
    from services.contracts.checkpoints import STATE, latest_checkpoint, read_json
    from services.coordinator.state import RunState

    latest = latest_checkpoint(config, run_dir=run_dir)
    if latest is None:
        return None
    try:
        saved = RunState.from_json(read_json(latest / STATE)["extra_state"]["coordinator"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a checkpoint of a run: the trainer's Load decides what it is
    total = runfacts.num_rollout(config, dataset_size=len(_load("data.train_path", config.data.train_path, config)))
    if not runfacts.is_finished(next_rollout_id=saved.next_rollout_id, num_rollout=total):
        return None
    return runfacts.finished_message(done=saved.next_rollout_id, num_rollout=total, checkpoint=str(latest))


def _near_miss(path: Path) -> str:
    """' (did you mean X?)' when a sibling directory with a similar name holds a model: the usual typo."""
    parent = path.parent
    if not parent.is_dir():
        return f" ({parent} does not exist either)"
    models = [p.name for p in parent.iterdir() if (p / "config.json").is_file()]
    close = difflib.get_close_matches(path.name, models, n=1, cutoff=0.6)
    return f" (did you mean {parent / close[0]}?)" if close else ""


def _load(key: str, path: str, config: TandemConfig) -> list[PromptRecord]:
    try:
        return load_prompts(path, config.data)
    except (OSError, ValueError) as exc:  # missing, unreadable, of no known format, empty, or a bad row
        raise ConfigError(f"{key}: {exc}") from None


def _check_reward(spec: str) -> None:
    from services.rollout.reward_mix import check_rule_terms
    from services.rollout.rewards import RewardSpecError

    try:
        check_rule_terms(spec)
    except RewardSpecError as exc:
        raise ConfigError(f"rollout.reward: {exc}") from None


def _check_reward_models(config: TandemConfig) -> None:
    """Each model of reward.models is a model directory (the reward service loads them; this fails before it starts)."""
    for name, model in (config.reward.models if config.reward is not None else {}).items():
        if not (Path(model.path) / "config.json").is_file():
            what = "does not exist" if not Path(model.path).exists() else "has no config.json"
            raise ConfigError(
                f"reward.models.{name}.path {model.path} {what} (build one with `tandem init-model` or train one: "
                "docs/rewards.md)"
            )


def _check_environment(spec: str | None) -> None:
    if not spec:
        return
    from services.rollout.environment_registry import resolve_environment
    from services.rollout.environments import EnvironmentSpecError

    try:
        resolve_environment(spec)
    except EnvironmentSpecError as exc:
        raise ConfigError(f"rollout.environment: {exc}") from None


def _check_agents(config: TandemConfig) -> None:
    from services.rollout.agents.checks import check_agents

    try:
        check_agents(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def unencodable_text(
    config: TandemConfig,
    records: dict[str, list[PromptRecord]],
    prompts: dict[str, ModelPrompts],
    tokenizer: PreTrainedTokenizerBase,
) -> list[str]:
    """One warning per data file whose prompts or labels hold text the tokenizer maps to its unknown token:
    the model can never read (or, for labels, write) it, which looks like a run that does not learn."""
    unk = tokenizer.unk_token_id
    if unk is None:  # byte-level tokenizers encode everything
        return []
    warnings = []
    for key, all_rows in records.items():
        rows = all_rows[:MAX_TOKENIZER_CHECKS]
        labels = [r.label for r in rows]
        for field, texts, encoded in (
            ("prompt", prompts[key].texts[:MAX_TOKENIZER_CHECKS], [prompts[key].ids[i] for i in range(len(rows))]),
            ("label", labels, tokenizer(labels, add_special_tokens=False)["input_ids"]),
        ):
            bad = [i for i, ids in enumerate(encoded) if unk in ids]
            if bad:
                warnings.append(
                    f"{key}: {len(bad)} of {len(rows)} {field}s hold text the tokenizer of "
                    f"{config.model.tokenizer_path or config.model.path} cannot encode (it becomes "
                    f"{tokenizer.unk_token}); the first: {texts[bad[0]]!r}"
                )
    return warnings


def missing_labels(config: TandemConfig, records: dict[str, list[PromptRecord]]) -> list[str]:
    """A warning per data file where no row has data.label_key: a typo there gives every reward an empty label."""
    return [
        f"{key}: every label is empty (no row has a value at data.label_key {config.data.label_key!r})"
        for key, rows in records.items()
        if not any(r.label for r in rows)
    ]
