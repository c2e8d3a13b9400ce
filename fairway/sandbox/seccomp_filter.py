"""The seccomp filter every sandboxed process runs under, compiled to BPF once (pyseccomp, over
Debian's libseccomp2).

Allow by default and refuse, with EPERM, what sandboxed code has no use for and what attacks the
kernel or the host go through: every socket (no network, not even a local socket), tracing and
other processes' memory, mounts and namespaces, keyrings, BPF, perf, io_uring, module and kexec
loading, clock and host settings. A syscall of another architecture (32-bit entry points from a
64-bit process) kills the process: libseccomp's default for a foreign arch.
"""

from __future__ import annotations

import errno
import functools
import io

REFUSED = (
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "vhangup", "personality",
)


class SeccompUnavailable(RuntimeError):
    """pyseccomp or libseccomp is missing: the sandbox is off (it never runs code without the filter)."""


@functools.cache
def filter_bpf() -> bytes:
    """The filter as the BPF program bwrap's --seccomp loads."""
    try:
        import pyseccomp as seccomp
    except ImportError as exc:
        raise SeccompUnavailable("pyseccomp is not installed (pip install pyseccomp)") from exc
    try:
        rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
        for name in REFUSED:
            try:
                rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
            except (RuntimeError, OSError, ValueError):  # a name this kernel's libseccomp does not know
                continue
        out = io.BytesIO()
        with _temporary_file() as f:
            rules.export_bpf(f)
            f.seek(0)
            out.write(f.read())
    except OSError as exc:  # libseccomp.so.2 missing (pyseccomp loads it with ctypes)
        raise SeccompUnavailable(f"libseccomp could not be used: {exc}") from exc
    return out.getvalue()


def _temporary_file():
    import tempfile

    return tempfile.TemporaryFile()
