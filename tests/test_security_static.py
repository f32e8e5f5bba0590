"""Security properties checked without a run: nothing in services/ can unpickle or pickle across a process
boundary, every listening default is loopback, rediss:// and redis passwords reach redis-py, and weight
plans (CUDA IPC handles included) are accepted only from the configured trainer."""

from __future__ import annotations

import ast
import datetime
from pathlib import Path

import pytest
import redis
import torch
import torch.distributed as dist

from services.buffer.stream import connect, redacted
from services.contracts.config import ProcessGroupWeights, ServicesConfig, TandemConfig
from services.contracts.weight_plan import WeightSyncPlan
from services.launcher.redis_server import EmbeddedRedis
from services.rpc.ports import free_port
from services.weights import WeightReceiver, WeightSyncRefused

pytestmark = pytest.mark.reliability
SERVICES = Path(__file__).resolve().parents[1] / "services"

PICKLING_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "cloudpickle",
    "dill",
    "shelve",
    "jsonpickle",
    "joblib",
    "multiprocessing",
    "torch.multiprocessing",
}
# The one module that writes pickles: the payload of SGLang's /update_weights_from_tensor, which SGLang (not Tandem)
# loads through its SafeUnpickler on the same host (docs/sglang.md, "trust boundary"). It may import a pickler;
# nothing there may load one.
PICKLE_PRODUCERS = {"services/rollout/engines/sglang/weight_send_tensor.py"}
# torch.distributed's *_object_list / *_object collectives pickle their payload
PICKLING_CALLS = {
    "broadcast_object_list",
    "recv_object_list",
    "send_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "read_pickle",
}


def _problems(path: Path, root: Path = SERVICES.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        producer = str(path.relative_to(root)) in PICKLE_PRODUCERS
        if isinstance(node, ast.Import) and not producer:
            out += [f"{where}: import {a.name}" for a in node.names if a.name in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in PICKLING_MODULES and not producer:
            out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Name | ast.Attribute) and "Unpickler" in ast.unparse(node):
            out.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            owner = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else ""
            kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if name in PICKLING_CALLS or (name in ("load", "loads") and owner in PICKLING_MODULES | {"marshal"}):
                out.append(f"{where}: {ast.unparse(node.func)}(...)")
            if (
                name == "load"
                and owner in ("torch", "np", "numpy")
                and kwargs.get("weights_only") != "True"
                and kwargs.get("allow_pickle") != "False"
            ):
                out.append(f"{where}: {ast.unparse(node.func)}(...) may unpickle")
            if kwargs.get("allow_pickle") == "True":
                out.append(f"{where}: allow_pickle=True")
    return out


def test_nothing_in_services_pickles():
    files = sorted(SERVICES.rglob("*.py"))
    assert len(files) > 30
    problems = [p for f in files for p in _problems(f)]
    assert problems == []


def test_the_scan_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nimport torch\nfrom cloudpickle import dumps\nx = torch.load('f')\n"
        "torch.distributed.broadcast_object_list([1])\ny = pickle.loads(b'')\nimport json\njson.loads('1')\n"
        "ok = torch.load('f', weights_only=True)\n"
    )
    found = [p.split(": ", 1)[1] for p in _problems(bad, root=tmp_path)]
    assert found == [
        "import pickle",
        "from cloudpickle import ...",
        "torch.load(...) may unpickle",
        "torch.distributed.broadcast_object_list(...)",
        "pickle.loads(...)",
    ]
    # the pickle producer may import a pickler, never load one
    producer = tmp_path / "services" / "rollout" / "engines" / "sglang" / "weight_send_tensor.py"
    producer.parent.mkdir(parents=True)
    producer.write_text(
        "import pickle\nfrom torch.multiprocessing import reductions\nx = pickle.loads(b'')\nu = pickle.Unpickler\n"
    )
    assert [p.split(": ", 1)[1] for p in _problems(producer, root=tmp_path)] == [
        "pickle.loads(...)",
        "pickle.Unpickler",
    ]


def test_every_listening_default_is_loopback():
    s = ServicesConfig()
    assert s.bind_host == "127.0.0.1"
    assert {a.host for a in (s.coordinator, s.trainer, s.critic, *s.rollout)} == {"127.0.0.1"}
    assert ProcessGroupWeights().master_addr == "127.0.0.1"  # the weight-sync store the trainer listens on
    assert EmbeddedRedis("unused").host == "127.0.0.1"
    assert s.auth_token is None and s.tls_cert is None  # opt-in, see test_security_run.py


def test_redis_password_and_rediss_urls_reach_redis_py(tmp_path):
    client = connect("rediss://redis.example:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required", password="s3cret")
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert (kwargs["password"], kwargs["ssl_ca_certs"], kwargs["ssl_cert_reqs"]) == (
        "s3cret",
        "/etc/ca.pem",
        "required",
    )
    config = TandemConfig.model_validate(
        {"model": {"path": "m"}, "data": {"train_path": "d"}, "redis": {"url": "rediss://h:1/0", "password": "p"}}
    )
    assert config.redis.url is not None and config.redis.url.startswith("rediss://") and config.redis.password == "p"
    assert redacted("redis://:s3cret@h:1/0") == "redis://***@h:1/0"
    with EmbeddedRedis(tmp_path / "r", appendonly=False, password="s3cret") as server:
        with pytest.raises(redis.exceptions.AuthenticationError):
            connect(f"redis://{server.host}:{server.port}/0").ping()
        assert connect(f"redis://{server.host}:{server.port}/0", password="s3cret").ping()


@pytest.mark.parametrize("transport", ["cuda_ipc", "gloo"])
def test_weight_plans_of_another_trainer_are_refused_before_any_transfer(transport):
    """The engine side of every transport, on CPU: a plan from another trainer id (for cuda_ipc, the one
    that would hand over IPC handles) is refused before anything is mapped or received, and the refusal is
    posted to that trainer's store so it fails at once instead of at its deadline."""
    store = dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    plan = WeightSyncPlan(
        version=3,
        transport=transport,
        trainer_id="intruder/actor",
        timeout_s=5,
        master_addr="127.0.0.1",
        master_port=store.port,
        world_size=2,
        group_name="g",
    )
    params: dict[str, torch.Tensor] = {}
    with pytest.raises(WeightSyncRefused, match="'intruder/actor' is not the accepted trainer 'run/actor'"):
        WeightReceiver(accepted_trainer_id="run/actor").receive(plan, 1, params)
    posted = dist.PrefixStore("g/ctl", store).get("v3/abort/1").decode()
    assert "not the accepted trainer" in posted
