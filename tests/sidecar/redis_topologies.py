"""Real Redis topologies for the tests: a Sentinel setup (a master, a replica, one
sentinel) and a 3-master Cluster, each made of Debian's ``redis-server``
processes on free ports (``--sentinel`` runs the same binary as a sentinel).

Each is ready when its servers say so (PING, ``master_link_status:up``, the
sentinel naming the master and knowing the replica, ``cluster_state:ok`` on
every node): the helpers poll those answers, never sleep a fixed time.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

MASTER_NAME = "tw-master"
HASH_SLOTS = 16384


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(what: str, ready: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll ``ready`` (a question to a server: nothing else to wait on) until it is true."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except (redis.RedisError, OSError):
            pass  # not up yet
        if time.monotonic() > deadline:
            raise AssertionError(f"redis topology: {what} not ready in {timeout_s} s")
        time.sleep(0.02)


@dataclass
class Server:
    """One ``redis-server`` process (a data node or a sentinel)."""

    directory: Path
    args: list[str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, *self.args, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(f"redis-server :{self.port}", lambda: self.client().ping() is True)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


_DATA = ["--save", "", "--appendonly", "no"]


@dataclass
class SentinelSetup:
    """A master, its replica and one sentinel watching them (quorum 1)."""

    directory: Path
    master: Server = field(init=False)
    replica: Server = field(init=False)
    sentinel: Server = field(init=False)

    def __post_init__(self) -> None:
        self.master = Server(self.directory / "master", list(_DATA))
        self.replica = Server(self.directory / "replica", list(_DATA))
        self.sentinel = Server(self.directory / "sentinel", [])

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{MASTER_NAME}/0"

    def start(self) -> None:
        self.master.start()
        self.replica.args += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start()
        wait_until("the replica's link", lambda: self.replica.client().info("replication")
                   ["master_link_status"] == "up")
        # A sentinel rewrites its own config file: one of its own, in its folder.
        self.sentinel.directory.mkdir(parents=True, exist_ok=True)
        conf = self.sentinel.directory / "sentinel.conf"
        conf.write_text(f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 1\n"
                        f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
                        f"sentinel failover-timeout {MASTER_NAME} 10000\n")
        self.sentinel.args = [str(conf), "--sentinel"]
        self.sentinel.start()
        wait_until("the sentinel's view", lambda: self.master_port() == self.master.port
                   and any(int(r["port"]) == self.replica.port and "s_down" not in r["flags"]
                           for r in self.sentinel.client().sentinel_slaves(MASTER_NAME)))

    def master_port(self) -> int:
        _, port = self.sentinel.client().sentinel_get_master_addr_by_name(MASTER_NAME)
        return int(port)

    def wait_for_the_promotion(self, timeout_s: float = 30.0) -> None:
        """After the master's death: the failover is over (the sentinel names the
        replica, with the flags of a master in good health: what redis-py's
        ``discover_master`` asks for), and the replica says it is the master."""

        def promoted() -> bool:
            state = self.sentinel.client().sentinel_master(MASTER_NAME)
            return (int(state["port"]) == self.replica.port and state["flags"] == "master"
                    and self.replica.client().info("replication")["role"] == "master")

        wait_until("the failover", promoted, timeout_s)

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            server.stop()


@dataclass
class ClusterSetup:
    """Three masters sharing the 16384 slots, no replicas."""

    directory: Path
    nodes: list[Server] = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = []
        for n in range(3):
            folder = self.directory / f"node{n}"
            # The bus port on a free port of its own (the default, port + 10000, may be taken).
            self.nodes.append(Server(folder, [*_DATA, "--cluster-enabled", "yes", "--cluster-config-file",
                                              str(folder / "nodes.conf"), "--cluster-port", str(free_port()),
                                              "--cluster-node-timeout", "1000"]))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[:2])

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        bounds = [round(HASH_SLOTS * n / len(self.nodes)) for n in range(len(self.nodes) + 1)]
        for node, start, end in zip(self.nodes, bounds, bounds[1:], strict=False):
            node.client().execute_command("CLUSTER ADDSLOTSRANGE", start, end - 1)
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", node.port,
                                  node.args[node.args.index("--cluster-port") + 1])
        wait_until("cluster_state:ok", self.healthy)

    def healthy(self) -> bool:
        for node in self.nodes:
            info = node.client().cluster("INFO")  # redis-py parses it into a dict of strings
            known = str(info.get("cluster_known_nodes"))
            if info.get("cluster_state") != "ok" or known != str(len(self.nodes)):
                return False
        return True

    def node_of(self, key: str) -> Server:
        slot = int(self.nodes[0].client().execute_command("CLUSTER KEYSLOT", key))
        bounds = [round(HASH_SLOTS * n / len(self.nodes)) for n in range(len(self.nodes) + 1)]
        return next(node for node, start, end in zip(self.nodes, bounds, bounds[1:], strict=False)
                    if start <= slot < end)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
