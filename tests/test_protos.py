"""The committed stubs under services/contracts/gen/ must be what protoc makes of protos/ today.

Fix a failure with `python -m services.contracts.protogen` and commit the result.
"""

from __future__ import annotations

import difflib
import importlib
import re
import shutil
from pathlib import Path

import pytest

from services.contracts.protogen import GEN_ROOT, PROTO_ROOT, generate

# Lines that only stamp the version of the generator (protoc / grpcio-tools) are ignored, so that CI with a
# newer grpcio-tools does not fail the check: the "# Protobuf Python Version" comment, the numbers passed to
# ValidateProtobufRuntimeVersion, and GRPC_GENERATED_VERSION. Nothing else is ignored.
_STAMPS = (
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: <stamp>"),
    (
        re.compile(
            r"^(_runtime_version\.ValidateProtobufRuntimeVersion\(\n\s*_runtime_version\.Domain\.PUBLIC,\n)"
            r"\s*\d+,\n\s*\d+,\n\s*\d+,\n\s*'[^'\n]*',\n",
            re.M,
        ),
        r"\1    <stamp>\n",
    ),
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^'\n]*'$", re.M), "GRPC_GENERATED_VERSION = '<stamp>'"),
)


def normalize(text: str) -> str:
    for pattern, replacement in _STAMPS:
        text = pattern.sub(replacement, text)
    return text


def generated_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): normalize(p.read_text())
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".pyi")
    }


def drift(fresh_root: Path, committed_root: Path = GEN_ROOT) -> list[str]:
    fresh, committed = generated_files(fresh_root), generated_files(committed_root)
    problems = [f"{name}: generated but not committed" for name in sorted(fresh.keys() - committed.keys())]
    problems += [f"{name}: committed but not generated any more" for name in sorted(committed.keys() - fresh.keys())]
    for name in sorted(fresh.keys() & committed.keys()):
        if fresh[name] != committed[name]:
            diff = difflib.unified_diff(
                committed[name].splitlines(), fresh[name].splitlines(), "committed", "regenerated", lineterm="", n=1
            )
            problems.append(f"{name} differs:\n" + "\n".join(list(diff)[:20]))
    return problems


def test_committed_stubs_match_the_protos(tmp_path):
    generate(tmp_path / "gen")
    problems = drift(tmp_path / "gen")
    assert not problems, "stubs are stale; run `python -m services.contracts.protogen`:\n" + "\n".join(problems)


def test_an_edited_proto_without_regeneration_is_caught(tmp_path):
    protos = tmp_path / "protos"
    shutil.copytree(PROTO_ROOT, protos)
    common = protos / "tandem" / "v1" / "common.proto"
    text = common.read_text()
    assert "message Ack {\n  bool ok = 1;\n" in text
    common.write_text(
        text.replace("message Ack {\n  bool ok = 1;\n", "message Ack {\n  bool ok = 1;\n  int32 code = 9;\n")
    )
    (protos / "tandem" / "v1" / "extra.proto").write_text('syntax = "proto3";\npackage tandem.v1;\nmessage X {}\n')
    generate(tmp_path / "gen", proto_root=protos)
    problems = drift(tmp_path / "gen")
    assert any(p.startswith("tandem/v1/common_pb2.py differs") for p in problems)
    assert any(p.startswith("tandem/v1/common_pb2.pyi differs") and "code" in p for p in problems)
    assert "tandem/v1/extra_pb2.py: generated but not committed" in problems


def test_only_version_stamps_are_ignored(tmp_path):
    shutil.copytree(GEN_ROOT, tmp_path / "gen", ignore=shutil.ignore_patterns("__pycache__"))
    pb2 = tmp_path / "gen" / "tandem" / "v1" / "trainer_pb2.py"
    grpc_py = tmp_path / "gen" / "tandem" / "v1" / "trainer_pb2_grpc.py"
    text = pb2.read_text()
    bumped = re.sub(r"# Protobuf Python Version: .*", "# Protobuf Python Version: 99.1.0", text)
    bumped = re.sub(
        r"(Domain\.PUBLIC,\n)\s*\d+,\n\s*\d+,\n\s*\d+,\n\s*'',", r"\1    99,\n    1,\n    0,\n    '-rc1',", bumped
    )
    assert bumped != text
    pb2.write_text(bumped)
    grpc_py.write_text(
        re.sub(r"GRPC_GENERATED_VERSION = '.*'", "GRPC_GENERATED_VERSION = '9.99.0'", grpc_py.read_text())
    )
    assert drift(tmp_path / "gen") == []
    pb2.write_text(bumped.replace("_builder.BuildTopDescriptorsAndMessages", "_builder.BuildTopDescriptorsAndMsgs"))
    assert [p.split(":")[0] for p in drift(tmp_path / "gen")] == ["tandem/v1/trainer_pb2.py differs"]


SERVICES = {
    "coordinator": ("Coordinator", {"GetStatus", "Save", "Eval", "Pause", "Resume", "Stop", "WatchEvents"}),
    "trainer": (
        "Trainer",
        {"Train", "Save", "Load", "PrepareWeightSync", "PublishWeights", "Offload", "Onload", "GetState"},
    ),
    "rollout": (
        "Rollout",
        {
            "Generate",
            "Evaluate",
            "PrepareWeightSync",
            "ReceiveWeights",
            "Pause",
            "Resume",
            "ReleaseMemory",
            "ResumeMemory",
            "GetState",
        },
    ),
}


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_stubs_import_and_serve_the_design_methods(module):
    pb2 = importlib.import_module(f"services.contracts.gen.tandem.v1.{module}_pb2")
    pb2_grpc = importlib.import_module(f"services.contracts.gen.tandem.v1.{module}_pb2_grpc")
    name, methods = SERVICES[module]
    service = pb2.DESCRIPTOR.services_by_name[name]
    assert service.full_name == f"tandem.v1.{name}"
    assert methods <= {m.name for m in service.methods}
    assert hasattr(pb2_grpc, f"{name}Stub") and hasattr(pb2_grpc, f"add_{name}Servicer_to_server")
