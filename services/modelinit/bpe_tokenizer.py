"""A byte-level BPE tokenizer in a real model family's layout, trained here on generated text (no download).

The merges are learned in about a second from generated grade-school word problems, arithmetic and chat turns
(`corpus`), so digits, numbers, common words and the chat roles get tokens of their own. The vocabulary then takes
the family's exact layout (families.Family): the learned tokens first, then unused entries up to the id of the
first special token (plain vocabulary entries no merge produces: `encode` never emits them), then the family's added
tokens at their real ids (`<|im_end|>` = 151645 as in Qwen2.5, `<|eot_id|>` = 128009 as in Llama-3), then reserved
special tokens up to the embedding size, as real vocabularies hold reserved specials. The pre-tokenizer, normaliser,
decoder and post-processor are those of the real tokenizer.json, so decoding gives back the text exactly (spaces and
newlines included) under `PreTrainedTokenizerFast` and under the class `AutoTokenizer` picks (`Qwen2Tokenizer`).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.modelinit.families import Family

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

LEARNED_VOCAB = 4096  # merges stop earlier when the corpus has no more frequent pairs
CORPUS_DOCS = 6000

_NAMES = (
    "Tom",
    "Anna",
    "Ben",
    "Maria",
    "Liam",
    "Sofia",
    "Noah",
    "Emma",
    "Omar",
    "Lena",
    "Ravi",
    "Chen",
    "Ava",
    "Lucas",
    "Mia",
    "Ethan",
    "Zoe",
    "Kai",
    "Nora",
    "Leo",
    "Grace",
    "Jack",
    "Ines",
    "Yuki",
    "Sam",
    "Priya",
)
_ITEMS = (
    "apples",
    "pencils",
    "books",
    "marbles",
    "cookies",
    "stickers",
    "coins",
    "cards",
    "shells",
    "eggs",
    "oranges",
    "candies",
    "toys",
    "flowers",
    "stamps",
    "bottles",
    "tickets",
    "muffins",
    "crayons",
    "beads",
)
_CONTAINERS = ("box", "bag", "basket", "jar", "crate", "shelf", "tray", "packet")
_PLACES = ("the store", "the park", "school", "the market", "the library", "the farm", "the bakery", "home")
_CONNECTIVES = ("First,", "Then", "Next,", "So", "Therefore,", "This means", "In total,", "Now", "After that,")
_VERBS = ("buys", "sells", "finds", "loses", "picks", "collects", "makes", "eats", "keeps", "brings", "needs", "wants")
_TIMES = ("on Monday", "every week", "in the morning", "after lunch", "each day", "last year", "this weekend")
_ASK = ("What is", "How many is", "Find", "Calculate", "Compute", "Work out", "What do you get for")
_SYSTEM = (
    "You are a helpful assistant.",
    "Solve the problem and give the final answer after ####.",
    "Think step by step, then put the answer in \\boxed{}.",
)


def _problem(r: random.Random) -> tuple[str, str, int]:
    """One word problem: (question, worked answer, result)."""
    name, other, item = r.choice(_NAMES), r.choice(_NAMES), r.choice(_ITEMS)
    a, b = r.randint(2, 120), r.randint(2, 60)
    match r.randrange(5):
        case 0:
            q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"
            result, work = a + b, f"{name} starts with {a} {item} and gets {b} more, so {a} + {b} = {a + b}."
        case 1:
            box = r.choice(_CONTAINERS)
            q = f"A {box} holds {b} {item}. How many {item} are in {a} such {box}s?"
            result, work = a * b, f"Each {box} holds {b}, and there are {a} of them: {a} * {b} = {a * b}."
        case 2:
            a += b
            q = f"{name} had {a} dollars and spent {b} dollars at {r.choice(_PLACES)}. How much money is left?"
            result, work = a - b, f"{name} spent {b} of {a} dollars, so {a} - {b} = {a - b} dollars are left."
        case 3:
            a *= b
            q = f"{name} shares {a} {item} equally among {b} friends. How many does each friend get?"
            result, work = a // b, f"Each friend gets {a} / {b} = {a // b} {item}."
        case _:
            c = r.randint(1, 9)
            q = f"{name} reads {a} pages a day for {c} days and then {b} more pages. How many pages is that?"
            result, work = a * c + b, f"{a} * {c} = {a * c} pages, then {a * c} + {b} = {a * c + b}."
    return q, work, result


def corpus(seed: int = 0, docs: int = CORPUS_DOCS) -> Iterator[str]:
    """Generated training text: chat turns around word problems, worked answers, arithmetic lines."""
    r = random.Random(seed)
    for _ in range(docs):
        q, work, result = _problem(r)
        answer = f"{r.choice(_CONNECTIVES)} {work} The answer is {result}.\n#### {result}"
        if r.random() < 0.3:
            answer += f"\n\\boxed{{{result}}}"
        x, y = r.randint(0, 9999), r.randint(1, 999)
        story = (
            f"{r.choice(_NAMES)} {r.choice(_VERBS)} {y} {r.choice(_ITEMS)} at {r.choice(_PLACES)} "
            f"{r.choice(_TIMES)}. {r.choice(_ASK)} {x} plus {y}?"
        )
        yield (
            f"system\n{r.choice(_SYSTEM)}\nuser\n{q}\nassistant\n{answer}\n\n{story}\n"
            f"{x} + {y} = {x + y}; {x} - {y} = {x - y}; {x} * {y} = {x * y}; ({x} + {y}) / 2 = {(x + y) / 2}; "
            f"{y}% of {x} is {x * y / 100:g}."
        )


def train_merges(family: Family, *, seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The learned byte-level vocabulary (token -> id, the 256 byte symbols included) and its merges."""
    vocab, merges = _trained(family, seed)
    return dict(vocab), list(merges)


