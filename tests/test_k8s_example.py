"""conf/examples/k8s.yaml as operators expect it: every object valid against the
Kubernetes schema (kubernetes-validate, strict, its schemas bundled: no network),
and the project's own rules, each a function that lists what breaks it. Every
rule is run twice: on the example (nothing may break it) and on a copy broken
on purpose (the rule must say so), so a rule that checks nothing fails too."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tokenwire.sidecar.process.metrics import SidecarMetrics

from tokenwire.tools.cli import load_sidecar_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "conf" / "examples" / "k8s.yaml"
INGRESS = ROOT / "conf" / "examples" / "ingress.yaml"
# How long the endpoint removal takes to reach kube-proxy and the ingress (the engine's
# preStop waits that long before it asks the sidecar to drain).
ENDPOINT_PROPAGATION_S = 5
# Pod Security "restricted": the only capability a container may add back.
ALLOWED_CAPABILITIES = {"NET_BIND_SERVICE"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}

Docs = dict[str, dict[str, Any]]


def load(path: Path = EXAMPLE) -> Docs:
    with open(path) as file:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(file) if doc}


def pod_spec(docs: Docs) -> dict[str, Any]:
    spec: dict[str, Any] = docs["Deployment"]["spec"]["template"]["spec"]
    return spec


def containers(docs: Docs) -> dict[str, dict[str, Any]]:
    """Every container of the pod, init containers included, by name."""
    spec = pod_spec(docs)
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def sidecar_config(docs: Docs, tmp: Path) -> Any:
    """The sidecar's config as it starts in the pod: the ConfigMap's TOML, the image's
    ENV and the container's env and args, through the real loader."""
    from test_deploy_configs import dockerfile_stages

    sidecar = containers(docs)["sidecar"]
    toml = tmp / "sidecar.toml"
    toml.write_text(docs["ConfigMap"]["data"]["sidecar.toml"])
    args = [str(toml) if arg == "/etc/tokenwire/sidecar.toml" else arg for arg in sidecar["args"]]
    environ = {**dockerfile_stages()["sidecar"].env, **{e["name"]: e["value"] for e in sidecar["env"]}}
    return load_sidecar_config(args, environ)


def _sleep_s(container: dict[str, Any]) -> int:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return int(command[-1]) if command[:1] == ["sleep"] else 0


def _probe_path(probe: dict[str, Any] | None) -> str | None:
    """The path a probe asks: an httpGet's, or the engine probe's argument."""
    if not probe:
        return None
    if "httpGet" in probe:
        return str(probe["httpGet"]["path"])
    command = probe.get("exec", {}).get("command", [])
    if command[:3] == ["python", "-m", "tokenwire.engine.probe"] and len(command) >= 5:
        return str(command[4])
    return None


# ---------------------------------------------------------------- the rules


def rule_schema(docs: Docs) -> list[str]:
    """Every object valid against the Kubernetes schema (strict: no unknown fields)."""
    broken = []
    for kind, doc in docs.items():
        try:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        except kubernetes_validate.ValidationError as error:
            broken.append(f"{kind}: {error.message}")
    return broken


def rule_native_sidecar(docs: Docs) -> list[str]:
    spec = pod_spec(docs)
    inits = {c["name"]: c for c in spec.get("initContainers", [])}
    broken = []
    if inits.get("sidecar", {}).get("restartPolicy") != "Always":
        broken.append("the sidecar is not an initContainer with restartPolicy: Always")
    if "engine" not in {c["name"] for c in spec["containers"]}:
        broken.append("no engine container beside it")
    return broken


def rule_service_matches(docs: Docs) -> list[str]:
    """The Service selects the pods, on the sidecar's TLS port; the Ingress routes to it."""
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = docs["Service"]
    broken = []
    if not service["spec"]["selector"].items() <= labels.items():
        broken.append("the Service selects no pod of the Deployment")
    sidecar_ports = {p["name"]: p["containerPort"] for p in containers(docs)["sidecar"]["ports"]}
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    for port in ports.values():
        target = port.get("targetPort", port["port"])
        if target not in sidecar_ports and target not in sidecar_ports.values():
            broken.append(f"Service port {port['port']} targets {target!r}, no port of the sidecar")
    (ingress,) = load(INGRESS).values()
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            if backend["name"] != service["metadata"]["name"] or backend["port"]["number"] not in ports:
                broken.append(f"the Ingress routes to {backend}, not to the Service")
    return broken


