"""Every fenced example in README.md runs here, read from README.md itself.

Each fenced block is one test (``README.md:LINE``). A block is run by the
first rule whose pattern matches it; a block no rule matches FAILS, naming
the rule table to extend, so a new example cannot slip in untested. The
rules match commands and code shapes, not paragraphs, so prose around the
examples can change freely. The rule tables are ``SHELL_RULES`` and
``PYTHON_RULES``; each rule's ``how`` (and its function's docstring) says what
it runs and, for what cannot run here (Docker builds, vLLM, the suite itself),
what stands in and why.

Shell blocks (``sh``, ``bash``, ``shell``, ``console``): backslash-continued
lines are joined, comments dropped, and each command line is matched against
``SHELL_RULES``. Every server a block starts stays up until the block ends
(a README block is "run these side by side", whether a line ends in ``&``
or names a second terminal), then each gets a real request, then all are
stopped with SIGTERM and must exit cleanly. What is rewritten, and why:

* listen addresses (``--listen``, ``--admin-listen``): the port becomes 0 (the
  real one is read from the ready line), so tests never race other processes
  for a port; the host is kept when it is this machine's (``0.0.0.0`` too: an
  admin port there must still demand a token), else it becomes 127.0.0.1;
  clients always connect to 127.0.0.1;
* ports a block serves (``vllm serve --port 8000``) are mapped to the port the
  stand-in really got, and every ``--upstream`` naming that port follows; an
  ``--upstream`` port no line of the block serves gets a fake OpenAI upstream;
* Unix socket paths (``unix:/run/...``) move into the test's temp dir,
  consistently within the block;
* file arguments the reader must supply (``--tls-cert cert.pem --tls-key
  key.pem``) are a trustme certificate for 127.0.0.1, trusted by the client;
  ``--admin-token-file FILE`` is a temp file holding a token;
* leading ``NAME=value`` assignments become that command's environment (the
  tests' own ``TOKENWIRE_*`` variables are never passed on);
* optional ``[...]`` groups in a command line are run included (brackets
  removed), so the optional flags are exercised too;
* ``--config conf/...`` paths are kept: commands run from the repository root.

Python blocks (``python``) are written to a temp module and imported (a fresh
namespace, as ``uvicorn module:app`` does), then ``app`` is served by real
uvicorn on 127.0.0.1 and real requests go through it; see ``PYTHON_RULES``.
Data blocks (``json``, ``toml``, ``yaml``) must parse; ``text`` is prose.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import select
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpcore
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests" / "sidecar"))
from upstreams import FakeUpstream, expected_text  # noqa: E402  (tests/sidecar is not a package)

FAKE_TOKENS = 5  # FakeUpstream's default answer: expected_text(5)
# No "model": the engine serves its one model under its own name; the fakes take anything.
CHAT_BODY = json.dumps({"messages": [{"role": "user", "content": "Hello"}],
                        "stream": True, "max_tokens": 8, "min_tokens": 4}).encode()
SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "console"})
DATA_LANGUAGES = frozenset({"json", "toml", "yaml", "text"})
START_TIMEOUT_S = 120.0  # the engine loads torch and a model on a busy two-core machine
REQUEST_TIMEOUT_S = 60.0
LOCAL_HOSTS = frozenset({"0.0.0.0", "127.0.0.1", "localhost", "[::]", "[::1]"})


class NoRule(AssertionError):
    """A README example that no rule here knows how to run."""


# ---------------------------------------------------------------- reading the README


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    line: int
    """1-based line of the opening fence in README.md."""

    @property
    def where(self) -> str:
        return f"README.md:{self.line} ({self.language or 'no language'})"


_FENCE = re.compile(r"^( *)```([\w+-]*)[^\n]*\n(.*?)^ *```[ \t]*$", re.M | re.S)


def fenced_blocks(markdown: str) -> list[Block]:
    """The fenced blocks of ``markdown``, indented ones (inside list items) dedented."""
    blocks = []
    for match in _FENCE.finditer(markdown):
        indent = len(match.group(1))
        lines = [line[indent:] if line[:indent].strip() == "" else line
                 for line in match.group(3).splitlines()]
        blocks.append(Block(match.group(2).lower(), "\n".join(lines) + "\n",
                            markdown.count("\n", 0, match.start()) + 1))
    return blocks


@dataclass(frozen=True)
class Command:
    argv: list[str]
    text: str
    background: bool
    env: dict[str, str] = field(default_factory=dict)
    """Leading ``NAME=value`` assignments: the command's environment on top of ours."""


