"""What the endpoint does with a checked request (requests.py): its prompt's token ids (reusing an episode's
generated ids, episodes.py), the sampling distribution, one batched engine call (batcher.py), tool calls read from
the text (tool_calls.py), the turn recorded in its episode, and the answer in OpenAI's shape. The HTTP edge is
app.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import JsonObject, JsonValue
from services.rollout.agents.batcher import EngineBatcher
from services.rollout.agents.episodes import Episode, EpisodeError, EpisodeStore, template_message
from services.rollout.agents.requests import ChatRequest, CompletionRequest, Params, Refused
from services.rollout.agents.tool_calls import ToolParser
from services.rollout.chat_template import ChatTemplateError
from services.rollout.engines.interface import FINISH_ABORT, FINISH_LENGTH, Engine, SampleOutput
from services.rollout.tokenizer import Texts


class EngineAborted(RuntimeError):
    """The engine ended the call for a pause(abort): answered 503, the agent may retry."""


@dataclass(frozen=True)
class _Turn:
    prompt_ids: list[int]
    outputs: list[SampleOutput]


class OpenAIEndpoint:
    def __init__(
        self,
        *,
        texts: Texts,
        engine: Engine,
        batcher: EngineBatcher,
        store: EpisodeStore,
        tool_parser: ToolParser,
        default_sampling: SamplingSpec,
    ):
        self.texts = texts
        self.engine = engine
        self.batcher = batcher
        self.store = store
        self.tool_parser = tool_parser
        self.default_sampling = default_sampling  # a free call's defaults (rollout.sampling, unseeded)

    # ---- chat ---------------------------------------------------------------------------------------------------

    async def chat(self, episode_id: str | None, request: ChatRequest) -> JsonObject:
        episode = self._episode(episode_id)
        params = request.params
        sampling = self._sampling(episode, params)
        messages = list(request.messages)
        reused = episode.reused_prefix(messages) if episode is not None else None
        try:
            if reused is not None:
                before, last, new = reused
                continuation = self.texts.continuation_ids(
                    [template_message(m) for m in new],
                    turn=last.token_ids,
                    turn_ended=last.finish_reason != FINISH_LENGTH,
                    tools=list(request.offered_tools) or None,
                )
                prompt = [*before, *last.token_ids, *continuation]
            else:
                prompt = self.texts.chat_ids(
                    [template_message(m) for m in messages], tools=list(request.offered_tools) or None
                )
        except ChatTemplateError as exc:
            raise Refused("messages", str(exc)) from None
        turn = await self._generate(prompt, sampling, params.n)
        choices = []
        for i, out in enumerate(turn.outputs):
            text = self.texts.decode(out.token_ids)
            parsed = self.tool_parser(text, request.tools) if request.tools else None
            message: JsonObject = {"role": "assistant", "content": text}
            finish = out.finish_reason
            if parsed is not None and parsed.tool_calls:
                message = {
                    "role": "assistant",
                    "content": parsed.content or None,
                    "tool_calls": [c.as_openai() for c in parsed.tool_calls],
                }
                finish = "tool_calls"  # as OpenAI reports a turn that called tools
            if episode is not None:
                episode.record(
                    prompt, out, messages=messages, answer=message, answer_text=text, reused=reused is not None
                )
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": {"content": self._token_logprobs(out)} if params.logprobs else None,
                    "token_ids": list(out.token_ids),
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": params.model,
            "choices": choices,
            "usage": _usage(prompt, turn.outputs),
            "prompt_token_ids": prompt,
        }

    # ---- completions --------------------------------------------------------------------------------------------

    async def completion(self, episode_id: str | None, request: CompletionRequest) -> JsonObject:
        episode = self._episode(episode_id)
        params = request.params
        sampling = self._sampling(episode, params)
        prompt_text = ""
        reused = False
        if isinstance(request.prompt, tuple):
            prompt = list(request.prompt)  # token in: used as given
        else:
            prompt_text = request.prompt
            known = episode.reused_text_prefix(prompt_text) if episode is not None else None
            if known is not None:
                before, rest = known
                prompt = [*before, *(self.texts.encode_text(rest) if rest else [])]
                reused = True
            else:
                prompt = self.texts.encode_prompt_text(prompt_text)
        turn = await self._generate(prompt, sampling, params.n)
        choices = []
        for i, out in enumerate(turn.outputs):
            text = self.texts.decode(out.token_ids)
            if episode is not None:
                episode.record(
                    prompt, out, text=prompt_text + text if prompt_text else "", answer_text=text, reused=reused
                )
            logprobs = None
            if params.logprobs:
                logprobs = {
                    "tokens": self._token_texts(out.token_ids),
                    "token_logprobs": list(out.log_probs),
                    "top_logprobs": None,
                    "text_offset": None,
                }
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "finish_reason": out.finish_reason,
                    "logprobs": logprobs,
                    "token_ids": list(out.token_ids),
                }
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": params.model,
            "choices": choices,
            "usage": _usage(prompt, turn.outputs),
            "prompt_token_ids": prompt,
        }

    # ---- shared -------------------------------------------------------------------------------------------------

    def _episode(self, episode_id: str | None) -> Episode | None:
        if episode_id is None:
            return None
        episode = self.store.get(episode_id)
        episode.check_open()
        return episode

    def _sampling(self, episode: Episode | None, params: Params) -> SamplingSpec:
        """A training episode draws every turn from the run's distribution (its batch is trained in that one
        space); a free call from what it asks for."""
        if episode is None or episode.sampling is None:
            base = self.default_sampling
            return replace(
                base,
                temperature=base.temperature if params.temperature is None else params.temperature,
                top_p=base.top_p if params.top_p is None else params.top_p,
                max_new_tokens=params.max_tokens or base.max_new_tokens,
                stop=tuple(dict.fromkeys([*base.stop, *params.stop])),
                seed=params.seed,
            )
        run = episode.sampling
        if params.n != 1:
            raise Refused("n", "an episode's turn is one sample; open one episode per sample instead")
        for name, asked, fixed in (
            ("temperature", params.temperature, run.temperature),
            ("top_p", params.top_p, run.top_p),
        ):
            if asked is not None and asked != fixed:
                raise Refused(
                    name,
                    f"{asked} differs from the run's rollout.sampling.{name} ({fixed}); a training episode samples "
                    "from the run's distribution: leave it out or send the same",
                )
        return replace(
            run,
            max_new_tokens=min(params.max_tokens or run.max_new_tokens, run.max_new_tokens),
            stop=tuple(dict.fromkeys([*run.stop, *params.stop])),
        )

    async def _generate(self, prompt: list[int], sampling: SamplingSpec, n: int) -> _Turn:
        try:
            self.engine.validate_prompts([prompt])
        except ValueError as exc:
            raise Refused("messages", f"the prompt: {exc}") from None
        outputs = await self.batcher.generate([prompt] * n, sampling)
        if any(o.finish_reason == FINISH_ABORT for o in outputs):
            raise EngineAborted("the engine aborted generation for a weight update (pause abort); retry the call")
        return _Turn(prompt, outputs)

    def _token_texts(self, ids: Sequence[int]) -> list[str]:
        return self.texts.decode_raw([[t] for t in ids])

    def _token_logprobs(self, out: SampleOutput) -> list[Mapping[str, JsonValue]]:
        return [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(self._token_texts(out.token_ids), out.log_probs, strict=True)
        ]


def _usage(prompt: Sequence[int], outputs: Sequence[SampleOutput]) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


__all__ = ["EngineAborted", "EpisodeError", "OpenAIEndpoint"]