def rule_disruption_budget(docs: Docs) -> list[str]:
    budget = docs.get("PodDisruptionBudget")
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    if budget is None:
        return ["no PodDisruptionBudget"]
    broken = []
    if not budget["spec"]["selector"]["matchLabels"].items() <= labels.items():
        broken.append("the PodDisruptionBudget selects no pod of the Deployment")
    if budget["spec"].get("maxUnavailable") is None and budget["spec"].get("minAvailable") is None:
        broken.append("the PodDisruptionBudget bounds nothing")
    return broken


def rule_autoscaler(docs: Docs) -> list[str]:
    """The HPA scales the Deployment on a tokenwire gauge of each pod (the Pods metric type)."""
    hpa = docs.get("HorizontalPodAutoscaler")
    if hpa is None:
        return ["no HorizontalPodAutoscaler"]
    broken = []
    target = hpa["spec"]["scaleTargetRef"]
    if (target["kind"], target["name"]) != ("Deployment", docs["Deployment"]["metadata"]["name"]):
        broken.append(f"the HPA scales {target}, not the Deployment")
    gauges = {family.name for family in SidecarMetrics().registry.collect() if family.type == "gauge"}
    pods = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    if not pods:
        broken.append("no Pods metric")
    for metric in pods:
        name = metric["pods"]["metric"]["name"]
        if name not in gauges:
            broken.append(f"{name} is no gauge of the sidecar's /metrics")
        if metric["pods"]["target"]["type"] != "AverageValue":
            broken.append(f"{name}: a per-pod metric is targeted as an AverageValue")
    if "replicas" in docs["Deployment"]["spec"]:
        broken.append("the Deployment sets replicas, which each apply would fight the HPA over")
    return broken