def shell_commands(block: Block) -> list[Command]:
    """The command lines of a shell block: continuations joined, comments dropped,
    optional ``[--flag value]`` groups included (brackets removed)."""
    commands = []
    for logical in block.text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\[(\s*--[^\]]*)\]", r"\1", logical)
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        background = argv[-1] == "&"
        if background:
            argv = argv[:-1]
        operators = [a for a in argv if a in ("|", "||", "&&", ";", ">", ">>", "<", "&")]
        if operators:
            raise NoRule(f"{block.where}: {logical.strip()!r} uses {operators}; the shell rules run "
                         "one command per line: split it, or add a rule in tests/test_readme.py")
        env: dict[str, str] = {}
        while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        if not argv:
            raise NoRule(f"{block.where}: {logical.strip()!r} only sets variables; add a rule")
        commands.append(Command(argv, " ".join(argv), background, env))
    return commands


# ---------------------------------------------------------------- real servers and clients


class LoopThread:
    """An event loop in a daemon thread, for the in-process fake upstreams."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float = 15.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class Running:
    """A started server process and what it printed."""

    name: str
    process: subprocess.Popen[bytes]
    ready: re.Match[str]
    output: list[str] = field(default_factory=list)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
                raise AssertionError(f"{self.name} ignored SIGTERM for 20 s") from None
        return self.process.returncode


def _drain(pipe: Any, into: list[str]) -> None:
    for raw in iter(pipe.readline, b""):
        into.append(raw.decode(errors="replace"))


def start_server(name: str, argv: list[str], ready: str, *, on: str, env: dict[str, str]) -> Running:
    """Start ``argv`` from the repository root; return once a line of its ``on``
    stream ("stdout"/"stderr") matches ``ready``. Both streams are drained after."""
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    watched, other = (process.stdout, process.stderr) if on == "stdout" else (process.stderr, process.stdout)
    output: list[str] = []
    threading.Thread(target=_drain, args=(other, output), daemon=True).start()
    pattern = re.compile(ready)
    deadline = time.monotonic() + START_TIMEOUT_S
    buffer = b""
    while True:
        line, newline, rest = buffer.partition(b"\n")
        if newline:
            buffer = rest
            text = line.decode(errors="replace")
            output.append(text + "\n")
            match = pattern.search(text)
            if match:
                threading.Thread(target=_drain, args=(watched, output), daemon=True).start()
                return Running(name, process, match, output)
            continue
        readable, _, _ = select.select([watched], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(watched.fileno(), 65536) if readable else b""
        if not chunk:
            process.kill()
            process.wait(5)
            time.sleep(0.2)  # let the drain thread catch the last lines
            raise AssertionError(f"{name}: no ready line /{ready}/ ("
                                 f"{'exited ' + str(process.returncode) if readable else 'timed out'}):\n"
                                 + "".join(output)[-3000:] + buffer.decode(errors="replace"))
        buffer += chunk


def child_env(**extra: str) -> dict[str, str]:
    """This environment without the reader's ``TOKENWIRE_*`` settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    env.update(extra)
    return env


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    data: list[str]
    """The ``data:`` payloads, in order."""
    ids: list[str]
    raw: bytes

    @property
    def text(self) -> str:
        text = ""
        for payload in self.data:
            if payload != "[DONE]":
                for choice in json.loads(payload).get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
        return text


def request(method: str, url: str, *, body: bytes | None = CHAT_BODY, uds: str | None = None,
            ssl_context: ssl.SSLContext | None = None, headers: dict[str, str] | None = None) -> Answer:
    """One real request with httpcore; a body cut before its chunked terminator raises."""
    sent = {"content-type": "application/json", **(headers or {})} if body is not None else headers or {}
    with httpcore.ConnectionPool(uds=uds, ssl_context=ssl_context) as pool:
        timeout = {"connect": 10.0, "read": REQUEST_TIMEOUT_S, "write": 10.0, "pool": 10.0}
        with pool.stream(method, url, headers=list(sent.items()), content=body,
                         extensions={"timeout": timeout}) as response:
            raw = b"".join(response.iter_stream())
    data: list[str] = []
    ids: list[str] = []
    for event in raw.decode().replace("\r\n", "\n").split("\n\n"):
        for line in event.split("\n"):
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line.startswith("id:"):
                ids.append(line[3:].strip())
    return Answer(response.status, {k.decode().lower(): v.decode() for k, v in response.headers},
                  data, ids, raw)


