"""The Kubernetes chart (deploy/helm/tandem) and the Slurm launcher (services/launcher/slurm.py) against the compose
file: the chart rendered by Helm's own engine (the Helm v4 Go SDK in the `helm-python-sdk` wheel; a `helm` binary
on PATH is used instead when there is one), every rendered object validated offline against the Kubernetes
schemas (`kubernetes-validate`), and the commands each target runs equal to those deploy/docker-compose.yml runs,
host names and paths aside, so the three cannot drift. Seconds; no cluster, no Slurm.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from test_deploy import DEPLOY, argv, load_compose, wiring

from services.launcher import slurm

CHART = DEPLOY / "helm" / "tandem"
KUBE_VERSION = "1.33.0"  # validated against this Kubernetes release's schemas (the chart needs >= 1.28)
RELEASE = "tandem"


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`helm template RELEASE CHART` with `values`: every rendered object."""
    helm = shutil.which("helm")
    if helm:
        out = subprocess.run(
            [helm, "template", RELEASE, str(CHART), "--values", "-"],
            input=json.dumps(values or {}),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        docs = list(yaml.safe_load_all(out))
    else:
        helm_python = pytest.importorskip(
            "helm_python",
            reason="no Helm: `pip install -e '.[dev]'` brings "
            "helm-python-sdk (Linux x86-64), or put a helm binary on PATH",
        )
        rendered = helm_python.Chart.load(str(CHART)).render(values or {}, name=RELEASE, namespace="default")
        docs = [d for text in rendered.values() for d in yaml.safe_load_all(text)]
    return [d for d in docs if d]


def by_kind(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(objects: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    spec = by_kind(objects)[(kind, f"{RELEASE}-{component}")]["spec"]
    return spec["template"]["spec"]["containers"][0]


VALUE_SETS = {
    "defaults": {},
    "multi-node": {
        "trainer": {"nodes": 4, "gpusPerNode": 8, "resources": {"requests": {"cpu": "32"}}},
        "rollout": {"replicas": 3},
        "reward": {"enabled": True, "gpus": 2},
        "weights": {"transport": "nccl"},
    },
    "external-redis-tls-cpu": {
        "redis": {"enabled": False, "externalUrl": "rediss://redis.example:6380/0"},
        "secrets": {"authToken": "t0k", "tls": {"cert": "C", "key": "K", "ca": "A"}},
        "trainer": {"gpusPerNode": 0},
        "rollout": {"gpus": 0},
        "persistence": {"data": {"existingClaim": "my-data"}},
    },
}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_rendered_object_is_valid_kubernetes(name):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="`pip install -e '.[dev]'` brings kubernetes-validate"
    )
    objects = render(VALUE_SETS[name])
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:  # name the object, not just the schema path
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: {exc}") from exc
    kinds = sorted({(o["kind"], o["metadata"]["name"]) for o in objects})
    expected = {
        ("Deployment", "tandem-coordinator"),
        ("StatefulSet", "tandem-trainer"),
        ("StatefulSet", "tandem-rollout"),
        ("Service", "tandem-trainer"),
        ("ConfigMap", "tandem-config"),
        ("Secret", "tandem-secrets"),
        ("PersistentVolumeClaim", "tandem-checkpoints"),
        ("Job", "tandem-init"),
    }
    assert expected <= set(kinds), kinds
    assert (("StatefulSet", "tandem-redis") in kinds) == (name != "external-redis-tls-cpu")


def test_chart_layout_probes_gpus_secrets_and_exposure():
    objects = render(VALUE_SETS["multi-node"])
    kinds = by_kind(objects)
    trainer_set = kinds[("StatefulSet", "tandem-trainer")]["spec"]
    assert trainer_set["replicas"] == 4 and trainer_set["serviceName"] == "tandem-trainer"
    assert kinds[("Service", "tandem-trainer")]["spec"]["clusterIP"] == "None"  # headless: rank DNS names
    trainer = container(objects, "StatefulSet", "trainer")
    assert trainer["command"][:8] == [
        "torchrun",
        "--nnodes",
        "4",
        "--node-rank",
        "$(POD_INDEX)",
        "--nproc-per-node",
        "8",
        "--master-addr",
    ]
    assert trainer["resources"] == {"requests": {"cpu": "32"}, "limits": {"nvidia.com/gpu": 8}}
    assert trainer["startupProbe"]["failureThreshold"] * trainer["startupProbe"]["periodSeconds"] >= 45 * 60
    assert kinds[("StatefulSet", "tandem-rollout")]["spec"]["replicas"] == 3
    rollout_hosts = yaml.safe_load(
        wiring({"command": container(objects, "StatefulSet", "rollout")["args"]})["services.rollout"]
    )
    assert rollout_hosts == [{"host": f"tandem-rollout-{i}.tandem-rollout", "port": 50061} for i in range(3)]
    assert container(objects, "Deployment", "reward")["resources"] == {"limits": {"nvidia.com/gpu": 2}}  # its own
    for obj in objects:  # nothing leaves the cluster by default
        if obj["kind"] == "Service":
            assert obj["spec"].get("type", "ClusterIP") == "ClusterIP", obj["metadata"]["name"]
    redis = kinds[("StatefulSet", "tandem-redis")]["spec"]
    assert redis["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert kinds[("PersistentVolumeClaim", "tandem-checkpoints")]["spec"]["accessModes"] == ["ReadWriteMany"]
    config = yaml.safe_load(kinds[("ConfigMap", "tandem-config")]["data"]["run.yaml"])
    assert config == yaml.safe_load((DEPLOY / "config" / "compose.yaml").read_text())
    # Token and TLS from the Secret: the token through $(TANDEM_AUTH_TOKEN), the certificates as files.
    tls = render(VALUE_SETS["external-redis-tls-cpu"])
    secret = by_kind(tls)[("Secret", "tandem-secrets")]["stringData"]
    assert secret == {"auth-token": "t0k", "tls.crt": "C", "tls.key": "K", "ca.crt": "A"}
    args = wiring({"command": container(tls, "Deployment", "coordinator")["args"]})
    assert args["services.tls_cert"] == "/tls/tls.crt" and args["redis.url"] == "rediss://redis.example:6380/0"
    assert "resources" not in container(tls, "StatefulSet", "trainer") or "nvidia.com/gpu" not in container(
        tls, "StatefulSet", "trainer"
    )["resources"].get("limits", {})


# ---- the same commands as compose ---------------------------------------------------------------------

# Compose host names -> the chart's Service / pod DNS names (release "tandem", one trainer pod, one replica).
CHART_HOSTS = {
    "coordinator": "tandem-coordinator",
    "trainer": "tandem-trainer-0.tandem-trainer",
    "rollout": "tandem-rollout-0.tandem-rollout",
    "reward": "tandem-reward",
    "redis": "tandem-redis",
}
# The chart's per-pod and per-secret values, which compose spells as its own variables.
CHART_ENV = {"TANDEM_AUTH_TOKEN": "$(TANDEM_AUTH_TOKEN)", "TANDEM_WEIGHTS": "nccl"}


def with_hosts(args: list[str], hosts: dict[str, str]) -> list[str]:
    """Compose's argument list with its service host names replaced (in addresses, URLs and the rollout list)."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and value in hosts:
            value = hosts[value]
        elif sep:
            for name, host in hosts.items():
                value = value.replace(f"//{name}:", f"//{host}:").replace(f"host: {name},", f"host: {host},")
        out.append(f"{key}{sep}{value}" if sep else arg)
    return out


def test_chart_runs_the_commands_compose_runs():
    objects = render({"reward": {"enabled": True}})
    assert not [o for o in render() if "reward" in o["metadata"]["name"]]  # only when asked for
    compose = load_compose(CHART_ENV)["services"]
    chart = {
        "trainer": container(objects, "StatefulSet", "trainer"),
        "rollout": container(objects, "StatefulSet", "rollout"),
        "reward": container(objects, "Deployment", "reward"),
        "coordinator": container(objects, "Deployment", "coordinator"),
    }
    for name, c in chart.items():
        mine = [a.replace("$(POD_INDEX)", "0") for a in c["command"] + c["args"]]  # pod 0 = compose's replica 0
        assert mine == with_hosts(argv(compose[name]), CHART_HOSTS), name
        assert c["startupProbe"]["exec"]["command"] == compose[name]["healthcheck"]["test"][1:], name
        env = {e["name"]: e.get("value") for e in c["env"]}
        for key in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "NCCL_NVLS_ENABLE", "CUDA_DEVICE_ORDER"):
            assert env[key] == compose[name]["environment"][key], (name, key)
    init = by_kind(objects)[("Job", "tandem-init")]["spec"]["template"]["spec"]["containers"][0]
    assert init["command"] + init["args"] == argv(compose["init"])
    redis = container(objects, "StatefulSet", "redis")
    assert redis["command"] == compose["redis"]["command"]
    assert redis["readinessProbe"]["exec"]["command"] == compose["redis"]["healthcheck"]["test"][1:]


def slurm_args(**kw: Any) -> argparse.Namespace:
    return slurm.build_parser().parse_args(
        [
            str(DEPLOY / "config" / "compose.yaml"),
            "--workdir",
            "/shared/w",
            *[a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))],
        ]
    )


def test_slurm_launcher_runs_the_commands_compose_runs():
    """One node (everything on it) with the compose defaults: the same commands, node names for host names and
    the job's shared directories for the volumes."""
    plan = slurm.plan(slurm_args(weights="gloo", tracing="none"), ["n0"], tandem="tandem", redis_server="redis-server")
    compose = load_compose()["services"]
    paths = {
        "/config/run.yaml": str((DEPLOY / "config" / "compose.yaml").resolve()),
        "/runs/digit_max": "/shared/w/runs/digit_max",
        "trainer.checkpoint_dir=/checkpoints": "trainer.checkpoint_dir=/shared/w/checkpoints",
    }
    steps = {s.name: s for s in (*plan.services, plan.coordinator)}
    for name, step_name in (("trainer", "trainer"), ("rollout", "rollout-0"), ("coordinator", "coordinator")):
        expected = with_hosts(
            argv(compose[name]), dict.fromkeys(("coordinator", "trainer", "rollout", "reward", "redis"), "n0")
        )
        assert list(steps[step_name].argv) == [paths.get(a, a) for a in expected], name
        assert steps[step_name].nodes == ("n0",)
    assert plan.redis.argv[1 : 1 + len(slurm.REDIS_ARGS)] == tuple(compose["redis"]["command"][1:])
    ports = {k: int(v) for k, v in wiring(compose["coordinator"]).items() if k.endswith(".port")}
    assert ports == {
        "services.coordinator.port": slurm.COORDINATOR_PORT,
        "services.trainer.port": slurm.TRAINER_PORT,
        "services.reward.port": slurm.REWARD_PORT,
    }


def test_slurm_runs_the_reward_service_as_compose_does_when_the_config_has_one(tmp_path):
    """A run config with a reward: section gets a reward step, on the node after the rollouts', running compose's
    reward command; without one, none (the compose service is behind its profile)."""
    config = yaml.safe_load((DEPLOY / "config" / "compose.yaml").read_text())
    config["reward"] = {"models": {"j": {"type": "judge", "path": "/models/judge", "template": "{{ response }}"}}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    args = slurm.build_parser().parse_args(
        [str(path), "--workdir", "/shared/w", "--weights", "gloo", "--tracing", "none", "--rollout-nodes", "1"]
    )
    plan = slurm.plan(args, ["n0", "n1", "n2"], tandem="tandem", redis_server="redis-server")
    steps = {s.name: s for s in plan.services}
    assert list(steps) == ["trainer", "reward", "rollout-0"] and steps["reward"].nodes == ("n2",)
    compose = load_compose()["services"]
    hosts = {"coordinator": "n0", "trainer": "n0", "rollout": "n1", "reward": "n2", "redis": "n0"}
    paths = {
        "/config/run.yaml": str(path.resolve()),
        "/runs/digit_max": "/shared/w/runs/digit_max",
        "trainer.checkpoint_dir=/checkpoints": "trainer.checkpoint_dir=/shared/w/checkpoints",
    }
    assert list(steps["reward"].argv) == [paths.get(a, a) for a in with_hosts(argv(compose["reward"]), hosts)]
    assert wiring({"command": list(steps["reward"].argv[2:])})["services.reward.port"] == str(slurm.REWARD_PORT)
    no_reward = slurm.plan(slurm_args(weights="gloo", tracing="none"), ["n0"], tandem="t", redis_server="r")
    assert "reward" not in {s.name for s in no_reward.services}


def test_slurm_layout_across_nodes():
    nodes = ["n0", "n1", "n2", "n3", "n4"]
    plan = slurm.plan(
        slurm_args(trainer_nodes=2, rollout_nodes=3, gpus_per_node=8),
        nodes,
        tandem="tandem",
        redis_server="redis-server",
    )
    assert plan.redis.nodes == plan.coordinator.nodes == ("n0",)
    trainer = plan.services[0]
    assert trainer.nodes == ("n0", "n1") and "torch.distributed.run" in trainer.argv[2]
    assert trainer.argv[4:8] == ("2", "8", "n0", str(slurm.RENDEZVOUS_PORT))  # nnodes, per node, master
    assert [s.nodes for s in plan.services[1:]] == [("n2",), ("n3",), ("n4",)]
    set_ = wiring({"command": list(trainer.argv[8:])})
    assert set_["weights.master_addr"] == "n0" and set_["services.trainer.host"] == "n0"
    assert set_["trainer.num_ranks"] == "16" and set_["redis.url"] == "redis://n0:6379/0"
    assert yaml.safe_load(set_["services.rollout"]) == [{"host": n, "port": 50061} for n in ("n2", "n3", "n4")]
    # Fewer nodes than asked: round-robin again, one port more per replica already on a node.
    small = slurm.Layout.of(["a", "b"], trainer_nodes=1, rollout_nodes=3)
    assert small.rollout == (("b", 50061), ("a", 50061), ("b", 50062))
    with pytest.raises(ValueError, match="--rollout-nodes 0 must be 1 or more"):
        slurm.Layout.of(["a"], trainer_nodes=1, rollout_nodes=0)