def rule_restricted(docs: Docs) -> list[str]:
    """Pod Security "restricted" (its checks of the pod and of every container)."""
    spec = pod_spec(docs)
    pod = spec.get("securityContext", {})
    broken = [f"pod: {field} must not be set" for field in ("hostNetwork", "hostPID", "hostIPC")
              if spec.get(field)]
    broken += [f"volume {v['name']}: {set(v) - {'name'}} is not allowed" for v in spec.get("volumes", [])
               if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    for name, container in containers(docs).items():
        context = container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            broken.append(f"{name}: allowPrivilegeEscalation must be false")
        if context.get("privileged"):
            broken.append(f"{name}: privileged")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            broken.append(f"{name}: capabilities must drop ALL")
        if not set(capabilities.get("add", [])) <= ALLOWED_CAPABILITIES:
            broken.append(f"{name}: adds {capabilities['add']}")
        if not context.get("runAsNonRoot", pod.get("runAsNonRoot")):
            broken.append(f"{name}: runAsNonRoot must be true")
        if context.get("runAsUser", pod.get("runAsUser")) == 0:
            broken.append(f"{name}: runs as uid 0")
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            broken.append(f"{name}: seccompProfile must be RuntimeDefault (is {seccomp})")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            broken.append(f"{name}: hostPort")
    return broken


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def rule_guaranteed(docs: Docs) -> list[str]:
    """Guaranteed QoS (requests == limits, CPU and memory, every container) and a whole
    CPU for the sidecar: what the static CPU manager gives a core of its own."""
    broken = []
    for name, container in containers(docs).items():
        resources = container.get("resources", {})
        for kind in ("cpu", "memory"):
            request = resources.get("requests", {}).get(kind)
            limit = resources.get("limits", {}).get(kind)
            if request is None or request != limit:
                broken.append(f"{name}: {kind} request {request} != limit {limit}")
    cpu = containers(docs)["sidecar"].get("resources", {}).get("requests", {}).get("cpu", "0")
    if not _cpus(str(cpu)).is_integer() or _cpus(str(cpu)) < 1:
        broken.append(f"sidecar: cpu {cpu} is not a whole number of CPUs")
    return broken


def rule_probes(docs: Docs) -> list[str]:
    """Readiness on /readyz and liveness on /healthz, for both containers; the
    sidecar's health checks ask the engine's /readyz."""
    broken = []
    for name, container in containers(docs).items():
        if _probe_path(container.get("readinessProbe")) != "/readyz":
            broken.append(f"{name}: no readiness probe on /readyz")
        if _probe_path(container.get("livenessProbe")) != "/healthz":
            broken.append(f"{name}: no liveness probe on /healthz")
    toml = docs["ConfigMap"]["data"]["sidecar.toml"]
    if not re.search(r'^health_path = "/readyz"$', toml, re.M):
        broken.append("the sidecar does not check the engine's /readyz (health_path)")
    return broken


def _drain_flags(container: dict[str, Any]) -> dict[str, str] | None:
    """The flags of a ``tokenwire drain`` preStop; None if the preStop is something else."""
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if command[:2] != ["tokenwire", "drain"]:
        return None
    return dict(zip(command[2::2], command[3::2], strict=True))


def rule_shutdown(docs: Docs, config: Any) -> list[str]:
    """The engine's preStop drains the sidecar (a native sidecar is stopped only after
    the engine has exited, too late to finish or hand off a stream) after the endpoint
    removal, on the sidecar's admin port with its token, for the whole drain_s; the
    grace period covers that and the engine's own graceful shutdown, with room left."""
    from tokenwire.engine.server import GRACEFUL_SHUTDOWN_S

    every = containers(docs)
    engine = every["engine"]
    flags = _drain_flags(engine)
    if flags is None:
        return ["the engine's preStop is not `tokenwire drain`: the sidecar would drain only once "
                "the engine has gone"]
    broken = []
    after_s, wait_s = float(flags.get("--after-s", 0)), float(flags.get("--wait-s", 0))
    admin_port = config.admin_listen.rpartition(":")[2]
    if flags.get("--admin") != f"127.0.0.1:{admin_port}":
        broken.append(f"tokenwire drain --admin {flags.get('--admin')} is not the sidecar's admin port "
                      f"{admin_port} on loopback")
    token_file = flags.get("--token-file", "")
    if config.admin_token_file and token_file != config.admin_token_file:
        broken.append(f"tokenwire drain --token-file {token_file!r} is not the sidecar's "
                      f"admin_token_file {config.admin_token_file!r}")
    mounts = [m["mountPath"] for m in engine.get("volumeMounts", [])]
    if token_file and not any(token_file.startswith(f"{path.rstrip('/')}/") for path in mounts):
        broken.append(f"the engine container does not mount {token_file}")
    if after_s < ENDPOINT_PROPAGATION_S:
        broken.append(f"tokenwire drain --after-s {after_s:g} < the endpoint removal's "
                      f"{ENDPOINT_PROPAGATION_S} s")
    if wait_s < config.drain_s:
        broken.append(f"tokenwire drain --wait-s {wait_s:g} < drain_s {config.drain_s:g}")
    grace = pod_spec(docs)["terminationGracePeriodSeconds"]
    if grace <= after_s + wait_s + GRACEFUL_SHUTDOWN_S + _sleep_s(every["sidecar"]):
        broken.append(f"grace {grace} s <= the engine's preStop {after_s + wait_s:g} s + its "
                      f"{GRACEFUL_SHUTDOWN_S} s shutdown (+ the sidecar's preStop)")
    return broken


# ---------------------------------------------------------------- the tests


def _set(path: str, value: Any) -> Callable[[Docs], None]:
    """A mutation: ``Kind.key.0.key`` (``name=x`` picks a list entry by name) set to
    ``value`` (``...`` deletes it)."""
    def mutate(docs: Docs) -> None:
        kind, *keys = path.split(".")
        node: Any = docs[kind]
        for key in keys[:-1]:
            if key.startswith("name="):
                node = next(item for item in node if item["name"] == key[5:])
            else:
                node = node[int(key)] if key.isdigit() else node[key]
        last: Any = int(keys[-1]) if keys[-1].isdigit() else keys[-1]
        if value is ...:
            del node[last]
        else:
            node[last] = value
    return mutate


TEMPLATE = "Deployment.spec.template.spec"
SIDECAR = f"{TEMPLATE}.initContainers.name=sidecar"
ENGINE = f"{TEMPLATE}.containers.name=engine"

BREAKS: dict[str, tuple[Callable[..., list[str]], Callable[[Docs], None]]] = {
    "schema": (rule_schema, _set(f"{ENGINE}.imagePullPolice", "Always")),
    "native sidecar": (rule_native_sidecar, _set(f"{SIDECAR}.restartPolicy", ...)),
    "service selector": (rule_service_matches, _set("Service.spec.selector", {"app": "other"})),
    "service port": (rule_service_matches, _set("Service.spec.ports.0.targetPort", "admin-typo")),
    "ingress port": (rule_service_matches, _set("Service.spec.ports.0.port", 443)),
    "disruption budget": (rule_disruption_budget,
                          _set("PodDisruptionBudget.spec.selector.matchLabels", {"app": "x"})),
    "autoscaler metric": (rule_autoscaler, _set("HorizontalPodAutoscaler.spec.metrics.0.pods.metric.name",
                                                "tokenwire_streams_now")),
    "autoscaler replicas": (rule_autoscaler, _set("Deployment.spec.replicas", 3)),
    "privilege escalation": (rule_restricted, _set(f"{ENGINE}.securityContext.allowPrivilegeEscalation",
                                                   True)),
    "capabilities": (rule_restricted, _set(f"{SIDECAR}.securityContext.capabilities", {"drop": ["NET_RAW"]})),
    "non-root": (rule_restricted, _set(f"{TEMPLATE}.securityContext.runAsNonRoot", ...)),
    "seccomp": (rule_restricted, _set(f"{TEMPLATE}.securityContext.seccompProfile", ...)),
    "burstable": (rule_guaranteed, _set(f"{ENGINE}.resources.limits", {"memory": "8Gi"})),
    "fractional core": (rule_guaranteed, _set(f"{SIDECAR}.resources",
                                              {"requests": {"cpu": "500m", "memory": "512Mi"},
                                               "limits": {"cpu": "500m", "memory": "512Mi"}})),
    "engine readiness": (rule_probes, _set(f"{ENGINE}.readinessProbe", ...)),
    "sidecar liveness": (rule_probes, _set(f"{SIDECAR}.livenessProbe.httpGet.path", "/readyz")),
    "preStop sleeps": (rule_shutdown, _set(f"{ENGINE}.lifecycle.preStop.exec.command", ["sleep", "125"])),
    "short drain wait": (rule_shutdown, _set(f"{ENGINE}.lifecycle.preStop.exec.command.9", "30")),
    "no endpoint wait": (rule_shutdown, _set(f"{ENGINE}.lifecycle.preStop.exec.command.7", "0")),
    "drain elsewhere": (rule_shutdown, _set(f"{ENGINE}.lifecycle.preStop.exec.command.3", "127.0.0.1:8443")),
    "token not mounted": (rule_shutdown, _set(f"{ENGINE}.volumeMounts.name=admin-token.mountPath",
                                              "/etc/other")),
    "short grace": (rule_shutdown, _set(f"{TEMPLATE}.terminationGracePeriodSeconds", 125)),
}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return sidecar_config(load(), tmp_path_factory.mktemp("k8s"))


def _run(rule: Callable[..., list[str]], docs: Docs, config: Any) -> list[str]:
    return rule(docs, config) if rule is rule_shutdown else rule(docs)


@pytest.mark.parametrize("name", sorted({rule.__name__: rule for rule, _ in BREAKS.values()}))
def test_the_example_keeps_every_rule(name: str, config: Any) -> None:
    rule = next(rule for rule, _ in BREAKS.values() if rule.__name__ == name)
    assert _run(rule, load(), config) == []


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_each_rule_names_a_copy_broken_on_purpose(case: str, config: Any) -> None:
    rule, mutate = BREAKS[case]
    docs = copy.deepcopy(load())
    mutate(docs)
    assert _run(rule, docs, config), f"{rule.__name__} did not see the broken {case}"


def test_every_object_the_ingress_and_the_readme_name_is_there() -> None:
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= \
        set(load())
    assert rule_schema(load(INGRESS)) == []
    readme = (ROOT / "README.md").read_text()
    assert "conf/examples/k8s.yaml" in readme
    assert not (ROOT / "conf" / "examples" / "k8s-pod.yaml").exists()


def test_the_engine_exec_probes_run_as_written_against_a_loading_engine(tmp_path: Path) -> None:
    """The engine container's probe commands, run here on a socket that answers as an
    engine does while its model loads: liveness passes, readiness does not."""
    from tokenwire.engine.loading import LoadingServer, bind_unix

    engine = containers(load())["engine"]
    path = str(tmp_path / "engine.sock")
    sock = bind_unix(path)
    server = LoadingServer(sock).start()
    try:
        results = {}
        for probe in ("livenessProbe", "readinessProbe"):
            written = engine[probe]["exec"]["command"]
            command = [arg.replace("/run/tokenwire/engine.sock", path) for arg in written]
            assert command[0] == "python"
            done = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=30,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            results[probe] = done.returncode
        assert results == {"livenessProbe": 0, "readinessProbe": 1}
    finally:
        server.stop()
        sock.close()
