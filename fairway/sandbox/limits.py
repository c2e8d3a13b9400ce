"""What one sandboxed run may use, and what it came back with: plain data, the same in process
and on the wire (service.py sends them as JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

MIB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    """Each limit is enforced by the kernel (rlimits, the tmpfs size) and the runner (wall time,
    output bytes): a limit the code hits ends or bounds it, and the result says which."""

    cpu_s: float = 5.0  # CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later)
    wall_s: float = 10.0  # the whole run, sleeping included: the runner kills it after this
    # Address space per process (RLIMIT_AS), and resident memory of the whole run, all its
    # processes together, swap included (its cgroup, where the host lets the runner make one).
    memory_mb: int = 512
    procs: int = 32  # processes and threads of the run's uid (RLIMIT_NPROC)
    file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE)
    tmp_mb: int = 32  # its private /tmp, and /dev/shm (a tmpfs of this size each): all it may write
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 64 * 1024  # stdout and stderr, each: beyond this the run is killed
    code_bytes: int = 64 * 1024  # the program itself

    def bounded(self, ceiling: SandboxLimits) -> SandboxLimits:
        """These limits, each no higher than the ceiling's (a tenant may ask for less, never more)."""
        return replace(self, **{f.name: min(getattr(self, f.name), getattr(ceiling, f.name)) for f in fields(self)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SandboxLimits:
        """Known keys only, each a positive number (ValueError otherwise)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"limit {f.name} must be a positive number, got {value!r}")
            values[f.name] = float(value) if f.type == "float" else int(value)
        return cls(**values)


@dataclass(frozen=True)
class RunResult:
    """How a run ended. exit_code is the program's (None when a signal ended it); limit names the
    limit that ended or cut it ("wall_time", "cpu_time", "memory", "output", "file_size"); error says why
    nothing ran at all (the sandbox is off, the code too long, the service unreachable)."""

    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False  # stdout or stderr was cut at output_bytes
    limit: str | None = None
    duration_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0 and self.limit is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @classmethod
    def failed(cls, error: str) -> RunResult:
        return cls(error=error)
