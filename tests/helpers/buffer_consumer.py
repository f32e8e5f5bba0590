"""A trainer-like consumer in its own process: gets entries without acknowledging them, reports them as one
JSON line on stdout, then waits to be killed (the tests kill -9 it to simulate a crashed trainer).

    python tests/helpers/buffer_consumer.py URL STREAM --group actor --groups actor,critic --consumer NAME --count N
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from services.buffer.entries import BufferEntry
from services.buffer.stream import RolloutBuffer, connect


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("stream")
    parser.add_argument("--group", default="actor")
    parser.add_argument("--groups", default="actor")
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    buf = RolloutBuffer(
        connect(args.url),
        args.stream,
        groups=tuple(args.groups.split(",")),
        group=args.group,
        consumer=args.consumer,
        claim_idle_ms=3_600_000,
    )
    got: list[BufferEntry] = []
    deadline = time.monotonic() + args.timeout
    while len(got) < args.count and time.monotonic() < deadline:
        got += buf.get(count=args.count - len(got), block_ms=500)
    print(json.dumps({"ids": [e.entry_id for e in got], "rollout_ids": [e.rollout_id for e in got]}), flush=True)
    while True:  # hold the entries (pending, never acked) until killed
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
