"""Multi-turn episodes whose prompt is a chat (services/rollout/multi_turn.py with chat_template.py): observations
become turns of the conversation through the chat template, and the tokens of earlier turns are never re-encoded
(the prime-rl #1334 / verl #2618 bug: re-tokenizing the conversation's text splits what the model sampled differently).

A real byte-level BPE ChatML tokenizer built in the test, and a scripted fake engine: its turns are chosen token ids
that are NOT how the tokenizer would encode their text (" apples" sampled letter by letter), which a real model
emits all the time but would make a test random."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers.chatml_tokenizer import build_chatml_tokenizer
from helpers.scripted_engine import GenerateOnlyEngine

from services.contracts.chat_messages import ChatMessage
from services.contracts.config_loading import config_from_dict
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.chat_template import ChatTemplate
from services.rollout.engines.interface import FINISH_LENGTH, FINISH_STOP, Engine, SampleOutput
from services.rollout.environment_registry import resolve_environment
from services.rollout.environments import Action, EnvironmentFailure, EnvironmentPlugin, EpisodeSample, StepResult
from services.rollout.math_feedback import FEEDBACK
from services.rollout.multi_turn import MultiTurnRollout
from services.rollout.tokenizer import Texts, encode_texts, load_tokenizer

QUESTION = ChatMessage("user", "Ava has 3 apples and buys 2 more. How many?")
SAMPLING = SamplingSpec(temperature=1.0, max_new_tokens=16, seed=5)


class ScriptedFakeEngine(GenerateOnlyEngine):
    """Call t returns turns[t] (token ids, finish reason) for every prompt; records every context it was given."""

    def __init__(self, turns: list[tuple[list[int], str]]):
        super().__init__(max_context=4096)
        self.turns: list[tuple[list[int], str]] = turns
        self.calls: list[list[list[int]]] = []

    def _generate_admitted(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, budgets: Sequence[int]
    ) -> list[SampleOutput]:
        ids, finish = self.turns[len(self.calls)]
        self.calls.append([list(p) for p in prompts])
        return [SampleOutput(tuple(ids), tuple([-0.5] * len(ids)), finish, 0) for _ in prompts]


class Observes:
    """reset: `first`; step t: observation t of `steps`, done after the last."""

    def __init__(self, first, steps):
        self.first, self.steps = first, steps

    def reset(self, sample: EpisodeSample):
        return self.first

    def step(self, action: Action) -> StepResult:
        if action.turn >= len(self.steps):
            return StepResult("", 1.0, True)
        return StepResult(self.steps[action.turn], 0.0, False)


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Texts:
    path = build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))
    tokenizer = load_tokenizer(path)
    config = config_from_dict(
        {
            "model": {"path": str(path)},
            "data": {"train_path": "unused.parquet"},
            "rollout": {"observation_role": "user"},
        }
    )
    return Texts(tokenizer, ChatTemplate.from_config(tokenizer, config))


def play(texts: Texts, engine: Engine, env, *, max_turns: int = 4):
    [prompt_ids] = encode_texts(texts.tokenizer, texts.chat.render([(QUESTION,)]), special_tokens=False)[:1]
    sample = EpisodeSample(
        prompt="",
        prompt_ids=tuple(prompt_ids),
        label="5",
        metadata={},
        group_id=0,
        sample_index=0,
        messages=(QUESTION,),
    )
    rollout = MultiTurnRollout(
        engine=engine,
        plugin=EnvironmentPlugin(spec="test:Env", factory=lambda: env),
        encode=texts.encode_text,
        decode=texts.decode,
        max_turns=max_turns,
        step_timeout_s=5.0,
        vocab_size=texts.vocab_size,
        chat=texts,
    )
    [episode] = rollout.run([sample], SAMPLING).episodes
    return prompt_ids, episode


def ids_of(texts: Texts, *tokens: str) -> list[int]:
    ids = texts.tokenizer.convert_tokens_to_ids(list(tokens))
    assert isinstance(ids, list)
    return ids


def test_observations_are_chat_turns_and_earlier_turns_keep_the_exact_tokens_that_were_generated(texts):
    apples = ids_of(texts, "Ġ", "a", "p", "p", "l", "e", "s", "<|im_end|>")  # " apples" letter by letter, then EOS
    cut = ids_of(texts, "Ġ", "5")  # a turn cut by max_new_tokens
    engine = ScriptedFakeEngine([(apples, FINISH_STOP), (cut, FINISH_LENGTH), (ids_of(texts, "5"), FINISH_STOP)])
    prompt_ids, episode = play(texts, engine, Observes(None, ["the result is 6", {"role": "tool", "content": "ok"}]))
    # the turn ended with <|im_end|>: the observation adds the rest of the template's turn end ("\n"), its own turn,
    # and the next assistant header; after a cut turn it closes the turn first
    first = encode_texts(
        texts.tokenizer,
        ["\n<|im_start|>user\nthe result is 6<|im_end|>\n<|im_start|>assistant\n"],
        special_tokens=False,
    )[0]
    second = encode_texts(
        texts.tokenizer, ["<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"], special_tokens=False
    )[0]
    assert engine.calls == [[prompt_ids], [prompt_ids + apples + first], [prompt_ids + apples + first + cut + second]]
    assert list(episode.prompt_ids) == prompt_ids
    assert list(episode.output.token_ids) == apples + first + cut + second + ids_of(texts, "5")
    assert list(episode.loss_mask) == [1] * len(apples) + [0] * len(first) + [1] * len(cut) + [0] * len(second) + [1]
    # the conversation the engine read is the template's rendering of it...
    conversation = texts.tokenizer.decode(engine.calls[1][0], skip_special_tokens=False)
    assert (
        conversation
        == texts.chat.render([(QUESTION, ChatMessage("assistant", " apples"), ChatMessage("user", "the result is 6"))])[
            0
        ]
    )
    # ...but re-encoding that text (what the bug does) would have changed the tokens the policy sampled
    assert encode_texts(texts.tokenizer, [conversation], special_tokens=False)[0] != engine.calls[1][0]


def test_a_reset_observation_is_a_turn_of_the_prompt_and_token_ids_stay_as_they_are(texts):
    engine = ScriptedFakeEngine([(ids_of(texts, "5", "<|im_end|>"), FINISH_STOP), (ids_of(texts, "6"), FINISH_STOP)])
    prompt_ids, episode = play(texts, engine, Observes("Tools: add", [[7, 8, 9]]))
    rendered = texts.chat.render([(QUESTION, ChatMessage("user", "Tools: add"))])[0]
    assert list(episode.prompt_ids) == encode_texts(texts.tokenizer, [rendered], special_tokens=False)[0]
    assert list(episode.prompt_ids) != prompt_ids
    assert list(episode.output.token_ids) == [*ids_of(texts, "5", "<|im_end|>"), 7, 8, 9, *ids_of(texts, "6")]


def test_an_observation_role_the_template_refuses_names_the_episode(texts, tmp_path: Path):
    (tmp_path / "strict.jinja").write_text(
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + "
        "m['role']) }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = config_from_dict(
        {
            "model": {"path": "unused"},
            "data": {"train_path": "unused.parquet", "chat_template": str(tmp_path / "strict.jinja")},
        }
    )
    strict = Texts(texts.tokenizer, ChatTemplate.from_config(texts.tokenizer, config))
    engine = ScriptedFakeEngine([(ids_of(texts, "5"), FINISH_STOP)] * 2)
    with pytest.raises(
        EnvironmentFailure,
        match=r"environment test:Env: the observation of episode 0: the chat "
        r"template .*strict.jinja .* cannot render an observation as a "
        r"'tool' message: .*bad role tool",
    ):
        play(strict, engine, Observes(None, [{"role": "tool", "content": "ok"}]))


def test_math_feedback_after_a_wrong_answer_is_a_user_turn_of_the_chat_and_a_right_answer_then_scores_1(texts):
    """The built-in environment (tests/test_math_feedback.py has its rules) played through the rollout: its
    feedback is rendered by the chat template as the user's turn, masked from the loss."""
    wrong = [*texts.encode_text("#### 6"), *ids_of(texts, "<|im_end|>")]
    right = [*texts.encode_text("#### 5"), *ids_of(texts, "<|im_end|>")]
    engine = ScriptedFakeEngine([(wrong, FINISH_STOP), (right, FINISH_STOP)])
    prompt_ids, episode = play(texts, engine, resolve_environment("math_feedback").make())
    feedback = encode_texts(
        texts.tokenizer,
        [f"\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"],
        special_tokens=False,
    )[0]
    assert engine.calls == [[prompt_ids], [prompt_ids + wrong + feedback]]
    assert list(episode.output.token_ids) == wrong + feedback + right
    assert list(episode.loss_mask) == [1] * len(wrong) + [0] * len(feedback) + [1] * len(right)
    assert (episode.reward, episode.turns, episode.end) == (1.0, 2, "done")
