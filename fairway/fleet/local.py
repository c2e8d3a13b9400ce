"""LocalBackend: replicas as `fairway replica` processes on this machine (as `fairway up` starts
them), each with its health endpoint on a port of its own (fairway/replica/health.py: nothing
listens while the model loads, /ready 200 while it serves, 503 once it drains). A drain is a
SIGTERM (the replica's graceful drain); a replica SIGTERMed by anyone else (a spot reclaim's
notice, an operator) answers 503 and no longer counts, so the policy replaces it first.

Replicas on one machine share its CPUs: each gets `threads` of them (OMP_NUM_THREADS), by
default this machine's CPUs over max_replicas. Left to itself every replica runs a thread per
CPU, and the fleet's replicas then oversubscribe the CPUs: the engine's kernels are OpenMP
regions that end only when their last thread does, so a replica whose thread is descheduled for
another replica's (or a loading replica's) waits a whole time slice per region, many times a
step: a replica starting beside a lightly loaded one multiplied that one's TTFT many times over
(bench/README.md, "The local fleet's CPUs")."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fairway.fleet.backend import Backend, BackendState
from fairway.up import fairway_process, send_signal, wait_all


@dataclass
class _Replica:
    id: str
    port: int
    proc: subprocess.Popen
    ready: bool = False
    reclaimed: bool = False  # its /ready said draining (503), and not because we drained it


@dataclass
class LocalBackend(Backend):
    redis: str
    namespace: str = "fairway:"
    replica_args: list[str] = field(default_factory=list)  # passed on to every `fairway replica`
    log_dir: Path | None = None  # each replica's output to ID.log here; None: this process's
    host: str = "127.0.0.1"
    max_replicas: int = 1  # the most this backend will run at once: they share this machine's CPUs
    threads: int | None = None  # CPU threads per replica; None: this machine's CPUs over max_replicas
    name: str = "local"
    _run: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    _started: int = 0
    _replicas: dict[str, _Replica] = field(default_factory=dict)
    _leaving: list[_Replica] = field(default_factory=list)  # drained by us, not yet exited
    _http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=1.0))

    async def state(self) -> BackendState:
        self._reap()
        await asyncio.gather(*(self._probe(r) for r in self._replicas.values()))
        counted = [r for r in self._replicas.values() if not r.reclaimed]
        return BackendState(desired=len(counted), ready=sum(r.ready for r in counted))

    async def add(self, n: int) -> None:
        for _ in range(n):
            replica_id = f"fleet-{self._run}-{self._started}"
            self._started += 1
            port = _free_port(self.host)
            if self.log_dir:  # (the README's `--log-dir .fairway/fleet` need not exist yet)
                self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{replica_id}.log", "ab") if self.log_dir else None  # noqa: SIM115
            proc = fairway_process("replica", "--redis", self.redis, "--namespace", self.namespace, "--replica-id",
                                   replica_id, "--health-host", self.host, "--health-port", str(port),
                                   *self.replica_args, log=log,
                                   env={"OMP_NUM_THREADS": str(self.threads_per_replica)})
            if log is not None:
                log.close()  # the child has its own descriptor
            self._replicas[replica_id] = _Replica(replica_id, port, proc)

    async def drain(self, replica_id: str | None) -> None:
        candidates = [r for r in self._replicas.values() if not r.reclaimed]
        if not candidates:
            return
        chosen = self._replicas.get(replica_id or "") or candidates[-1]  # else the newest
        send_signal(chosen.proc, signal.SIGTERM)
        self._leaving.append(self._replicas.pop(chosen.id))

    @property
    def threads_per_replica(self) -> int:
        if self.threads is not None:
            return self.threads
        return max(1, len(os.sched_getaffinity(0)) // max(1, self.max_replicas))

    @property
    def ids(self) -> list[str]:
        """The replicas it started that are still counted (for tests and the log)."""
        return list(self._replicas)

    def process(self, replica_id: str) -> subprocess.Popen:
        return self._replicas[replica_id].proc

    async def close(self) -> None:
        await self._http.aclose()

    def stop(self, grace_s: float = 45.0) -> None:
        """Drain every replica (SIGTERM) and wait for them, killing what outlives grace_s."""
        procs = [r.proc for r in (*self._replicas.values(), *self._leaving)]
        for proc in procs:
            send_signal(proc, signal.SIGTERM)
        wait_all(procs, grace_s)
        self._replicas.clear()
        self._leaving.clear()

    def _reap(self) -> None:
        self._leaving = [r for r in self._leaving if r.proc.poll() is None]
        for replica in [r for r in self._replicas.values() if r.proc.poll() is not None]:
            del self._replicas[replica.id]  # exited (drained, crashed): no longer counted

    async def _probe(self, replica: _Replica) -> None:
        try:
            status = (await self._http.get(f"http://{self.host}:{replica.port}/ready")).status_code
        except httpx.HTTPError:
            replica.ready = False  # still loading (nothing listens yet), or too busy: counted, not ready
            return
        replica.ready = status == 200
        replica.reclaimed = replica.reclaimed or status == 503  # up, and draining: not by us


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