def assert_whole_stream(answer: Answer, what: str, expected_text: str | None = None) -> None:
    """200, an event stream of chunks ending in exactly one ``[DONE]``."""
    assert answer.status == 200, f"{what}: HTTP {answer.status}: {answer.raw[:1000]!r}"
    assert answer.headers.get("content-type", "").startswith("text/event-stream"), (what, answer.headers)
    assert answer.data and answer.data[-1] == "[DONE]" and answer.data.count("[DONE]") == 1, \
        f"{what}: the stream must end with one [DONE]: {answer.data[-3:]}"
    assert len(answer.data) >= 2, f"{what}: no chunk before [DONE]"
    if expected_text is not None:
        assert answer.text == expected_text, what
    else:
        assert answer.text, f"{what}: no text arrived"


# ---------------------------------------------------------------- shell rules


@dataclass
class ShellRun:
    """One shell block being run: what it started and how README names map to real ones."""

    block: Block
    tmp: Path
    fixture: Callable[[str], Any]
    loop: LoopThread | None = None
    ports: dict[str, int] = field(default_factory=dict)
    """README port -> the port its stand-in really listens on."""
    paths: dict[str, Path] = field(default_factory=dict)
    """README Unix socket path -> the temp path used instead."""
    fake_ports: set[int] = field(default_factory=set)
    servers: list[Running] = field(default_factory=list)
    checks: list[Callable[[], None]] = field(default_factory=list)
    """Requests to send once every line of the block has started."""
    _fakes: list[FakeUpstream] = field(default_factory=list)
    _ca: Any = None

    def fake_upstream(self, readme_port: str) -> int:
        """A fake OpenAI upstream standing in for whatever README serves on ``readme_port``."""
        if self.loop is None:
            self.loop = LoopThread()
        fake = FakeUpstream()
        self.loop.run(fake.start())
        self._fakes.append(fake)
        self.ports[readme_port] = fake.port
        self.fake_ports.add(fake.port)
        return int(fake.port)

    def socket_path(self, readme_path: str) -> Path:
        if readme_path not in self.paths:
            self.paths[readme_path] = self.tmp / f"sock{len(self.paths)}" / Path(readme_path).name
            self.paths[readme_path].parent.mkdir()
        return self.paths[readme_path]

    def certificate(self, kind: str) -> Path:
        """``cert`` or ``key``: a trustme certificate for 127.0.0.1 (one CA per block)."""
        import trustme

        if self._ca is None:
            self._ca = trustme.CA()
            issued = self._ca.issue_cert("127.0.0.1", "localhost")
            (self.tmp / "cert.pem").write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
            issued.private_key_pem.write_to_path(str(self.tmp / "key.pem"))
        return self.tmp / f"{kind}.pem"

    def client_tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self._ca.configure_trust(context)
        return context

    def close(self) -> list[str]:
        """Stop everything, newest first; returns the problems seen."""
        problems = []
        for server in reversed(self.servers):
            try:
                code = server.stop()
            except AssertionError as error:
                problems.append(str(error))
                continue
            if code not in (0, -signal.SIGTERM):
                problems.append(f"{server.name} exited {code} on SIGTERM:\n" + "".join(server.output)[-2000:])
        if self.loop is not None:
            for fake in self._fakes:
                self.loop.run(fake.stop())
            self.loop.close()
        return problems


