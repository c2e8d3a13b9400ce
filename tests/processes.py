"""Fairway processes for end-to-end tests: `fairway ...` started as a user would, logs kept for
the failure message, stopped (or killed) at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115  closed with the process
        proc = subprocess.Popen([sys.executable, "-m", "fairway.cli", *args], stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def tails(self) -> str:
        return "\n".join(f"--- {name}\n{(self.logs / f'{name}.log').read_text()[-3000:]}" for name in self.procs)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
