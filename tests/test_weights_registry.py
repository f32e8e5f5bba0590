"""The weight-transport registry: one explicit table whose keys are the config's transports, the same whatever
was imported before it, and importing it loads no transport module."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from services.contracts.config import WeightsConfig
from services.weights.transport_registry import TRANSPORTS, transport

ROOT = Path(__file__).resolve().parents[1]

# Builds every registered transport on both sides after importing `modules` in that order, and prints what it got.
_PROBE = """
import importlib, json, sys, tempfile
from pathlib import Path
for module in sys.argv[1:]:
    importlib.import_module(module)
from services.contracts.config import ProcessGroupWeights
from services.weights.transport_registry import TRANSPORTS
senders = ("services.weights.transports.", "services.rollout.engines.sglang.weight_send_")  # SGLang's with its adapter
out = {"loaded before building": sorted(m for m in sys.modules if m.startswith(senders))}
for name, entry in TRANSPORTS.items():
    sender = entry.sender(ProcessGroupWeights(), Path(tempfile.gettempdir()), "probe")   # each reads its own section
    receiver = entry.receiver()
    out[name] = [type(sender).__module__ + "." + type(sender).__qualname__, sender.name,
                 type(receiver).__module__ + "." + type(receiver).__qualname__, receiver.name]
    sender.close()
    receiver.close()
print(json.dumps(out, sort_keys=True))
"""

_BUILT = {
    "gloo": [
        "services.rollout.engines.sglang.weight_send_group.SGLangAwareSender",
        "gloo",
        "services.weights.transports.pg.ProcessGroupReceiver",
        "gloo",
    ],
    "nccl": [
        "services.rollout.engines.sglang.weight_send_group.SGLangAwareSender",
        "nccl",
        "services.weights.transports.pg.ProcessGroupReceiver",
        "nccl",
    ],
    "cuda_ipc": [
        "services.weights.transports.cuda_ipc.CudaIpcSender",
        "cuda_ipc",
        "services.weights.transports.cuda_ipc.CudaIpcReceiver",
        "cuda_ipc",
    ],
    "disk": [
        "services.weights.transports.disk.DiskSender",
        "disk",
        "services.weights.transports.disk.DiskReceiver",
        "disk",
    ],
}


def _probe(*modules: str) -> dict[str, typing.Any]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_registry_lists_exactly_the_transports_the_config_accepts():
    accepted = [
        tag
        for section in typing.get_args(typing.get_args(WeightsConfig)[0])
        for tag in typing.get_args(section.model_fields["transport"].annotation)
    ]
    assert sorted(TRANSPORTS) == sorted(accepted)
    assert all(entry.name == name for name, entry in TRANSPORTS.items())


_PG_SGLANG = [
    "services.weights.transports.pg",
    "services.weights.transports.rendezvous",
    "services.rollout.engines.sglang.weight_send_group",
]


@pytest.mark.parametrize(
    ("modules", "loaded"),
    [
        (("services.weights",), []),
        (tuple(_PG_SGLANG), sorted(_PG_SGLANG)),
        (
            (
                "services.rollout.engines.sglang.weight_send_group",
                "services.weights.transports.disk",
                "services.weights.transports.cuda_ipc",
                "services.weights.transports.pg",
            ),
            sorted([*_PG_SGLANG, "services.weights.transports.disk", "services.weights.transports.cuda_ipc"]),
        ),
    ],
    ids=["package-alone", "pg-then-sglang", "sglang-first"],
)
def test_every_import_order_builds_the_same_transports(modules, loaded):
    """The package itself loads no transport module; whatever was imported first, each name builds the same
    classes (gloo/nccl: the SGLang-aware sender, never the plain one that happened to register last)."""
    assert _probe(*modules) == {"loaded before building": loaded, **_BUILT}


def test_an_unknown_transport_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown weight transport 'tcp' \(known: cuda_ipc, disk, gloo, nccl\)"):
        transport("tcp")