def _options(argv: list[str], takes_value: frozenset[str]) -> list[tuple[str, str | None]]:
    """``--flag value`` / ``--flag=value`` / positional pairs, in order."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--") and "=" in token:
            name, value = token.split("=", 1)
            pairs.append((name, value))
        elif token in takes_value:
            pairs.append((token, argv[i + 1]))
            i += 1
        else:
            pairs.append((token, None))
        i += 1
    return pairs


def _unflatten(pairs: list[tuple[str, str | None]]) -> list[str]:
    return [item for name, value in pairs for item in ((name,) if value is None else (name, value))]


def _listen(run: ShellRun, value: str) -> str:
    """A listen address with its port made 0; the host kept when this machine has it
    (an admin port on 0.0.0.0 must still demand a token), else 127.0.0.1."""
    if value.startswith("unix:"):
        return f"unix:{run.socket_path(value[5:])}"
    host = value.rpartition(":")[0]
    return f"{host if host in LOCAL_HOSTS else '127.0.0.1'}:0"


def run_sidecar(run: ShellRun, command: Command) -> None:
    """Start it with the rewritten flags, wait for ``ready listen=...``; later, a chat
    stream through it (the fake's exact text, or the engine's) and ``/readyz`` on its admin port."""
    pairs = _options(command.argv[2:], frozenset({
        "--listen", "--admin-listen", "--upstream", "--config", "--tls-cert", "--tls-key",
        "--admin-token-file"}))
    upstream_is_fake = False
    uds_upstream = False
    for index, (name, value) in enumerate(pairs):
        assert value is not None or not name.startswith("--listen"), command.text
        if name in ("--listen", "--admin-listen") and value is not None:
            pairs[index] = (name, _listen(run, value))
        elif name == "--upstream" and value is not None:
            if value.startswith("unix:"):
                assert value[5:] in run.paths, \
                    f"{command.text}: no earlier line of the block serves {value}"
                pairs[index] = (name, f"unix:{run.paths[value[5:]]}")
                uds_upstream = True
            else:
                match = re.fullmatch(r"(https?://)([^/:]+):(\d+)(.*)", value)
                assert match, f"{command.text}: upstream {value!r} has no port; add a rule"
                port = run.ports.get(match.group(3)) or run.fake_upstream(match.group(3))
                upstream_is_fake = port in run.fake_ports
                pairs[index] = (name, f"{match.group(1)}127.0.0.1:{port}{match.group(4)}")
        elif name == "--config" and value is not None:
            assert (ROOT / value).is_file(), f"{command.text}: {value} is not in the repository"
        elif name in ("--tls-cert", "--tls-key") and value is not None:
            pairs[index] = (name, str(run.certificate("cert" if name == "--tls-cert" else "key")))
        elif name == "--admin-token-file" and value is not None:
            token = run.tmp / "admin-token"
            token.write_text("readme-test-token\n")
            pairs[index] = (name, str(token))
    argv = [str(BIN / "tokenwire"), "sidecar", *_unflatten(pairs)]
    ready = r"^ready listen=(\S+):(\d+) scheme=(\w+)(?: admin=(\S+):(\d+))?"
    server = start_server(command.text, argv, ready, on="stdout", env=child_env(**command.env))
    run.servers.append(server)
    scheme, listen_port, admin_port = server.ready.group(3), server.ready.group(2), server.ready.group(5)
    tls = run.client_tls() if scheme == "https" else None

    def check() -> None:
        answer = request("POST", f"{scheme}://127.0.0.1:{listen_port}/v1/chat/completions",
                         ssl_context=tls)
        assert_whole_stream(answer, f"{command.text} (through the sidecar)",
                            expected_text(FAKE_TOKENS) if upstream_is_fake and not uds_upstream else None)
        if admin_port is not None:
            ready = request("GET", f"http://127.0.0.1:{admin_port}/readyz", body=None)
            assert ready.status == 200, f"{command.text}: admin /readyz answered {ready.status}"

    run.checks.append(check)


def run_engine(run: ShellRun, command: Command) -> None:
    """Start it (the model: a tiny one trained for 30 steps, given as
    ``TOKENWIRE_ENGINE_MODEL`` so the argv stays the README's; building the
    default takes minutes), wait for uvicorn's "running on" line; later, a chat
    stream straight from it."""
    pairs = _options(command.argv[2:], frozenset({"--listen", "--config", "--model"}))
    listen_path: Path | None = None
    for index, (name, value) in enumerate(pairs):
        if name == "--listen" and value is not None:
            pairs[index] = (name, _listen(run, value))
            if value.startswith("unix:"):
                listen_path = run.paths[value[5:]]
        elif name == "--config" and value is not None:
            assert (ROOT / value).is_file(), f"{command.text}: {value} is not in the repository"
        elif name == "--model":
            pairs[index] = (name, str(run.fixture("readme_tiny_model")))
    env = child_env(**command.env, TOKENWIRE_ENGINE_MODEL=str(run.fixture("readme_tiny_model")),
                    TOKENWIRE_ENGINE_DEVICE="cpu", OMP_NUM_THREADS="1")
    argv = [str(BIN / "tokenwire"), "engine", *_unflatten(pairs)]
    server = start_server(command.text, argv, r"Uvicorn running on ",
                          on="stderr", env=env)
    run.servers.append(server)

    def check() -> None:
        if listen_path is not None:
            answer = request("POST", "http://engine/v1/chat/completions", uds=str(listen_path))
        else:
            port = re.findall(r"(\d+)\)? \(Press", server.ready.string)[0]
            answer = request("POST", f"http://127.0.0.1:{port}/v1/chat/completions")
        assert_whole_stream(answer, f"{command.text} (straight from the engine)")

    run.checks.append(check)


def fake_vllm(run: ShellRun, command: Command) -> None:
    """No vLLM, GPU or model weights here: a fake OpenAI upstream (tests/sidecar/upstreams.py,
    the same chunk stream; tests/compat replays vLLM's recorded format) takes the port."""
    pairs = _options(command.argv[2:], frozenset({"--port"}))
    port = next((value for name, value in pairs if name == "--port" and value), "8000")
    run.fake_upstream(port)


def check_docker_build(run: ShellRun, command: Command) -> None:
    """No Docker daemon here (and an image build takes minutes): the target is a stage of
    the Dockerfile, the context is the repository root, build args named on the line
    (comments included) are declared ARGs, and hadolint passes. tests/test_deploy_configs.py
    runs each image's ENTRYPOINT + CMD outside Docker."""
    pairs = _options(command.argv[2:], frozenset({"--target", "-t", "--tag", "--build-arg", "-f"}))
    dockerfile = (ROOT / next((v for n, v in pairs if n == "-f" and v), "Dockerfile")).read_text()
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", dockerfile, re.M | re.I))
    target = next((v for n, v in pairs if n == "--target"), None)
    assert target in stages, f"{command.text}: no stage {target!r} in the Dockerfile ({sorted(stages)})"
    assert any(n in ("-t", "--tag") for n, _ in pairs), f"{command.text}: the image gets no name"
    assert [n for n, v in pairs if v is None and not n.startswith("-")] == ["."], command.text
    declared = set(re.findall(r"^ARG\s+(\w+)", dockerfile, re.M))
    raw_line = next(line for line in run.block.text.splitlines() if command.argv[2] in line
                    and f"--target {target}" in line)
    for name in re.findall(r"--build-arg[ =](\w+)", raw_line):
        assert name in declared, f"{command.text}: --build-arg {name} is not an ARG of the Dockerfile"
    lint = subprocess.run([str(BIN / "hadolint") if (BIN / "hadolint").exists() else "hadolint",
                           "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def check_build_images(run: ShellRun, command: Command) -> None:
    """The build itself runs in tests/test_images.py (``--sidecar-only --base debian``:
    minutes, and podman); both images, as the README's first line asks, take minutes
    more and a torch wheel, so here: the script parses and takes every flag the line gives."""
    text = _script(command).read_text()
    accepted = set(re.findall(r"^\s+(--[\w-]+)\)", text, re.M))
    given = [arg for arg in command.argv[1:] if arg.startswith("--")]
    unknown = sorted(set(given) - accepted)
    assert not unknown, f"{command.text}: {unknown} not among the script's flags {sorted(accepted)}"
    assert '"build-images.sh"' in (ROOT / "tests" / "test_images.py").read_text(), \
        "tests/test_images.py no longer runs the script"


def check_main_sh(run: ShellRun, command: Command) -> None:
    """The tour itself runs in tests/sidecar/test_demo.py (``tokenwire demo --quick``);
    running the script here would (re)install the virtualenv. Checked: it parses, it
    sets up the venv with the demo extra and hands its arguments to ``tokenwire demo``,
    and that command answers ``--help``."""
    script = _script(command)
    text = script.read_text()
    assert re.search(r"^scripts/setup-venv\.sh \S*demo", text, re.M), "main.sh must install the demo extra"
    assert re.search(r'^exec \.venv/bin/tokenwire demo "\$@"$', text, re.M), text
    shown = subprocess.run([str(BIN / "tokenwire"), "demo", "--help"], capture_output=True, text=True,
                           timeout=60, env=child_env())
    assert shown.returncode == 0 and "demo" in shown.stdout, shown.stderr


def check_test_sh(run: ShellRun, command: Command) -> None:
    """It is this suite (running it here would recurse): it parses, runs ruff, mypy and
    pytest, and it is exactly what CI runs (.ci/run)."""
    text = _script(command).read_text()
    for step in ("ruff check", "scripts/typecheck.sh", "-m pytest"):
        assert step in text, f"scripts/test.sh no longer runs {step}"
    assert re.search(r"^exec scripts/test\.sh\b", (ROOT / ".ci" / "run").read_text(), re.M), \
        ".ci/run must run scripts/test.sh"


def _script(command: Command) -> Path:
    script = ROOT / command.argv[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{command.argv[0]} is missing or not executable"
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert parsed.returncode == 0, parsed.stderr
    return script


def run_tokenwire_quick(run: ShellRun, command: Command) -> None:
    """Commands that answer and exit: run as written, exit status 0."""
    done = subprocess.run([str(BIN / "tokenwire"), *command.argv[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=child_env(**command.env))
    assert done.returncode == 0, f"{command.text}: exit {done.returncode}\n{done.stdout}{done.stderr}"


def check_install_line(run: ShellRun, command: Command) -> None:
    """A virtualenv or ``pip install`` line (minutes, and a torch wheel): the block is
    one of the README's Install section, which tests/test_install.py runs in a fresh
    virtualenv, as written (tests/readme_install.py reads them for both files)."""
    from readme_install import install_blocks

    lines = {block.line for block in install_blocks()}
    assert run.block.line in lines, (f"{run.block.where}: {command.text!r} is outside the "
                                     "## Install section, the one tests/test_install.py runs")


@dataclass(frozen=True)
class ShellRule:
    pattern: str
    """Matched (``re.match``) against the command line, arguments joined by spaces."""
    how: str
    run: Callable[[ShellRun, Command], None]


SHELL_RULES = (
    ShellRule(r"scripts/main\.sh\b", "static checks + `tokenwire demo --help`; the tour: test_demo.py",
              check_main_sh),
    ShellRule(r"scripts/test\.sh\b", "static checks: it is this suite, and what .ci/run runs", check_test_sh),
    ShellRule(r"tokenwire sidecar\b", "real process, rewritten addresses; a chat stream through it",
              run_sidecar),
    ShellRule(r"tokenwire engine\b", "real process, tiny test model; a chat stream from it", run_engine),
    ShellRule(r"tokenwire (--version|help\b)", "run as written, exit 0", run_tokenwire_quick),
    ShellRule(r"vllm serve\b", "a fake OpenAI upstream on that port", fake_vllm),
    ShellRule(r"docker build\b", "no daemon: target stage, ARGs, hadolint", check_docker_build),
    ShellRule(r"scripts/build-images\.sh\b", "static checks; the build runs in test_images.py",
              check_build_images),
    ShellRule(r"(python3? -m (venv|build)|(\.|source) \S*bin/activate$|pip3? install)\b",
              "in the Install section, which tests/test_install.py runs", check_install_line),
)


def run_shell_block(block: Block, tmp: Path, fixture: Callable[[str], Any]) -> None:
    commands = shell_commands(block)
    assert commands, f"{block.where}: a shell block without a command"
    plan = []
    for command in commands:
        rule = next((r for r in SHELL_RULES if re.match(r.pattern, command.text)), None)
        if rule is None:
            raise NoRule(f"{block.where}: no rule runs {command.text!r}: add one to SHELL_RULES in "
                         "tests/test_readme.py (run it for real, or say why it can't be and check "
                         "what can be)")
        plan.append((rule, command))
    run = ShellRun(block, tmp, fixture)
    try:
        for rule, command in plan:
            rule.run(run, command)
        for check in run.checks:
            check()
    finally:
        problems = run.close()
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- python rules


PLACEHOLDER = re.compile(r"^# \.\.\. your streaming routes \.\.\.[ \t]*$", re.M)
SUPPLIED_ROUTE = '''\
from fastapi.responses import StreamingResponse as _Streaming


@{app}.post("/v1/chat/completions")  # supplied by tests/test_readme.py for the placeholder
async def _readme_route() -> _Streaming:
    async def events():
        for word in ("hello", " world"):
            yield ('data: {{"choices":[{{"index":0,"delta":{{"content":"%s"}}}}]}}\\n\\n' % word).encode()
        yield b"data: [DONE]\\n\\n"
    return _Streaming(events(), media_type="text/event-stream")
'''
SUPPLIED_TEXT = "hello world"
README_REDIS_URL = re.compile(r"redis://127\.0\.0\.1:6379/0")


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """``app`` under real uvicorn on a 127.0.0.1 socket bound here; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def import_block(source: str, block: Block, tmp: Path) -> Any:
    """``source`` as a fresh module, imported as ``uvicorn module:app`` would import it."""
    name = f"readme_example_{block.line}"
    (tmp / f"{name}.py").write_text(source)
    sys.path.insert(0, str(tmp))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp))


def run_placeholder_app(block: Block, tmp: Path, fixture: Callable[[str], Any]) -> None:
    """The test fills ``# ... your streaming routes ...`` with one SSE route on the
    FastAPI app named just above it; ``redis://127.0.0.1:6379/0`` becomes this
    session's real redis-server. Served: the route's stream arrives whole through the
    middleware; with ``resume=True``, a GET ``/v1/streams/{id}`` with ``Last-Event-ID``
    replays the rest from the store."""
    before = block.text[:PLACEHOLDER.search(block.text).start()]  # type: ignore[union-attr]
    names = re.findall(r"^(\w+) = FastAPI\(\)", before, re.M)
    assert names, f"{block.where}: no `NAME = FastAPI()` above the routes placeholder"
    route = SUPPLIED_ROUTE.format(app=names[-1])
    source = PLACEHOLDER.sub(lambda _: route, block.text)
    if "RedisReplayStore" in block.text:
        url = fixture("redis_url")
        source = README_REDIS_URL.sub(lambda _: url, source)
    module = import_block(source, block, tmp)
    from tokenwire.middleware import TokenWireMiddleware

    assert isinstance(module.app, TokenWireMiddleware), f"{block.where}: `app` is not the middleware"
    with serve(module.app) as base:
        answer = request("POST", f"{base}/v1/chat/completions")
        assert_whole_stream(answer, block.where, SUPPLIED_TEXT)
        if module.app.config.resume:
            stream_id = answer.headers.get("x-tokenwire-stream-id")
            assert stream_id and answer.ids, f"{block.where}: resume on, but no stream id"
            rest = request("GET", f"{base}/v1/streams/{stream_id}", body=None,
                           headers={"last-event-id": answer.ids[0]})
            assert rest.status == 200 and rest.data == answer.data[1:], (rest.status, rest.data)
    if "RedisReplayStore" in block.text:
        import redis

        client = redis.Redis.from_url(fixture("redis_url"))
        try:
            assert client.dbsize() > 0, f"{block.where}: nothing reached Redis"
        finally:
            client.close()


def run_complete_app(block: Block, tmp: Path, fixture: Callable[[str], Any]) -> None:
    """Imported as written, served as written (``uvicorn module:app``); every route the
    block declares gets a real request, and its stream must arrive whole through the
    middleware: the chunks, one ``[DONE]``, the chunked terminator."""
    module = import_block(block.text, block, tmp)
    routes = re.findall(r'^@\w+\.(post|get)\("([^"]+)"\)', block.text, re.M)
    with serve(module.app) as base:
        for method, path in routes:
            answer = request(method.upper(), base + path, body=CHAT_BODY if method == "post" else None)
            assert_whole_stream(answer, f"{block.where} {method.upper()} {path}")


def run_grpc_client(block: Block, tmp: Path, fixture: Callable[[str], Any]) -> None:
    """A gRPC client example, run as written against a real sidecar (in this process,
    its port put where the block says ``localhost:8080``) in front of a fake OpenAI
    upstream: what it prints must be the whole answer's text."""
    from tokenwire.sidecar import Sidecar, SidecarConfig

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    fake = FakeUpstream()
    run(fake.start())
    sidecar = Sidecar(SidecarConfig(listen="127.0.0.1:0", upstream=(fake.url,), log_file=""))
    try:
        run(sidecar.start())
        source = block.text.replace("localhost:8080", f"127.0.0.1:{sidecar.address[1]}")
        assert source != block.text, f"{block.where}: the client names no localhost:8080"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            import_block(source, block, tmp)
        assert printed.getvalue() == expected_text(FAKE_TOKENS), (block.where, printed.getvalue())
    finally:
        run(sidecar.shutdown())
        run(fake.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@dataclass(frozen=True)
class PythonRule:
    pattern: str
    """Searched (``re.search``, multiline) in the block."""
    how: str
    run: Callable[[Block, Path, Callable[[str], Any]], None]


PYTHON_RULES = (
    PythonRule(PLACEHOLDER.pattern, "routes placeholder filled by the test; served; stream (+ resume)",
               run_placeholder_app),
    PythonRule(r'^@\w+\.(post|get)\("/', "served as written; each declared route streamed whole",
               run_complete_app),
    PythonRule(r"grpc\.insecure_channel\(", "run against a real sidecar; prints the whole answer",
               run_grpc_client),
)


# ---------------------------------------------------------------- the tests


def run_block(block: Block, tmp: Path, fixture: Callable[[str], Any]) -> None:
    if block.language in SHELL_LANGUAGES:
        run_shell_block(block, tmp, fixture)
    elif block.language in ("python", "py"):
        rule = next((r for r in PYTHON_RULES if re.search(r.pattern, block.text, re.M)), None)
        if rule is None:
            raise NoRule(f"{block.where}: no rule runs this Python block: add one to PYTHON_RULES in "
                         "tests/test_readme.py (what it must serve or return, checked for real)")
        rule.run(block, tmp, fixture)
    elif block.language in DATA_LANGUAGES:
        if block.language == "json":
            json.loads(block.text)
        elif block.language == "toml":
            import tomllib

            tomllib.loads(block.text)
        elif block.language == "yaml":
            import yaml

            yaml.safe_load(block.text)
    else:
        raise NoRule(f"{block.where}: fenced blocks must say their language (python, sh, or "
                     f"{', '.join(sorted(DATA_LANGUAGES))} for ones that are not run); for another "
                     "language add a rule in tests/test_readme.py")


BLOCKS = fenced_blocks(README.read_text())


@pytest.fixture(scope="module", autouse=True)
def _tiny_model_build(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str] | None]:
    """Starts building the engine's tiny model (30 training steps, in a child process:
    this one never loads torch) when this module starts, if an engine block is selected,
    so the build overlaps the blocks before it."""
    wanted = False
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec is not None:
            block = callspec.params.get("block")
            wanted = wanted or (isinstance(block, Block) and _is_slow(block))
    if not wanted or importlib.util.find_spec("torch") is None:
        yield None
        return
    cache = tmp_path_factory.mktemp("tokenwire-cache")
    script = ("import sys, torch; torch.set_num_threads(1)\n"
              "from pathlib import Path\n"
              "from tokenwire.engine.tiny import TinySpec, ensure_tiny_model\n"
              "print(ensure_tiny_model(TinySpec(train_steps=30, batch_size=4, sequence_length_tokens=64), "
              "Path(sys.argv[1]), log=False))")
    process = subprocess.Popen([sys.executable, "-c", script, str(cache)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=child_env(OMP_NUM_THREADS="1"))
    yield process
    if process.poll() is None:
        process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def readme_tiny_model(_tiny_model_build: subprocess.Popen[str] | None) -> Path:
    """The tiny model folder, once its build finished."""
    pytest.importorskip("torch")
    assert _tiny_model_build is not None, "the engine block was not selected when the module started"
    out, err = _tiny_model_build.communicate(timeout=600)
    assert _tiny_model_build.returncode == 0, err[-3000:]
    return Path(out.strip().splitlines()[-1])


def _is_slow(block: Block) -> bool:
    engine = re.search(r"^\s*tokenwire engine\b", block.text, re.M)
    return block.language in SHELL_LANGUAGES and engine is not None


@pytest.mark.slow
@pytest.mark.parametrize("block", [
    pytest.param(b, id=f"line{b.line}-{b.language}", marks=[pytest.mark.slow] if _is_slow(b) else [])
    for b in BLOCKS])
@pytest.mark.timeout(600)
def test_readme_example_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    run_block(block, tmp_path, request.getfixturevalue)


def test_the_readme_has_the_examples_this_file_expects() -> None:
    """A parsing slip must not turn into zero tests: each language the README uses today is found."""
    languages = [b.language for b in BLOCKS]
    assert languages.count("python") >= 2 and languages.count("sh") >= 4, languages


@pytest.mark.parametrize(("language", "text", "hint"), [
    ("sh", "curl -N http://127.0.0.1:8080/v1/chat/completions\n", "SHELL_RULES"),
    ("sh", "tokenwire sidecar --listen 127.0.0.1:0 | tee log\n", "one command per line"),
    ("python", "print('hello')\n", "PYTHON_RULES"),
    ("", "tokenwire sidecar\n", "must say their language"),
    ("rust", "fn main() {}\n", "add a rule"),
])
def test_an_example_without_a_rule_fails_and_says_where_to_add_one(language: str, text: str, hint: str,
                                                                    tmp_path: Path) -> None:
    with pytest.raises(NoRule, match=hint):
        run_block(Block(language, text, 1), tmp_path, lambda name: pytest.fail(f"fixture {name} asked for"))


def test_fences_inside_list_items_are_found_and_dedented() -> None:
    markdown = "- a bullet:\n\n  ```python\n  x = 1\n  if x:\n      y = 2\n  ```\n\n```sh\nls\n```\n"
    blocks = fenced_blocks(markdown)
    assert [(b.language, b.text, b.line) for b in blocks] == [
        ("python", "x = 1\nif x:\n    y = 2\n", 3), ("sh", "ls\n", 9)]


def test_shell_lines_are_joined_and_optional_groups_included() -> None:
    block = Block("sh", "tokenwire sidecar --listen 0.0.0.0:8080 \\\n    [--tls-cert c.pem --tls-key k.pem]"
                        "  # note\nTOKENWIRE_ENGINE_DEVICE=cpu tokenwire engine --listen unix:/x.sock &\n", 1)
    commands = shell_commands(block)
    assert [c.argv for c in commands] == [
        ["tokenwire", "sidecar", "--listen", "0.0.0.0:8080", "--tls-cert", "c.pem", "--tls-key", "k.pem"],
        ["tokenwire", "engine", "--listen", "unix:/x.sock"]]
    assert [c.background for c in commands] == [False, True]
    assert [c.env for c in commands] == [{}, {"TOKENWIRE_ENGINE_DEVICE": "cpu"}]