@functools.lru_cache(maxsize=4)  # the same training again in one process (tests, a bench) is free
def _trained(family: Family, seed: int) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    _pipeline(tok, family)
    trainer = trainers.BpeTrainer(
        vocab_size=LEARNED_VOCAB, min_frequency=2, show_progress=False, initial_alphabet=_byte_alphabet()
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return tuple(model["vocab"].items()), tuple((a, b) for a, b in model["merges"])


def build_tokenizer(family: Family, *, model_max_length: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` whose vocabulary has the family's layout and exactly `family.vocab_size` tokens."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab, merges = train_merges(family, seed=seed)
    for i in range(len(vocab), family.first_special):  # never produced: no merge leads to them (module doc)
        vocab[f"<|unused_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=family.ignore_merges))
    _pipeline(tok, family)
    special = set(family.specials)
    reserved = [f"<|reserved_special_token_{k}|>" for k in range(family.reserved)]
    for token in (*family.added, *reserved):  # one at a time: each takes the next id
        added = AddedToken(token, special=token in special or token in reserved, normalized=False)
        (tok.add_special_tokens if added.special else tok.add_tokens)([added])
    _post_processor(tok, family)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        chat_template=family.chat_template,
    )
    if len(wrapped) != family.vocab_size or tok.token_to_id(family.eos) != family.token_id(family.eos):
        raise AssertionError(
            f"{family.name}: built {len(wrapped)} tokens with {family.eos} at "
            f"{tok.token_to_id(family.eos)}; the layout says {family.vocab_size} and "
            f"{family.token_id(family.eos)}"
        )
    return wrapped


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, family: Family, out: Path) -> None:
    """save_pretrained, then tokenizer_config.json as the real directories have it: the chat template inside and the
    class AutoTokenizer should build (Qwen2Tokenizer for Qwen)."""
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = family.tokenizer_class
    config["chat_template"] = family.chat_template
    config["add_bos_token"] = family.bos is not None
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _pipeline(tok: Any, family: Family) -> None:
    """Normaliser, pre-tokenizer and decoder of the family's real tokenizer.json."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC() if family.nfc else None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(family.split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()


def _post_processor(tok: Any, family: Family) -> None:
    """Qwen adds nothing to an encoding; Llama-3 starts each with <|begin_of_text|>."""
    from tokenizers import processors

    byte_level = processors.ByteLevel(trim_offsets=False)
    if family.bos is None:
        tok.post_processor = byte_level
        return
    bos = (family.bos, family.token_id(family.bos))
    tok.post_processor = processors.Sequence(
        [
            byte_level,
            processors.TemplateProcessing(
                single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[bos]
            ),
        ]
    )
