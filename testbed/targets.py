"""The processes a benchmark runs against, started one way for every bench: the
fake upstream (``sse_load.py upstream``), the tokenwire sidecar, nginx
(plaintext, or TLS with HTTP/2), a throw-away certificate, the tiny model and
``tokenwire up`` serving it; and what a bench reads of a running process
(``/proc``: RSS, CPU time).

Each start is a context manager that waits until the process is ready and ends
it (its whole session: a supervisor's workers, nginx's master and workers) when
the block ends. The tests use :func:`read_line`, :func:`tiny_model` and
:func:`tokenwire_up` too (``tests/conftest.py`` puts the repository root on their path).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LOAD = str(ROOT / "bench" / "sse_load.py")
SIDECAR_DEFAULTS = {"--log-file": "", "--max-connections": "20000"}
"""What every bench sidecar runs with unless its flags say otherwise: no access
log file (its writes would be measured too) and a connection cap no bench meets."""


# ---------------------------------------------------------------- waiting


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} not listening")


def read_line(proc: subprocess.Popen[Any], what: str, timeout_s: float = 30.0) -> str:
    """The next line ``proc`` writes to its stdout pipe, within ``timeout_s``;
    kills it and raises ``RuntimeError`` when it exits or stays silent.

    Reads the pipe's descriptor a byte at a time (no buffered read-ahead), so a
    silent process cannot hang the caller and nothing after the line is taken."""
    stdout: IO[Any] | None = proc.stdout
    assert stdout is not None
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
        byte = os.read(stdout.fileno(), 1) if ready else b""
        if not byte:
            proc.kill()
            proc.wait(5)
            raise RuntimeError(f"{what} did not start (rc={proc.returncode}, read {line!r})")
        line += byte
    return line.decode()


def wait_ready(proc: subprocess.Popen[Any], what: str, timeout_s: float = 60) -> str:
    """Reads ``proc``'s stdout up to its line saying ``ready``; that line."""
    deadline = time.monotonic() + timeout_s
    while True:
        line = read_line(proc, what, max(0.0, deadline - time.monotonic()))
        if "ready" in line.lower():
            return line


@contextlib.contextmanager
def process(cmd: list[str], what: str, *, ready_line: bool = True, env: dict[str, str] | None = None,
            cwd: str | None = None, ready_timeout_s: float = 60) -> Iterator[subprocess.Popen[str]]:
    """``cmd`` in a session of its own, ready (``ready_line``: once it printed a
    line saying ``ready``), ended with its whole session."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=env, cwd=cwd)
    try:
        if ready_line:
            wait_ready(proc, what, ready_timeout_s)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def own_env(**extra: str) -> dict[str, str]:
    """This environment without ``TOKENWIRE_*`` (a user's setting must not
    change what a bench runs), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}, **extra}


# ---------------------------------------------------------------- targets


def fake_upstream(port: int) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """``sse_load.py upstream`` on ``port``: paced OpenAI chunks stamped with their send time."""
    return process([PY, LOAD, "upstream", "--port", str(port)], "upstream")


@dataclass(frozen=True, slots=True)
class RunningSidecar:
    process: subprocess.Popen[str]
    port: int
    admin_port: int | None

    @property
    def pid(self) -> int:
        return self.process.pid


@contextlib.contextmanager
def sidecar(listen_port: int, upstream: int | Sequence[str], workers: int = 1, code: str | None = None, *,
            flags: Sequence[str] = (), admin: bool = True, what: str = "sidecar", wrapper: Sequence[str] = (),
            cwd: str | None = None, ready_timeout_s: float = 60) -> Iterator[RunningSidecar]:
    """``tokenwire sidecar`` on ``listen_port`` (0: a port it picks, read from its
    ready line) in front of ``upstream`` (a local port, or upstream URLs), with
    an admin port when ``admin``, ``SIDECAR_DEFAULTS`` and ``flags``.

    ``code``: a directory holding another ``tokenwire`` package (an older
    checkout, for a before/after comparison in one run), put first on the path
    and run from (``python -m`` puts the working directory first on the path: a
    checkout's own ``tokenwire/`` would win over ``PYTHONPATH``); else ``cwd``.
    ``wrapper``: a command the sidecar runs under (``valgrind ...``)."""
    urls = [f"http://127.0.0.1:{upstream}"] if isinstance(upstream, int) else list(upstream)
    cmd = [*wrapper, PY, "-m", "tokenwire.sidecar", "sidecar", "--listen", f"127.0.0.1:{listen_port}",
           *(part for url in urls for part in ("--upstream", url)),
           *(["--admin-listen", "127.0.0.1:0"] if admin else []),
           *(["--workers", str(workers)] if workers > 1 else []),
           *(part for flag, value in SIDECAR_DEFAULTS.items() if flag not in flags for part in (flag, value)),
           *flags]
    with process(cmd, what, ready_line=False, env=own_env(**({} if code is None else {"PYTHONPATH": code})),
                 cwd=code or cwd) as proc:
        # "ready listen=HOST:PORT admin=HOST:PORT ...": the ports it really bound.
        ready = wait_ready(proc, what, ready_timeout_s)
        fields = dict(part.split("=", 1) for part in ready.split()[1:] if "=" in part)
        yield RunningSidecar(proc, int(fields["listen"].rsplit(":", 1)[1]),
                             int(fields["admin"].rsplit(":", 1)[1]) if "admin" in fields else None)


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        subprocess.run([str(ROOT / "scripts" / "system-deps.sh"), "nginx"], check=True)
        found = shutil.which("nginx") or "/usr/sbin/nginx"
    return found


