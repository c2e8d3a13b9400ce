"""A gateway process stops when told to. (One whose port is taken now stops before it starts, in
one line: tests/test_cli.py.)

Background tasks (the reply recorder) are cancelled until they end: a cancellation lost inside a
library (Python 3.11's asyncio.timeout turning one into a TimeoutError that redis-py retries)
once left a gateway running forever after SIGTERM, and after failing to bind its port."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from serving import free_port, wait_for

from fairway.assembly import Background

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


async def test_stop_ends_a_task_that_swallows_a_cancellation() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 2:
                    raise  # gives in on the third

    background = Background()
    await background.start(stubborn, "stubborn")()
    await asyncio.sleep(0)
    started = time.monotonic()
    await background.stop(timeout_s=10)
    assert swallowed == 3 and time.monotonic() - started < 5


async def test_stop_gives_up_on_a_task_that_never_ends(caplog: pytest.LogCaptureFixture) -> None:
    released = asyncio.Event()

    async def immortal() -> None:  # (until the test releases it, so the test's loop can close)
        while not released.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    background = Background()
    await background.start(immortal, "immortal")()
    await asyncio.sleep(0)  # it runs, into its try
    task = next(t for t in asyncio.all_tasks() if t.get_name() == "immortal")
    with caplog.at_level(logging.WARNING):
        await background.stop(timeout_s=0.5)
    assert "immortal did not stop" in caplog.text and not task.done()
    released.set()
    task.cancel()
    await asyncio.wait_for(task, 5)


def _health(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _gateway(port: int, tmp_path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fairway.cli", "gateway", "--redis", REDIS_URL, "--namespace",
         f"test:{uuid.uuid4().hex[:12]}:", "--database", f"sqlite:///{tmp_path}/gateway.db", "--port", str(port),
         "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "ctrl-c"])
def test_a_gateway_stops_on_sigterm_and_ctrl_c(tmp_path, sig: signal.Signals) -> None:
    port = free_port()
    proc = _gateway(port, tmp_path)
    try:
        wait_for(lambda: _health(port), timeout=60)  # (no replica runs: /ready would say not ready)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    # uvicorn ends by re-raising the signal it caught: SIGTERM ends the process by it, Ctrl+C is a
    # plain exit without a traceback.
    assert proc.returncode == (-signal.SIGTERM if sig == signal.SIGTERM else 0), out
    assert "Application shutdown complete" in out and "Traceback" not in out
