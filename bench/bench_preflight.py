"""How long preflight's prompt check takes on large task files (services/launcher/preflight.py).

    python bench/bench_preflight.py [--lines 10000 100000] [--model examples/models/tiny] [--chat-model DIR]

Two task files per size: a JSONL file of short text prompts (tokenized with the tiny example tokenizer), and a
verl-shaped parquet file of chat prompts (`prompt` a message list, label at `reward_model.ground_truth`, nested
`extra_info`), rendered with a ChatML template and encoded by a byte-level BPE tokenizer (--chat-model; default:
the small one tests/helpers/chatml_tokenizer.py builds). Times each stage of what `tandem run` does before any
service starts: reading the file (load_prompts), rendering and tokenising every prompt as the rollout does
(model_prompts, in batches; prompts a byte-length bound shows to fit are not encoded), the length check, and the
unknown-token scan; and, for comparison, encoding every prompt exactly (`exact s`, what the encode stage would cost
without the bound). The tokenizers' loads are timed once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # helpers.chatml_tokenizer

from services.contracts.config import TandemConfig  # noqa: E402
from services.contracts.config_loading import load_config  # noqa: E402
from services.launcher import preflight  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
from services.rollout.tokenizer import load_tokenizer  # noqa: E402


def write_jsonl(path: Path, n: int) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": f"{i % 10} {i // 10 % 10} =", "label": str(i % 10)}) + "\n" for i in range(n))
    )
    return path


def write_chat_parquet(path: Path, n: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "gsm8k-like",
            "ability": "math",
            "prompt": [
                {
                    "role": "user",
                    "content": f"Ava has {i % 97} apples and buys {i % 13} more. How many "
                    "apples does Ava have now? Give the final answer after ####.",
                }
            ],
            "reward_model": {"style": "rule", "ground_truth": str(i % 97 + i % 13)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def time_stages(config: TandemConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list[float], float, int]:
    """Seconds of each stage, seconds to encode every prompt exactly, and how many prompts the check encoded."""
    from services.rollout.tokenizer import encode_prompt_texts

    times = []
    t = time.perf_counter()
    records = preflight.check_data(config)
    times.append(time.perf_counter() - t)
    t = time.perf_counter()
    prompts = preflight.model_prompts(config, records, tokenizer)
    times.append(time.perf_counter() - t)
    t = time.perf_counter()
    preflight.check_prompt_lengths(config, records, prompts)
    times.append(time.perf_counter() - t)
    t = time.perf_counter()
    preflight.unencodable_text(config, records, prompts, tokenizer)
    times.append(time.perf_counter() - t)
    rows, texts = records["data.train_path"], prompts["data.train_path"].texts
    t = time.perf_counter()
    for start in range(0, len(texts), preflight.ENCODE_BATCH):
        encode_prompt_texts(
            tokenizer,
            texts[start : start + preflight.ENCODE_BATCH],
            [bool(r.messages) for r in rows[start : start + preflight.ENCODE_BATCH]],
        )
    return times, time.perf_counter() - t, len(prompts["data.train_path"].ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--model", default=str(REPO / "examples" / "models" / "tiny"))
    parser.add_argument("--chat-model", default=None, help="a tokenizer directory with a chat template")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        chat_model = args.chat_model
        if chat_model is None:
            from helpers.chatml_tokenizer import build_chatml_tokenizer

            chat_model = str(build_chatml_tokenizer(Path(tmp) / "chatml"))
        tokenizers = {}
        for name, path in (("text", args.model), ("chat", chat_model)):
            t = time.perf_counter()
            tokenizers[name] = load_tokenizer(path)
            print(f"tokenizer load ({name}): {time.perf_counter() - t:.2f}s ({path}, {len(tokenizers[name])} tokens)")
        print(
            f"{'rows':>8} {'file':<14} {'read s':>8} {'encode s':>9} {'check s':>8} {'unk s':>7} {'total s':>8} "
            f"{'encoded':>8} {'exact s':>8}"
        )
        for n in args.lines:
            files: tuple[tuple[str, Path, str, list[str]], ...] = (
                ("text jsonl", write_jsonl(Path(tmp) / f"tasks_{n}.jsonl", n), args.model, []),
                (
                    "chat parquet",
                    write_chat_parquet(Path(tmp) / f"chat_{n}.parquet", n),
                    chat_model,
                    ["data.label_key=reward_model.ground_truth"],
                ),
            )
            for name, path, model, extra in files:
                config = load_config(
                    REPO / "examples" / "digit_max.yaml",
                    [
                        f"data.train_path={path}",
                        "data.eval_path=null",
                        f"model.path={model}",
                        "rollout.max_context_length=256",
                        *extra,
                    ],
                )
                times, exact, encoded = time_stages(config, tokenizers[name.split()[0]])
                print(
                    f"{n:>8} {name:<14} {times[0]:>8.2f} {times[1]:>9.2f} {times[2]:>8.2f} {times[3]:>7.2f} "
                    f"{sum(times):>8.2f} {encoded:>8} {exact:>8.2f}"
                )


if __name__ == "__main__":
    main()
