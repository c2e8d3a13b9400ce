"""Test helper: what a test does when a server or program it needs is not here (Redis, PostgreSQL,
Chromium). A developer's run skips it, and the run's summary says so loudly with the command that
provides it (conftest.py); with FAIRWAY_REQUIRE_BACKENDS=1 (.ci/run sets it) it fails, so a run
that lost a server cannot pass with half the backend matrix skipped."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRED = os.environ.get("FAIRWAY_REQUIRE_BACKENDS") == "1"

# What provides each, on Debian (the project's reference machine; .ci/run does all of it).
PROVIDED_BY = {
    "Redis": "apt-get install -y redis-server && redis-server --daemonize yes --save ''",
    "PostgreSQL": "apt-get install -y postgresql && pg_ctlcluster --skip-systemctl-redirect "
                  "$(ls /etc/postgresql) main start  (tests connect as user postgres, trust auth)",
    "Redis Cluster": "apt-get install -y redis-server  (the suite starts a local cluster with redis-server and redis-cli)",
    "Chromium": "sudo apt-get install -y chromium",
    "bubblewrap": "apt-get install -y bubblewrap  (and pip install pyseccomp; the code sandbox's isolation)",
}

# What this run skipped: name -> the tests that needed it (read by conftest's summary).
MISSING: dict[str, list[str]] = {}


def missing(what: str, detail: str) -> NoReturn:
    """Skip (or, under FAIRWAY_REQUIRE_BACKENDS=1, fail) the current test: `what` is not available."""
    reason = f"{what} is not available: {detail}"
    if REQUIRED:
        pytest.fail(f"{reason} (FAIRWAY_REQUIRE_BACKENDS=1: every backend must be here)", pytrace=False)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    MISSING.setdefault(what, []).append(test)
    pytest.skip(reason)
