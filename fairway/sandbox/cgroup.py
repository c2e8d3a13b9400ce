"""A memory cgroup per run: the resident memory of a run's whole process tree, bounded by the kernel.

RLIMIT_AS bounds each process's address space; a run may start up to `procs` processes, so without
this its total is their product. Where the host lets the runner make cgroups, each run is in a
group of its own under a parent (from a pool of groups the runner reuses: RunGroup), its limit
set before the code starts (the runner's command moves itself into the group, then drops to the
run's uid, then execs bubblewrap), swap included. A run the kernel's OOM killer ended in its group is reported as hitting the
memory limit.

The parent:
* cgroup v1 (a `memory` hierarchy of its own): the runner's own memory cgroup, when it may create
  groups in it;
* cgroup v2: only a delegated subtree (a directory whose cgroup.subtree_control enables `memory`
  and that this process may write), named by FAIRWAY_SANDBOX_CGROUP: the unified hierarchy forbids
  child groups with limits under a group that holds processes, such as the runner's own.
Elsewhere runs keep the per-process bounds only, and `find_parent` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT_ENV = "FAIRWAY_SANDBOX_CGROUP"


@dataclass(frozen=True)
class CgroupParent:
    path: Path  # new run groups are made here
    version: int  # 1 or 2

    def describe(self) -> str:
        return f"cgroup v{self.version} memory groups under {self.path}"


def find_parent(explicit: str | None = None, root: Path = CGROUP_ROOT) -> tuple[CgroupParent | None, str]:
    """Where run groups go, or None and why they cannot be made here."""
    explicit = explicit if explicit is not None else os.environ.get(PARENT_ENV)
    if explicit:
        path = Path(explicit)
        if (path / "memory.limit_in_bytes").exists():
            return _writable(CgroupParent(path, 1))
        if "memory" in _read(path / "cgroup.subtree_control").split():
            return _writable(CgroupParent(path, 2))
        return None, f"{PARENT_ENV}={explicit} is not a cgroup with the memory controller for its children"
    own = _own_groups()
    if "memory" in own and (root / "memory").is_dir():
        return _writable(CgroupParent(root / "memory" / own["memory"].lstrip("/"), 1))
    if "" in own and (root / "cgroup.controllers").exists():
        return None, (f"cgroup v2 without a delegated subtree: name one with the memory controller enabled "
                      f"in {PARENT_ENV}")
    return None, "no cgroup memory controller is mounted"


def _own_groups() -> dict[str, str]:
    """This process's cgroup per controller ("" for the v2 unified hierarchy)."""
    groups: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    return groups


def _writable(parent: CgroupParent) -> tuple[CgroupParent | None, str]:
    probe = parent.path / f"fairway-{os.getpid()}-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return None, f"cannot make cgroups in {parent.path}: {exc.strerror}"
    return parent, parent.describe()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class RunGroup:
    """A memory cgroup that runs use one at a time (the runner keeps a pool, one per run at once):
    made on first use and kept, since a process started in a new memory cgroup costs tens of
    milliseconds more than in one that has run processes before; limited afresh for each run;
    removed with the runner (or, left behind by a runner that died, by the next one's sweep)."""

    def __init__(self, parent: CgroupParent, name: str) -> None:
        self.parent = parent
        self.path = parent.path / name
        self._ooms = 0  # the group's OOM kills before this run

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def prepare(self, memory_bytes: int) -> None:
        """Ready for a run within memory_bytes. OSError when the group cannot be made or limited
        (the run then does not start)."""
        self.path.mkdir(exist_ok=True)
        if self.parent.version == 1:
            limit, swap = self.path / "memory.limit_in_bytes", self.path / "memory.memsw.limit_in_bytes"
            # memory + swap: no way round the limit by swapping. The kernel keeps memsw >= the
            # memory limit at every step, so which goes first depends on the direction.
            order = [limit, swap] if memory_bytes <= int(_read(limit) or 0) else [swap, limit]
            for path in order:
                if path.exists():
                    path.write_text(str(memory_bytes))
        else:
            (self.path / "memory.max").write_text(str(memory_bytes))
            swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        self._ooms = self._oom_kills()

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this run for going over the group's limit."""
        return self._oom_kills() > self._ooms

    def _oom_kills(self) -> int:
        text = _read(self.path / ("memory.oom_control" if self.parent.version == 1 else "memory.events"))
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value or 0)
        return int(_read(self.path / "memory.failcnt") or 0) if self.parent.version == 1 else 0

    async def settle(self) -> None:
        """After a run: until its last process is gone (a killed tree takes a moment to exit), so
        the next run starts alone in the group."""
        for _ in range(100):
            if not _read(Path(self.procs_file)).strip():
                return
            await asyncio.sleep(0.01)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def sweep(parent: CgroupParent, prefix: str = "fairway-") -> None:
    """Remove the empty groups runners that are gone left behind (named prefix + their pid)."""
    for path in parent.path.glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                path.rmdir()


def join_args(group: RunGroup) -> list[str]:
    """A command prefix that moves itself into the group, then execs the rest (as root: the group's
    files are root's; setpriv drops the uid after)."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', group.procs_file]
