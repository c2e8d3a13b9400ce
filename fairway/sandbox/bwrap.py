"""The bubblewrap command line of one run: what the sandbox holds and what it shares (nothing).

Every namespace is unshared (user, pid, net, ipc, uts, cgroup): the code sees its own processes
only, a network namespace with nothing but a loopback that leads nowhere, and no way to make
namespaces of its own. Its file system is the host's /usr read-only (and the /bin, /lib links
into it), a fresh /proc and /dev, a private size-bounded tmpfs /tmp (and /dev/shm), and nothing
else: no /etc, no /root, no /home, no project folder. All but those two is read-only, the root and
/dev included (bwrap makes them tmpfs of no size, writable by the sandbox's uid). It runs as uid
65534 inside with no capabilities, no new privileges (bwrap sets PR_SET_NO_NEW_PRIVS for the
seccomp filter), in a session of its own, and dies with the runner.
"""

from __future__ import annotations

import os
from pathlib import Path

from fairway.sandbox.limits import MIB, SandboxLimits

SANDBOX_UID = 65534  # "nobody" inside the sandbox; outside it is the run's own unprivileged uid
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def system_mounts() -> list[str]:
    """/usr read-only; /bin, /lib and the others as the host has them (usr-merged: links into /usr)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in _SYSTEM_LINKS:
        p = Path(path)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), path]
        elif p.is_dir():
            args += ["--ro-bind", path, path]
    return args


def setpriv_args(uid: int) -> list[str]:
    """util-linux's setpriv: the run's own unprivileged uid and gid, no supplementary groups, and
    with them no capabilities (a root runner's are gone once it is not root)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def prlimit_args(limits: SandboxLimits) -> list[str]:
    """util-linux's prlimit: the rlimits, set on itself (already the run's unprivileged uid: as
    root RLIMIT_NPROC would not apply) and inherited by bwrap and the code. The CPU hard limit is a
    second above the soft one: SIGXCPU first, SIGKILL if the code ignores it."""
    cpu = max(1, int(limits.cpu_s + 0.999))
    return [
        "prlimit",
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={limits.memory_mb * MIB}",
        f"--nproc={limits.procs}",
        f"--fsize={limits.file_mb * MIB}",
        f"--nofile={limits.open_files}",
        "--core=0",
        "--",
    ]


def bwrap_args(python: str, code: str, seccomp_fd: int, limits: SandboxLimits) -> list[str]:
    return [
        "bwrap",
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        "--hostname", "sandbox",
        "--die-with-parent", "--new-session",
        "--cap-drop", "ALL",
        *system_mounts(),
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(limits.tmp_mb * MIB), "--tmpfs", "/tmp",
        # bwrap's root and /dev are tmpfs without a size, writable by the sandbox's uid: read-only
        # both, or a run could fill memory there past /tmp's bound. /dev/shm gets a bounded tmpfs
        # of its own (Python's multiprocessing keeps its semaphores there).
        "--remount-ro", "/dev",
        "--size", str(limits.tmp_mb * MIB), "--tmpfs", "/dev/shm",
        "--remount-ro", "/",
        "--chdir", "/tmp",
        "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
        "--setenv", "HOME", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
        "--setenv", "PYTHONIOENCODING", "utf-8",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--setenv", "MPLBACKEND", "Agg",
        "--seccomp", str(seccomp_fd),
        "--",
        python, "-I", "-c", code,
    ]
