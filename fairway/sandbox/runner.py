"""The sandbox's interface, and its runner: Python code run under bubblewrap, in this process's
event loop, many runs at once.

Each run gets an unprivileged uid of its own (from a pool, least recently used first) before
anything else: the process limit counts per uid, so a fork bomb exhausts its own run's processes
and nobody else's, and no run can touch another's files or processes. Then rlimits (prlimit),
then bubblewrap (bwrap.py) with the seccomp filter (seccomp_filter.py). Where the host allows it,
the run's whole process tree is in a memory cgroup of its own first (cgroup.py), so its processes
together stay within memory_mb. The runner bounds wall time and output itself and kills the run's
whole process tree when either is exceeded.

Without bubblewrap, the seccomp filter or the interpreter, `unavailable` says why and run()
refuses: code never runs unisolated.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fairway.sandbox.bwrap import bwrap_args, prlimit_args, setpriv_args
from fairway.sandbox.cgroup import CgroupParent, RunGroup, find_parent, join_args, sweep
from fairway.sandbox.limits import MIB, RunResult, SandboxLimits
from fairway.sandbox.seccomp_filter import SeccompUnavailable, filter_bpf

log = logging.getLogger(__name__)

DEFAULT_PYTHON = "/usr/bin/python3"  # the system's: the sandbox sees /usr only, never a virtualenv
_READ = 64 * 1024


class Sandbox(ABC):
    """Runs untrusted Python code, isolated and bounded, for many tenants at once."""

    @abstractmethod
    async def check(self) -> str | None:
        """None when code can run; else why not (said to users: the tool is off)."""

    @abstractmethod
    async def run(self, code: str, limits: SandboxLimits | None = None, tenant: str = "") -> RunResult:
        """Run the code to its end or a limit. Never raises for what the code does; a result with
        error set when it could not run at all."""

    async def close(self) -> None:  # noqa: B027  (the local runner holds nothing to close)
        """Release what the sandbox holds (a channel, for the service's client)."""


@dataclass
class RunnerSettings:
    python: str = DEFAULT_PYTHON
    max_concurrent: int = 8  # runs at once; more wait their turn
    per_tenant: int = 4  # runs of one tenant at once: one tenant's burst cannot take every slot
    uid_base: int = 200_000  # the pool of uids runs take, outside any real user's range
    uid_count: int = 1024
    ceiling: SandboxLimits = SandboxLimits()  # no request gets more than this
    cgroup: str | None = None  # the parent of the runs' memory cgroups; None: found (cgroup.py)
    memory_cgroups: bool = True  # False: per-process memory bounds only (bench/sandbox.py's peer)


@dataclass
class _Tenant:
    slots: asyncio.Semaphore
    users: int = 0  # runs running or waiting


class LocalSandbox(Sandbox):
    def __init__(self, settings: RunnerSettings | None = None) -> None:
        self.settings = settings or RunnerSettings()
        self._slots = asyncio.Semaphore(self.settings.max_concurrent)
        self._tenants: dict[str, _Tenant] = {}
        self._uids = collections.deque(range(self.settings.uid_base, self.settings.uid_base + self.settings.uid_count))
        self._reason: str | None = None
        self._probed = False
        self._as_root = os.geteuid() == 0
        # Each run's memory cgroup goes here; None: per-process bounds only (memory_bound says why).
        self.cgroup: CgroupParent | None
        self.cgroup, self.memory_bound = (find_parent(self.settings.cgroup) if self.settings.memory_cgroups
                                          else (None, "memory cgroups are turned off"))
        self._groups: list[RunGroup] = []  # every memory cgroup made, at most max_concurrent
        self._idle_groups: list[RunGroup] = []  # those no run is in, the last one used on top
        if self.cgroup is None:
            log.info("sandbox runs are bounded per process only: %s", self.memory_bound)
        else:
            sweep(self.cgroup)

    # -- availability ------------------------------------------------------------------------

    def static_check(self) -> str | None:
        """What can be told without running anything: bwrap, prlimit, the interpreter, the filter."""
        for tool in ("bwrap", "prlimit", "setpriv"):
            if shutil.which(tool) is None:
                package = "bubblewrap" if tool == "bwrap" else "util-linux"
                return f"{tool} is not installed (apt-get install {package}); code execution is off"
        if not os.access(self.settings.python, os.X_OK) or not self.settings.python.startswith("/usr/"):
            return f"no system Python at {self.settings.python} (the sandbox sees /usr only)"
        try:
            filter_bpf()
        except SeccompUnavailable as exc:
            return f"{exc}; code execution is off"
        return None

    async def check(self) -> str | None:
        """static_check(), then once a real run of `pass`: user namespaces may be off in this kernel."""
        if not self._probed:
            self._reason = self.static_check()
            if self._reason is None:
                result = await self._run("pass", SandboxLimits(wall_s=10.0), "")
                if not result.ok:
                    detail = (result.error or result.stderr or f"exit {result.exit_code}").strip()[-300:]
                    self._reason = f"bubblewrap cannot start a sandbox here: {detail}"
            self._probed = True
            if self._reason:
                log.warning("code execution is off: %s", self._reason)
        return self._reason

    # -- runs --------------------------------------------------------------------------------

    async def run(self, code: str, limits: SandboxLimits | None = None, tenant: str = "") -> RunResult:
        reason = await self.check()
        if reason is not None:
            return RunResult.failed(reason)
        return await self._run(code, limits or SandboxLimits(), tenant)

    async def _run(self, code: str, limits: SandboxLimits, tenant: str) -> RunResult:
        limits = limits.bounded(self.settings.ceiling)
        if len(code.encode("utf-8", "surrogatepass")) > limits.code_bytes:
            return RunResult.failed(f"the code is longer than {limits.code_bytes} bytes")
        if "\x00" in code:
            return RunResult.failed("the code holds a NUL character")
        async with self._tenant_slot(tenant), self._slots:
            uid = self._uids.popleft()
            try:
                return await self._execute(code, limits, uid)
            finally:
                self._uids.append(uid)  # to the back: the least recently used goes next

    @contextlib.asynccontextmanager
    async def _tenant_slot(self, tenant: str) -> AsyncIterator[None]:
        """One of the tenant's per_tenant slots; a tenant with nothing running or waiting is forgotten."""
        entry = self._tenants.get(tenant)
        if entry is None:
            entry = self._tenants[tenant] = _Tenant(asyncio.Semaphore(self.settings.per_tenant))
        entry.users += 1
        try:
            async with entry.slots:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._tenants[tenant]

    async def close(self) -> None:
        for group in self._groups:
            group.remove()
        self._groups.clear()
        self._idle_groups.clear()

    def _take_group(self) -> RunGroup | None:
        """A memory cgroup no run is in: the one used last (warm), else a new one."""
        if self.cgroup is None:
            return None
        if self._idle_groups:
            return self._idle_groups.pop()
        group = RunGroup(self.cgroup, f"fairway-{os.getpid()}-{id(self):x}-{len(self._groups)}")
        self._groups.append(group)
        return group

    async def _execute(self, code: str, limits: SandboxLimits, uid: int) -> RunResult:
        group = self._take_group()
        if group is None:
            return await self._execute_in(code, limits, uid, None)
        try:
            try:
                group.prepare(limits.memory_mb * MIB)
            except OSError as exc:
                return RunResult.failed(f"could not make the run's memory cgroup: {exc}")
            return await self._execute_in(code, limits, uid, group)
        finally:
            await group.settle()
            self._idle_groups.append(group)

    async def _execute_in(self, code: str, limits: SandboxLimits, uid: int, group: RunGroup | None) -> RunResult:
        started = time.monotonic()
        seccomp_read, seccomp_write = os.pipe()
        try:
            os.write(seccomp_write, filter_bpf())  # (a few hundred bytes: fits the pipe)
            os.close(seccomp_write)
            # Into its cgroup, then the uid (util-linux's setpriv: uvloop's subprocesses take no
            # user=), then the rlimits, then the sandbox.
            joined = join_args(group) if group is not None else []
            identity = setpriv_args(uid) if self._as_root else []
            try:
                proc = await asyncio.create_subprocess_exec(
                    *joined, *identity, *prlimit_args(limits),
                    *bwrap_args(self.settings.python, code, seccomp_read, limits),
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    pass_fds=(seccomp_read,), start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin")},
                    cwd="/")
            except OSError as exc:
                return RunResult.failed(f"could not start the sandbox: {exc}")
        finally:
            os.close(seccomp_read)
        return await self._collect(proc, limits, started, group)

    async def _collect(self, proc: asyncio.subprocess.Process, limits: SandboxLimits, started: float,
                       group: RunGroup | None = None) -> RunResult:
        """Read both outputs up to their bound, until the process ends or a limit ends it."""
        assert proc.stdout is not None and proc.stderr is not None
        out, err = bytearray(), bytearray()
        over: list[str] = []

        async def drain(stream: asyncio.StreamReader, into: bytearray) -> None:
            # To the end of the pipe (its transport closes then), keeping output_bytes of it.
            while chunk := await stream.read(_READ):
                room = limits.output_bytes - len(into)
                if len(chunk) > room and not over:
                    over.append("output")
                    _kill(proc)
                if room > 0:
                    into += chunk[:room]

        readers = asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err))
        limit: str | None = None
        try:
            await asyncio.wait_for(asyncio.shield(readers), limits.wall_s)
        except TimeoutError:
            limit = "wall_time"
            _kill(proc)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(readers, 5.0)  # the pipes close once the tree is dead
            _kill(proc)
        code = await proc.wait()
        exit_code, sig = _status(code)
        if over:
            limit = limit or "output"
        elif limit is None and group is not None and group.oom_killed():
            limit = "memory"  # the kernel killed a process of the run over its cgroup's limit
        elif limit is None and sig in (signal.SIGXCPU, signal.SIGKILL) and _cpu_bound(proc, limits, started):
            limit = "cpu_time"
        stderr = err.decode("utf-8", "replace")
        if limit is None and "File too large" in stderr:
            limit = "file_size"
        return RunResult(exit_code=exit_code, signal=sig, stdout=out.decode("utf-8", "replace"), stderr=stderr,
                         truncated=bool(over), limit=limit, duration_s=time.monotonic() - started)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """The run's whole session: bwrap, and with it (die-with-parent, then the pid namespace) the code."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _status(returncode: int) -> tuple[int | None, int | None]:
    """bwrap exits with the code's status, a signal as 128 + its number (as a shell reports it)."""
    if returncode < 0:
        return None, -returncode
    if returncode > 128:
        return None, returncode - 128
    return returncode, None


def _cpu_bound(proc: asyncio.subprocess.Process, limits: SandboxLimits, started: float) -> bool:
    """A SIGXCPU, or a SIGKILL that came from the CPU hard limit rather than from us or the kernel's
    OOM: told by the time it ran (at least the CPU budget)."""
    return time.monotonic() - started >= min(limits.cpu_s, limits.wall_s) * 0.9
