"""The package layering docs/architecture.md states: each package of services/ imports only the packages below it
(the launcher and the CLI, which start and check everything, may import any), and no module imports itself back
through others. Read from the source, not run."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services"
ALLOWED = {
    "contracts": set(),
    "modelinit": {"contracts"},
    "telemetry": {"contracts"},
    "tensors": {"contracts"},
    "rpc": {"contracts", "telemetry"},
    "buffer": {"contracts"},
    "weights": {"contracts"},
    "trainer": {"contracts", "telemetry", "tensors", "rpc", "buffer", "weights"},
    "rollout": {"contracts", "telemetry", "tensors", "rpc", "buffer", "weights"},
    "coordinator": {"contracts", "telemetry", "rpc", "buffer"},
    "reward": {"contracts", "telemetry", "tensors", "rpc", "rollout"},  # the judge runs on the rollout's engine
}


def source_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of services/ but the generated stubs."""
    modules = {}
    for path in SERVICES.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if "gen" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(path: Path) -> list[str]:
    """Every `services.*` name the file imports, wherever the import stands (module level, under TYPE_CHECKING, in
    a function): a lazy import still ties the two modules together. `from a import b` gives `a.b`."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return [n for n in names if n.startswith("services.")]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of services/ it imports (`from a import b` is a.b where b is a module, else a)."""
    modules = source_modules()

    def owner(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    return {module: {owner(n) for n in imported_names(path)} - {module} for module, path in modules.items()}


def imported_packages(path: Path) -> set[str]:
    return {n.split(".")[1] for n in imported_names(path)}


# The one import upward, on purpose: SGLang's weight sync is in one place (rollout/engines/sglang/), both the
# adapter's receiving half and the trainer's sending half, and the transport table names the sending half (lazily:
# only a run that builds that transport imports it).
UPWARD = {"weights/transport_registry.py": {"rollout"}}


def test_every_package_imports_only_the_layers_below_it():
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in (SERVICES / package).rglob("*.py"):
            if "gen" in path.relative_to(SERVICES).parts:
                continue
            extra = (
                imported_packages(path) - allowed - {package} - UPWARD.get(path.relative_to(SERVICES).as_posix(), set())
            )
            if extra:
                wrong.append(f"{path.relative_to(SERVICES)} imports {sorted(extra)}")
    assert not wrong, wrong


def test_the_table_covers_every_package():
    packages = {p.name for p in SERVICES.iterdir() if (p / "__init__.py").is_file()}
    assert packages - set(ALLOWED) == {"launcher"}  # the launcher may import everything


def test_no_module_imports_itself_back():
    """No import cycle among the modules of services/, counting imports under TYPE_CHECKING and in functions."""
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_the_cycle_check_sees_lazy_and_type_checking_imports():
    """The check above would pass vacuously if the graph missed the imports that usually hide a cycle."""
    graph = import_graph()
    assert "services.weights.transports.disk" in graph["services.weights.transport_registry"]  # in a function
    assert "services.contracts.config" in graph["services.contracts.runfacts"]  # under TYPE_CHECKING
    assert "services.weights.layout" in graph["services.weights"]  # from a package


def _names_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(
        (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(annotation)
    )


def public_signatures_naming_any(path: Path) -> list[str]:
    """`function(param)` for each public function or method of a public class whose signature names Any."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and (
                not child.name.startswith("_") or child.name.startswith("__")
            ):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                named = [p.arg for p in params if _names_any(p.annotation)] + (["->"] * _names_any(child.returns))
                if named:
                    found.append(f"{prefix}{child.name}({', '.join(named)})")

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_public_signature_names_any():
    """A value a third-party library leaves untyped is named through services/contracts/untyped.py, which says
    which library; everything else has its type."""
    wrong = [
        f"{path.relative_to(ROOT)}: {where}"
        for path in source_modules().values()
        if path.name != "untyped.py"
        for where in public_signatures_naming_any(path)
    ]
    assert not wrong, wrong


def test_each_untyped_name_says_which_library_leaves_it_open():
    lines = (SERVICES / "contracts" / "untyped.py").read_text().splitlines()
    aliases = [i for i, line in enumerate(lines) if ": TypeAlias = " in line]
    assert aliases, "no aliases found"
    uncommented = [lines[i] for i in aliases if not lines[i - 1].startswith("#")]
    assert not uncommented, uncommented


def test_the_any_check_sees_every_kind_of_signature(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import Any\n"
        "def f(a: int, *rest: Any) -> None: ...\n"
        "def g() -> 'dict[str, Any]': ...\n"
        "def _private(a: Any) -> Any: ...\n"
        "class C:\n"
        "    def m(self, *, k: list[Any]) -> int: ...\n"
        "class _Hidden:\n"
        "    def m(self, a: Any) -> None: ...\n"
    )
    assert public_signatures_naming_any(module) == ["f(rest)", "g(->)", "C.m(k)"]


# Where the tandem.v1 protobufs may be built and read: the gRPC edges, and the modules whose job is a wire format.
PROTOBUF_EDGES = ("server.py", "clients.py")
PROTOBUF_CODECS = {
    "services/contracts/protogen.py": "generates the stubs",
    "services/contracts/wire.py": "the rollout batch as a Redis entry holds it",
    "services/trainer/commands.py": "a relayed Train command's tensors as TensorData bytes",
    "services/trainer/algo/critic.py": "the critic's values for the actor, as TensorData in Redis",
    "services/coordinator/ctl.py": "`tandem ctl`: a client of the coordinator's control API",
    "services/rollout/reward_client.py": "the rollout's client of the reward service's Score",
    "services/coordinator/watch.py": "`tandem ctl watch`: the events a WatchEvents stream sends",
    "services/launcher/progress.py": "`tandem run`'s progress view: a WatchEvents stream",
    "services/launcher/supervisor.py": "`tandem run` asks the coordinator's GetStatus",
}
PROTOBUF_PACKAGES = {
    "rpc": "gRPC itself: health checks, status codes, the table of each service message's dataclass",
}


def test_protobufs_are_built_and_read_only_at_the_grpc_edges_and_in_wire_codecs():
    """Services, the coordinator's loop and their parts trade frozen dataclasses (contracts/*_calls.py, the
    weight-sync plan of contracts/weight_plan.py); a message of tandem.v1 appears only where it crosses a process
    boundary."""
    wrong = []
    for path in source_modules().values():
        where = path.relative_to(ROOT).as_posix()
        if (
            path.name in PROTOBUF_EDGES
            or where in PROTOBUF_CODECS
            or path.relative_to(SERVICES).parts[0] in PROTOBUF_PACKAGES
        ):
            continue
        if any(name.startswith("services.contracts.gen.") for name in imported_names(path)):
            wrong.append(where)
    assert not wrong, f"modules building or reading protobufs outside the edges: {wrong}"


def test_every_listed_protobuf_codec_exists():
    assert all((ROOT / path).is_file() for path in PROTOBUF_CODECS)


def test_the_trainer_package_docstring_names_every_trainer_module():
    """services/trainer/__init__.py is a newcomer's map of the trainer: it names each module (`name`)."""
    import services.trainer

    doc = services.trainer.__doc__ or ""
    trainer = SERVICES / "trainer"
    modules = {p.stem for p in trainer.rglob("*.py") if p.stem != "__init__"}
    assert modules, "no trainer modules found"
    missing = sorted(m for m in modules if f"`{m}`" not in doc)
    assert not missing, f"services/trainer/__init__.py does not name {missing}"


MAX_FUNCTION_LINES = 60


def test_no_function_of_services_is_over_60_lines():
    """The style's limit, counted from `def` to the function's last line (docstring and decorators' targets too)."""
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in source_modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


# Module names services/ may hold more than once: each service's gRPC edge, facade and builder, and the plug-ins of
# one registry (the engines of rollout/engines/engine_registry.py).
SHARED_NAMES = {"server", "service", "builder", "engine"}


def test_no_two_modules_of_services_share_a_name_but_the_patterns_every_service_has():
    seen: dict[str, list[str]] = {}
    for name, path in source_modules().items():
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(name)
    shared = {stem: names for stem, names in seen.items() if len(names) > 1 and stem not in SHARED_NAMES}
    assert not shared, shared
    engines = sorted(seen["engine"])
    assert engines == ["services.rollout.engines.native.engine", "services.rollout.engines.sglang.engine"]


def test_the_rollout_service_only_sequences_its_parts():
    """services/rollout/service.py: each job of a rollout replica lives in a module of its own (service.py's
    docstring names them); the service is kept small."""
    assert len((SERVICES / "rollout" / "service.py").read_text().splitlines()) <= 300


def test_every_abstract_engine_method_is_called_by_the_service_side():
    """An abstract method of the Engine interface is one every engine must implement: each is called from services/
    outside the engines' own modules (the rollout service and its parts), or it does not belong in the interface."""
    interface = SERVICES / "rollout" / "engines" / "interface.py"
    [engine] = [n for n in ast.parse(interface.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    abstract = [
        f.name
        for f in engine.body
        if isinstance(f, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "abstractmethod" for d in f.decorator_list)
    ]
    assert "receive_weights" in abstract, abstract
    callers = [p for p in source_modules().values() if SERVICES / "rollout" / "engines" not in p.parents]
    called = {
        node.attr
        for path in [*callers, interface]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
    }
    uncalled = [name for name in abstract if name not in called]
    assert not uncalled, f"abstract Engine methods nothing outside the engines calls: {uncalled}"
