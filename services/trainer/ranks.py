"""Running a command on every trainer rank: rank 0 relays it and executes it itself, ranks > 0 execute what arrives.

Rank 0 validates a request, then `RankCommands.run(command)` relays the command (commands.py's codec over
`dist.CommandRelay`) and executes the decoded copy, so all ranks run the same bytes; ranks > 0 execute what arrives
in `RankCommands.serve` until `Shutdown`. With one rank the relay is a no-op, so 1 and N ranks share one code path.
"""

from __future__ import annotations

import logging
from typing import overload

from services.trainer.commands import (
    Command,
    Load,
    Offload,
    Onload,
    PublishWeights,
    Save,
    Shutdown,
    Train,
    WeightChecksums,
    decode,
    encode,
)
from services.trainer.parts import Checksums, TrainerParts
from services.weights.transport_base import SyncStats

log = logging.getLogger(__name__)

RankResult = dict[str, float] | Checksums | SyncStats | str | None
_ANSWERED = (Train, WeightChecksums, PublishWeights, Offload, Onload)  # rank 0 gets a value back from these


def execute(command: Command, parts: TrainerParts) -> RankResult:
    """Runs a command on this rank; returns what rank 0 answers with (None where it answers nothing)."""
    match command:
        case Train():
            return parts.step.run(command)
        case Save():
            parts.checkpoints.write(command)
            return None
        case Load():
            parts.checkpoints.read(command)
            return None
        case WeightChecksums(by_bucket=by_bucket):
            return parts.weights.checksums(by_bucket=by_bucket)
        case PublishWeights(version=version):
            return parts.weights.publish(version)
        case Offload():
            parts.weights.release()  # cuda_ipc buckets: the next sync allocates them again
            return parts.backend.offload()
        case Onload():
            return parts.backend.onload()
        case Shutdown():
            return None
    raise TypeError(f"not a trainer command: {command!r}")


class RankCommands:
    """Rank 0 relays a command and executes it; ranks > 0 execute relayed commands. One rank: no relay."""

    def __init__(self, parts: TrainerParts):
        self.relay, self.parts = parts.relay, parts

    @overload
    def run(self, command: Train) -> dict[str, float]: ...
    @overload
    def run(self, command: WeightChecksums) -> Checksums: ...
    @overload
    def run(self, command: PublishWeights) -> SyncStats: ...
    @overload
    def run(self, command: Offload | Onload) -> str: ...
    @overload
    def run(self, command: Save | Load | Shutdown) -> None: ...

    def run(self, command: Command) -> RankResult:
        """Rank 0: relay, then execute here too; returns rank 0's answer."""
        header, payloads = encode(command)
        self.relay.send(header, payloads)
        answer = execute(decode(header, payloads), self.parts)
        if answer is None and isinstance(command, _ANSWERED):
            raise RuntimeError(f"{type(command).__name__} gave rank {self.relay.rank} no answer: only rank 0 runs it")
        return answer

    def serve(self) -> None:
        """Ranks > 0: execute relayed commands until rank 0 says Shutdown."""
        while not isinstance(command := decode(*self.relay.recv()), Shutdown):
            execute(command, self.parts)

    def shutdown(self) -> None:
        """Rank 0: the other ranks leave `serve`."""
        if self.relay.world_size == 1:
            return
        try:
            self.relay.send(*encode(Shutdown()))
        except RuntimeError as exc:  # a launcher stopping everything signals the other ranks too
            log.info("other ranks already gone at shutdown: %s", str(exc).splitlines()[0][:200])