@contextlib.contextmanager
def nginx(listen_port: int, upstream_port: int, workers: int = 1, *, tls: tuple[str, str] | None = None,
          h2c: bool = False, max_streams: int | None = None, wrapper: Sequence[str] = (),
          master_process: bool = True,
          ready_timeout_s: float = 30) -> Iterator[subprocess.Popen[str]]:
    """nginx as a streaming proxy (``proxy_buffering off``, upstream keepalive);
    with ``tls`` (certificate and key files) it listens with TLS and HTTP/2,
    allowing ``max_streams`` concurrent streams per connection; with ``h2c``
    it takes HTTP/2 in plaintext (prior knowledge) and nothing else (nginx
    1.22: no HTTP/1.1 on that port), with ``max_streams`` too. Under
    ``wrapper`` (``valgrind ...``) with ``master_process`` off, the one process
    is the one that serves."""
    prefix = Path(tempfile.mkdtemp(prefix="tokenwire-nginx-"))
    (prefix / "logs").mkdir()
    listen = f"127.0.0.1:{listen_port}{' ssl http2' if tls else ' http2' if h2c else ''} backlog=8192"
    listen += " reuseport" if workers > 1 else ""
    streams = f"        http2_max_concurrent_streams {max_streams};\n" if max_streams and (tls or h2c) else ""
    server_tls = streams if tls is None else (
        f"ssl_certificate {tls[0]};\n        ssl_certificate_key {tls[1]};\n" + streams)
    conf = prefix / "nginx.conf"
    conf.write_text(f"""
worker_processes {workers};
daemon off;
master_process {"on" if master_process else "off"};
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 32768; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    upstream engine {{ server 127.0.0.1:{upstream_port}; keepalive 256; }}
    server {{
        listen {listen};
        {server_tls}
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 3600s;
        }}
    }}
}}
""")
    try:
        with process([*wrapper, nginx_binary(), "-p", str(prefix), "-c", str(conf)], "nginx",
                     ready_line=False) as proc:
            wait_port(listen_port, ready_timeout_s)
            yield proc
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


def nginx_worker_pid(master: subprocess.Popen[str]) -> int:
    children = Path(f"/proc/{master.pid}/task/{master.pid}/children").read_text().split()
    return int(children[0]) if children else master.pid


def certificate(directory: Path) -> tuple[str, str]:
    """A trustme certificate for ``localhost`` and ``127.0.0.1``: (cert file, key file)."""
    import trustme

    cert = trustme.CA().issue_cert("localhost", "127.0.0.1")
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_path))
    return str(cert_path), str(key_path)


def tiny_model(cache_dir: Path, timeout_s: float = 600) -> Path:
    """A quickly trained tiny model (``tokenwire.engine.tiny``) under ``cache_dir``;
    its folder. Built in a child process, so the caller never loads torch itself."""
    script = ("import sys; from pathlib import Path; "
              "from tokenwire.engine.tiny import TinySpec, ensure_tiny_model; "
              "print(ensure_tiny_model(TinySpec(train_steps=30, batch_size=4, "
              "sequence_length_tokens=64), Path(sys.argv[1]), log=False))")
    built = subprocess.run([PY, "-c", script, str(cache_dir)], capture_output=True, text=True,
                           timeout=timeout_s, check=True)
    return Path(built.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def tokenwire_up(model_dir: Path, cache_dir: Path, log_path: Path, *, env: dict[str, str] | None = None,
                 timeout_s: float = 300) -> Iterator[RunningSidecar]:
    """``tokenwire up --verbose`` as a user runs it (the engine on a Unix socket,
    the sidecar in front) serving ``model_dir``, once its banner says it is up;
    stopped with SIGTERM at the end. Both children's log lines go to ``log_path``
    (:func:`child_lines` reads them). The environment is this one without
    ``TOKENWIRE_*`` and ``OTEL_*``, with ``TOKENWIRE_CACHE_DIR`` and ``env``."""
    port, admin_port = free_port(), free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENWIRE_", "OTEL_"))}
    environment.update({"TOKENWIRE_CACHE_DIR": str(cache_dir), **(env or {})})
    with log_path.open("w") as log:
        up = subprocess.Popen([PY, "-m", "tokenwire.sidecar", "up", "--listen", f"127.0.0.1:{port}",
                               "--admin-listen", f"127.0.0.1:{admin_port}", "--model", str(model_dir),
                               "--verbose"], stdout=subprocess.PIPE, stderr=log, text=True, env=environment)
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in up.stdout:  # the banner comes once both children are ready
            if "tokenwire is up" in line or time.monotonic() > deadline:
                break
        if up.poll() is not None:
            raise RuntimeError(f"tokenwire up exited ({up.returncode}): {log_path.read_text()[-3000:]}")
        yield RunningSidecar(up, port, admin_port)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


def child_lines(text: str, child: str) -> list[str]:
    """The lines ``tokenwire up --verbose`` echoed from ``child`` (``sidecar``,
    ``engine``), its ``[child] `` prefix taken off."""
    prefix = f"[{child}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


# ---------------------------------------------------------------- /proc


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and all its descendants (a supervisor and its
    workers, nginx's master and workers)."""
    total = cpu_seconds(pid)
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                total += tree_cpu_seconds(int(child))
    return total
