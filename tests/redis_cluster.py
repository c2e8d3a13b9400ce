"""Test helper: a local Redis Cluster of three masters (redis-server --cluster-enabled yes, three
times, joined by redis-cli --cluster create), started for the test session on free ports."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def _free_port_pair() -> int:
    """A port p with p and its cluster bus port (p + 10000) both free."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclass
class LocalCluster:
    ports: list[int]
    folder: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _cli(port: int, *args: str, timeout: float = 30) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                          timeout=timeout, check=True).stdout


def start_cluster(masters: int = 3) -> LocalCluster:
    """Start and join the nodes; returns once every node says cluster_state:ok. Raises
    RuntimeError (with what failed) when redis-server / redis-cli are missing or it does not
    come up within a minute."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError("redis-server and redis-cli are needed for the Redis Cluster tests")
    cluster = LocalCluster([], Path(tempfile.mkdtemp(prefix="fairway-cluster-")))
    try:
        for i in range(masters):
            port = _free_port_pair()
            node_dir = cluster.folder / str(i)
            node_dir.mkdir()
            cluster.ports.append(port)
            cluster.processes.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--dir", str(node_dir), "--save", "", "--appendonly", "no",
                 "--cluster-node-timeout", "5000", "--protected-mode", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        for port in cluster.ports:
            while True:
                try:
                    if _cli(port, "PING", timeout=5).strip() == "PONG":
                        break
                except subprocess.SubprocessError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Redis node on {port} did not start")
                time.sleep(0.05)
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
                        "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60,
                       check=True)
        for port in cluster.ports:
            while "cluster_state:ok" not in _cli(port, "CLUSTER", "INFO", timeout=5):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Redis Cluster node on {port} did not reach cluster_state:ok")
                time.sleep(0.1)
        return cluster
    except BaseException:
        cluster.stop()
        raise


async def flush_scripts(url: str) -> None:
    """SCRIPT FLUSH on the server at url or, when it is a cluster node, on every master (as a
    restart of each would)."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, decode_responses=True)
    try:
        info = await client.info("cluster")
        nodes = [url]
        if info.get("cluster_enabled"):
            nodes = [f"redis://{host}:{port}/0" for _, _, (host, port, *_), *_ in await client.execute_command(
                "CLUSTER", "SLOTS")]
    finally:
        await client.aclose()
    for node in nodes:
        one = aioredis.from_url(node)
        try:
            await one.script_flush()
        finally:
            await one.aclose()
