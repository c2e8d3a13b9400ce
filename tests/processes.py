"""Fairway processes for end-to-end tests: `fairway ...` started as a user would, logs kept for
the failure message, stopped (or killed) at the end."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def create_key(database: str, user: str, tier: str = "paid", *options: str) -> str:
    """A key for the user in the database, made as an operator makes one (`fairway keys create`
    prints it last; options such as "--region", "eu" passed on)."""
    out = subprocess.run([sys.executable, "-m", "fairway.cli", "keys", "create", "--user", user, "--tier", tier,
                          "--database", database, *options], check=True, capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1]


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


class PrivateRedis:
    """A Redis of one test's own (append-only file on, fsync always), which it may stop and
    restart: a restart loses nothing, as on a production Redis with AOF."""

    def __init__(self, folder: Path) -> None:
        from serving import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--appendonly", "yes",
                      "--appendfsync", "always", "--save", "", "--dir", str(folder)]
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL)
        for _ in range(200):
            ping = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True)
            if ping.stdout.strip() == b"PONG":
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def restart(self, down_s: float) -> None:
        """Shut it down (the AOF is flushed), wait down_s, start it again on the same files."""
        subprocess.run(["redis-cli", "-p", str(self.port), "shutdown"], capture_output=True)
        if self._proc is not None:
            self._proc.wait(timeout=10)
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
