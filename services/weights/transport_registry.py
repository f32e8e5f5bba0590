"""The weight transports, by the name `weights.transport` and `WeightSyncPlan.transport` use: one explicit table.

Each entry says which class sends and which receives. The transport modules are imported only when a transport is
built (cuda_ipc and the process groups pull in CUDA and torch.distributed), and they register nothing themselves,
so the table does not depend on what was imported before. A test keeps its keys equal to WeightsConfig.transport's.

gloo and nccl send with `SGLangAwareSender`: a trainer cannot know before the engine ranks post `ready` whether
they are native receivers (pg.ProcessGroupReceiver) or SGLang servers behind the rollout adapter; that sender
serves both, taking pg.ProcessGroupSender's path unchanged for native receivers
(rollout/engines/sglang/weight_send_group.py).
cuda_ipc must decide at prepare time (a native plan carries IPC handles of one shared buffer, an SGLang plan
serialised buckets of fresh buffers), so it has a second sender for SGLang engines, which the publisher picks when
the run's rollout.engine is sglang (`sglang_sender`; the SGLang adapter receives, there is no receiver class).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

from services.contracts.config import CudaIpcWeights, DiskWeights, ProcessGroupWeights, WeightsConfig, for_transport
from services.weights.transport_base import ReceiverTransport, SenderTransport

SenderFactory = Callable[[WeightsConfig, Path, str], SenderTransport]  # (config, run_dir, trainer_id)
SGLangSenderFactory = Callable[[WeightsConfig, str, str], SenderTransport]  # (config, trainer_id, load format)
ReceiverFactory = Callable[[], ReceiverTransport]
Own = TypeVar("Own", ProcessGroupWeights, CudaIpcWeights, DiskWeights)


def _own(config: WeightsConfig, transport: str, section: type[Own]) -> Own:
    """The run's weights section as `transport` reads it (a PrepareWeightSync may name another than configured)."""
    own = for_transport(config, transport)
    if not isinstance(own, section):
        raise TypeError(f"weights.transport {transport} reads {section.__name__}, not {type(own).__name__}")
    return own


@dataclass(frozen=True)
class Transport:
    name: str
    sender: SenderFactory
    receiver: ReceiverFactory
    sglang_sender: SGLangSenderFactory | None = None  # None: `sender` serves SGLang engines too


def _process_group_sender(backend: str) -> SenderFactory:
    def build(config: WeightsConfig, run_dir: Path, trainer_id: str) -> SenderTransport:
        from services.rollout.engines.sglang.weight_send_group import SGLangAwareSender

        return SGLangAwareSender(
            backend=backend, config=_own(config, backend, ProcessGroupWeights), trainer_id=trainer_id
        )

    return build


def _process_group_receiver(backend: str) -> ReceiverFactory:
    def build() -> ReceiverTransport:
        from services.weights.transports.pg import ProcessGroupReceiver

        return ProcessGroupReceiver(backend=backend)

    return build


def _cuda_ipc_sender(config: WeightsConfig, run_dir: Path, trainer_id: str) -> SenderTransport:
    from services.weights.transports.cuda_ipc import CudaIpcSender

    return CudaIpcSender(config=_own(config, "cuda_ipc", CudaIpcWeights), trainer_id=trainer_id)


def _cuda_ipc_receiver() -> ReceiverTransport:
    from services.weights.transports.cuda_ipc import CudaIpcReceiver

    return CudaIpcReceiver()


def _sglang_tensor_sender(config: WeightsConfig, trainer_id: str, load_format: str) -> SenderTransport:
    from services.rollout.engines.sglang.weight_send_tensor import SGLangTensorSender

    return SGLangTensorSender(
        config=_own(config, "cuda_ipc", CudaIpcWeights), trainer_id=trainer_id, load_format=load_format
    )


def _disk_sender(config: WeightsConfig, run_dir: Path, trainer_id: str) -> SenderTransport:
    from services.weights.transports.disk import DiskSender

    return DiskSender(config=_own(config, "disk", DiskWeights), run_dir=run_dir, trainer_id=trainer_id)


def _disk_receiver() -> ReceiverTransport:
    from services.weights.transports.disk import DiskReceiver

    return DiskReceiver()


TRANSPORTS: Mapping[str, Transport] = MappingProxyType(
    {
        t.name: t
        for t in (
            Transport("gloo", sender=_process_group_sender("gloo"), receiver=_process_group_receiver("gloo")),
            Transport("nccl", sender=_process_group_sender("nccl"), receiver=_process_group_receiver("nccl")),
            Transport(
                "cuda_ipc", sender=_cuda_ipc_sender, receiver=_cuda_ipc_receiver, sglang_sender=_sglang_tensor_sender
            ),
            Transport("disk", sender=_disk_sender, receiver=_disk_receiver),
        )
    }
)


def transport(name: str) -> Transport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {name!r} (known: {', '.join(sorted(TRANSPORTS))})")
    return TRANSPORTS[name]


def transport_names() -> list[str]:
    return sorted(TRANSPORTS)
