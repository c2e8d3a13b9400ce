"""Fairway processes for end-to-end tests: `fairway ...` started as a user would, logs kept for
the failure message, stopped (or killed) at the end; and a streamed reply as a client sees it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from serving import MODEL, sse_events


def create_key(database: str, user: str, tier: str = "paid", *options: str) -> str:
    """A key for the user in the database, made as an operator makes one (`fairway keys create`
    prints it last; options such as "--region", "eu" passed on)."""
    return start_keys(database, (user, tier, *options))()[0]


def start_keys(database: str, *wanted: tuple[str, ...]) -> Callable[[], list[str]]:
    """Keys made as create_key makes one, (user, tier, *options) each, their `fairway keys create`
    processes started at once (the store's migration lock orders their first use of a new
    database) while the caller starts other things; the function returned waits for them and
    returns the keys in order."""
    procs = [subprocess.Popen([sys.executable, "-m", "fairway.cli", "keys", "create", "--user", user, "--tier", tier,
                               "--database", database, *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for user, tier, *options in wanted]

    def keys() -> list[str]:
        made = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            if proc.returncode != 0:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
            made.append(out.strip().splitlines()[-1])
        return made

    return keys


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None, nice: int = 0) -> subprocess.Popen:
        """`fairway ARGS`, with env over this process's environment, nice more than this one."""
        out = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115  closed with the process
        proc = subprocess.Popen([sys.executable, "-m", "fairway.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, preexec_fn=(lambda: os.nice(nice)) if nice else None)
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
    restart: a restart loses nothing, as on a production Redis with AOF. durable=False: no
    append-only file, for a test that never restarts it (fsync on every write stalls Redis for
    seconds on a busy disk, and heartbeats expire)."""

    def __init__(self, folder: Path, durable: bool = True) -> None:
        from serving import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
        self._args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", *persistence,
                      "--save", "", "--dir", str(folder)]
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


@dataclass
class Stream:
    """One streamed reply as its client saw it: each event's id and arrival (monotonic)."""

    prompt: str
    ids: list[int] = field(default_factory=list)
    text: str = ""
    times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    reply_id: str | None = None
    conversation_id: str | None = None
    reconnected: bool = False
    max_tokens: int = 32
    started: float = 0.0  # monotonic, when the request was sent

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.started if self.times else None

    @property
    def longest_pause(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)


def stream(url: str, key: str, s: Stream, fallback: str | None = None, headers: dict[str, str] | None = None) -> None:
    """One streamed reply. With a fallback gateway: when the connection breaks mid-reply, carry on
    through that one from the last event id received (the SSE client's Last-Event-ID)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": s.prompt}], "max_tokens": s.max_tokens,
            "temperature": 0, "stream": True}
    auth = {"Authorization": f"Bearer {key}"}
    s.started = time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=180,
                          headers={**auth, **(headers or {})}) as response:
            if response.status_code != 200:
                s.error = f"{response.status_code}: {response.read()!r}"
                return
            if read_events(response, s):
                return
        s.error = "the stream ended without [DONE]"
    except httpx.HTTPError as exc:
        s.error = repr(exc)
    if fallback is None or s.reply_id is None:
        return
    s.error, s.reconnected = None, True
    try:
        with httpx.stream("GET", f"{fallback}/v1/replies/{s.reply_id}/stream", timeout=180,
                          headers={**auth, "Last-Event-ID": str(s.ids[-1] if s.ids else 0)}) as response:
            if response.status_code != 200:
                s.error = f"reconnect: {response.status_code}: {response.read()!r}"
            elif not read_events(response, s):
                s.error = "the resumed stream ended without [DONE]"
    except httpx.HTTPError as exc:
        s.error = f"reconnect: {exc!r}"


def read_events(response: httpx.Response, s: Stream) -> bool:
    """The stream's events into s; whether it reached [DONE]."""
    for event in sse_events(response):
        if event.data == "[DONE]":
            return True
        if event.id is not None:
            s.ids.append(event.id)
            s.times.append(time.monotonic())
        s.reply_id = s.reply_id or event.data.get("id")
        s.conversation_id = s.conversation_id or event.data.get("conversation_id")
        s.text += event.content
        s.finish_reason = event.finish_reason or s.finish_reason
    return False
