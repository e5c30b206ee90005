"""The deploy files, checked as text: every accelmesh process they run exports traces to the
collector, the collector forwards to Jaeger in compose, every manifest is part of a kustomization,
and the modules and ACCELMESH_* variables they name exist. Docker and a cluster are not needed;
tests/shared/test_k8s.py checks the rendered Kubernetes objects."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from accelmesh.security.credentials import main as credentials_main
from accelmesh.security.identity import Role, certificate_identity, node_host

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
COLLECTOR_CONFIG = BASE / "otel-collector-config.yaml"  # compose mounts it; kustomize makes its ConfigMap
SERVICES = {"inventory": "inventory_svc", "compile": "compile_svc", "worker": "worker_svc",
            "dispatch": "dispatch_svc"}
COLLECTOR = "http://otel-collector:4317"


def children(text: str, parent: str) -> dict[str, str]:
    """The blocks of the keys directly under a top-level `parent:` key, by indentation."""
    lines = text.splitlines()
    start = lines.index(f"{parent}:") + 1
    blocks: dict[str, list[str]] = {}
    current = None
    for line in lines[start:]:
        if line and not line[0].isspace() and not line.startswith("#"):
            break  # the next top-level key
        key = re.match(r"^  ([\w./-]+):", line)
        if key:
            current = key[1]
            blocks[current] = []
        elif current is not None:
            blocks[current].append(line)
    return {name: "\n".join(body) for name, body in blocks.items()}


def test_every_compose_service_of_the_mesh_exports_to_the_collector():
    services = children((DEPLOY / "compose.yaml").read_text(), "services")
    assert set(SERVICES) | {"otel-collector", "jaeger", "credentials", "prometheus", "grafana"} == set(services)
    # A one-shot job makes the mesh's CA and certificates; every service reads them, read-only.
    assert '"-m", "accelmesh.security.credentials"' in services["credentials"]
    for name, module in SERVICES.items():
        block = services[name]
        assert f'command: ["python", "-m", "{module}"]' in block
        assert "credentials:/credentials:ro" in block, f"{name} has no credentials"
        assert f'OTEL_EXPORTER_OTLP_ENDPOINT: "{COLLECTOR}"' in block, f"{name} does not export to the collector"
        assert f'OTEL_SERVICE_NAME: "accelmesh-{name}"' in block
    assert f"./{COLLECTOR_CONFIG.relative_to(DEPLOY)}:/etc/otelcol/config.yaml" in services["otel-collector"]
    assert '"16686:16686"' in services["jaeger"]


def test_prometheus_scrapes_every_service_that_serves_metrics_and_grafana_reads_it():
    services = children((DEPLOY / "compose.yaml").read_text(), "services")
    serving = {name for name in SERVICES if 'ACCELMESH_METRICS_LISTEN: "0.0.0.0:9464"' in services[name]}
    assert serving == {"inventory", "dispatch"}
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert set(re.findall(r'"(\w+):9464"', config)) == serving
    # The endpoints are TLS with client certificates of the mesh CA (accelmesh/runtime/metrics.py).
    assert "scheme: https" in config and "cert_file: /credentials/client.crt" in config
    assert "credentials:/credentials:ro" in services["prometheus"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]
    grafana = services["grafana"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana
    provider = (DEPLOY / "grafana" / "provisioning" / "dashboards" / "accelmesh.yaml").read_text()
    assert "path: /var/lib/grafana/dashboards" in provider
    source = (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    uid = re.search(r"^\s+uid: (\w+)$", source, re.M)[1]
    assert "url: http://prometheus:9090" in source
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "accelmesh.json").read_text())
    used = {t["datasource"]["uid"] for panel in dashboard["panels"] for t in panel.get("targets", ())}
    assert used == {uid}  # every query reads the data source provisioned beside it


def test_the_collector_sends_traces_to_jaeger_in_compose():
    config = COLLECTOR_CONFIG.read_text()
    receivers, exporters = children(config, "receivers"), children(config, "exporters")
    assert "endpoint: 0.0.0.0:4317" in receivers["otlp"]  # reachable from the other containers
    backend = re.search(r"^\s+endpoint: \$\{env:(\w+)\}$", exporters["otlp/backend"], re.M)
    assert backend, "the exporter's endpoint is not taken from the environment"
    collector = children((DEPLOY / "compose.yaml").read_text(), "services")["otel-collector"]
    assert f"{backend[1]}: jaeger:4317" in collector
    pipeline = re.search(r"^    traces:\n((?:      .*\n?)+)", config, re.M)
    assert pipeline, "no traces pipeline"
    assert "receivers: [otlp]" in pipeline[1] and "exporters: [otlp/backend]" in pipeline[1]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_k8s_workload_runs_a_module_and_traces(name):
    manifest = (BASE / f"{name}.yaml").read_text()
    assert f'command: ["python", "-m", "{SERVICES[name]}"]' in manifest
    assert "name: accelmesh-env" in manifest  # envFrom the shared ConfigMap
    assert re.search(rf"name: OTEL_SERVICE_NAME\n\s+value: accelmesh-{name}\n", manifest)
    assert f'OTEL_EXPORTER_OTLP_ENDPOINT: "{COLLECTOR}"' in (BASE / "config.yaml").read_text()


def test_k8s_workers_are_a_daemonset_named_by_the_node_ip():
    manifest = (BASE / "worker.yaml").read_text()
    assert "kind: DaemonSet" in manifest
    assert re.search(r"name: ACCELMESH_NODE_IP\n\s+valueFrom:\n\s+fieldRef:\n\s+fieldPath: status.hostIP", manifest)


@pytest.mark.parametrize("folder", ["base", "overlays/dev", "overlays/production"])
def test_every_k8s_file_is_part_of_its_kustomization(folder):
    """A manifest left out of `resources:` (or a generator's file gone missing) is caught here."""
    kustomization = (K8S / folder / "kustomization.yaml").read_text()
    named = set(re.findall(r"^  - (?:path: )?([\w.-]+\.yaml)$", kustomization, re.M))  # resources, patches
    named |= set(re.findall(r"^      - (?:[\w.-]+=)?([\w.-]+\.yaml)$", kustomization, re.M))  # generators' files
    assert named == {p.name for p in (K8S / folder).glob("*.yaml")} - {"kustomization.yaml"}


def test_deploy_names_only_modules_and_variables_the_code_has():
    texts = [p.read_text() for p in [DEPLOY / "Dockerfile", DEPLOY / "compose.yaml", *K8S.rglob("*.yaml")]]
    for module in set(re.findall(r'"-m", "([\w.]+)"', "\n".join(texts))):
        assert importlib.util.find_spec(module) is not None, f"deploy runs {module}, which does not exist"
    packages = ["accelmesh", "inventory_svc", "compile_svc", "dispatch_svc", "worker_svc"]
    source = "\n".join(p.read_text() for package in packages
                       for p in (ROOT / package).rglob("*.py"))
    for variable in set(re.findall(r"\bACCELMESH_[A-Z_]+", "\n".join(texts))):
        assert f'"{variable}"' in source, f"deploy sets {variable}, which no service reads"


def test_the_compose_worker_runs_with_its_nodes_own_certificate_which_the_credentials_job_issues(tmp_path):
    """Per-node worker certificates in compose: the credentials job's command, run here, issues the
    file the worker is given, and it names the worker's node IP as dispatch and the inventory dial it."""
    services = children((DEPLOY / "compose.yaml").read_text(), "services")
    command = json.loads(re.search(r"command: (\[.*\])", services["credentials"])[1])
    node_ip = re.search(r'ACCELMESH_NODE_IP: "([^"]+)"', services["worker"])[1]
    cert = re.search(r"ACCELMESH_CERT_FILE: /credentials/(\S+)", services["worker"])[1]
    assert command[:4] == ["python", "-m", "accelmesh.security.credentials", "/credentials"]
    assert credentials_main([str(tmp_path), *command[4:]]) == 0
    identity = certificate_identity((tmp_path / cert).read_bytes())
    assert identity.role is Role.WORKER and identity.names_host(node_host(Role.WORKER, node_ip))
