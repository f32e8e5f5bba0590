"""Regenerates the Python stubs from `protos/` (the one documented command):

    python -m services.contracts.protogen

The stubs are committed under `services/contracts/gen/`; `tests/test_protos.py` fails when they drift.
protoc emits `from tandem.v1 import x_pb2`; we rewrite that to the package path so no sys.path hack
is needed at import time.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
GEN_ROOT = Path(__file__).resolve().parent / "gen"
GEN_PACKAGE = "services.contracts.gen"

_IMPORT_RE = re.compile(r"^from tandem\.v1 import (\w+) as (\w+)$", re.MULTILINE)


def generate(out_dir: Path, *, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Runs protoc over every .proto file under proto_root into out_dir; returns the files written."""
    from grpc_tools import protoc  # imported late: only needed when regenerating

    out_dir = Path(out_dir)
    proto_root = Path(proto_root)
    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}")
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{proto_root}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {protos}")
        written = []
        for src in sorted(Path(tmp).rglob("*.py*")):
            rel = src.relative_to(tmp)
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            text = _IMPORT_RE.sub(rf"from {GEN_PACKAGE}.tandem.v1 import \1 as \2", src.read_text())
            dst.write_text(text)
            written.append(dst)
    for pkg in {out_dir, *(p.parent for p in written), *(p.parent.parent for p in written)}:
        if pkg == out_dir or out_dir in pkg.parents:
            (pkg / "__init__.py").touch()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GEN_ROOT)
    args = parser.parse_args(argv)
    # Generate aside first: a protoc error must not leave the package without its stubs.
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp) / "gen")
        if args.out.exists():
            shutil.rmtree(args.out)
        shutil.copytree(Path(tmp) / "gen", args.out)
    print(f"wrote {len(files)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
