"""The package layering docs/architecture.md states: each package of services/ imports only the packages below it
(the launcher and the CLI, which start and check everything, may import any). Read from the source, not run."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[1] / "services"
ALLOWED = {
    "contracts": set(),
    "telemetry": {"contracts"},
    "tensors": {"contracts"},
    "rpc": {"contracts", "telemetry"},
    "buffer": {"contracts"},
    "weights": {"contracts", "rpc"},
    "trainer": {"contracts", "telemetry", "tensors", "rpc", "buffer", "weights"},
    "rollout": {"contracts", "telemetry", "tensors", "rpc", "buffer", "weights"},
    # cli: only `python -m services.coordinator.server`'s entry point goes through it
    "coordinator": {"contracts", "telemetry", "rpc", "buffer", "cli"},
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found |= {n.split(".")[1] for n in names if n.startswith("services.") and n.count(".") >= 1}
    return found


def test_every_package_imports_only_the_layers_below_it():
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in (SERVICES / package).rglob("*.py"):
            if "gen" in path.relative_to(SERVICES).parts:
                continue
            extra = imported_packages(path) - allowed - {package}
            if extra:
                wrong.append(f"{path.relative_to(SERVICES)} imports {sorted(extra)}")
    assert not wrong, wrong


def test_the_table_covers_every_package():
    packages = {p.name for p in SERVICES.iterdir() if (p / "__init__.py").is_file()}
    assert packages - set(ALLOWED) == {"launcher"}   # the launcher may import everything
