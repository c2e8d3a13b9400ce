"""The code sandbox: untrusted Python run under bubblewrap with a seccomp filter, rlimits and an
unprivileged uid per run (runner.py), in process or as a gRPC service of its own (service.py)."""

from fairway.sandbox.limits import RunResult, SandboxLimits
from fairway.sandbox.runner import LocalSandbox, RunnerSettings, Sandbox

__all__ = ["LocalSandbox", "RunResult", "RunnerSettings", "Sandbox", "SandboxLimits"]
