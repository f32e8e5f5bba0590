"""How long preflight's prompt check takes on large task files (services/launcher/preflight.py).

    python bench/bench_preflight.py [--lines 10000 100000] [--model examples/models/tiny]

Writes a JSONL file of short prompts per size, then times each stage of what `tandem run` does before any service
starts: reading the file (load_prompts), tokenising every prompt as the rollout does (prompt_token_ids, in
batches), the length check, and the unknown-token scan (labels). The tokenizer's load is timed once.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from services.contracts.config import load_config
from services.launcher import preflight
from services.rollout.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--model", default=str(REPO / "examples" / "models" / "tiny"))
    args = parser.parse_args()
    t = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    print(f"tokenizer load: {time.perf_counter() - t:.2f}s ({args.model})")
    print(f"{'lines':>8} {'read s':>8} {'encode s':>9} {'check s':>8} {'unk s':>7} {'total s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.lines:
            path = Path(tmp) / f"tasks_{n}.jsonl"
            path.write_text("".join(json.dumps({"prompt": f"{i % 10} {i // 10 % 10} =", "label": str(i % 10)}) + "\n"
                                    for i in range(n)))
            config = load_config(REPO / "examples" / "digit_max.yaml",
                                 [f"data.train_path={path}", f"model.path={args.model}"])
            times = []
            t = time.perf_counter()
            records = preflight.check_data(config)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            ids = {key: preflight.encode_prompts(tokenizer, rows) for key, rows in records.items()}
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            preflight.check_prompt_lengths(config, records, ids)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            preflight.unencodable_text(config, records, ids, tokenizer)
            times.append(time.perf_counter() - t)
            print(f"{n:>8} {times[0]:>8.2f} {times[1]:>9.2f} {times[2]:>8.2f} {times[3]:>7.2f} {sum(times):>8.2f}")


if __name__ == "__main__":
    main()
