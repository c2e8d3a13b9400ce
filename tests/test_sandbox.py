"""The code sandbox, for real: bubblewrap, the seccomp filter, rlimits and a uid per run, reached
through the `fairway sandbox` gRPC service (a process of its own) and in process.

Every escape and abuse runs beside a probe (print(1) from another tenant) that must come back
correct and promptly while the abuse is going on: the service keeps serving others. The limits are
small (256 MiB, 1 s CPU, 2 s wall) so the whole file stays quick.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fairway.sandbox import LocalSandbox, RunnerSettings, SandboxLimits, runner
from fairway.sandbox.cgroup import RunGroup, find_parent
from fairway.sandbox.service import GrpcSandbox
from tests.backends import missing

ROOT = Path(__file__).resolve().parent.parent
LIMITS = SandboxLimits(cpu_s=1.0, wall_s=2.0, memory_mb=256, procs=16, file_mb=4, tmp_mb=8, open_files=32,
                       output_bytes=32 * 1024)
ROOMY = dataclasses.replace(LIMITS, wall_s=8.0)  # the kernel's reclaim, then its OOM kill, take a while
PROBE_S = 1.5  # a probe beside an abuse must be back within this (a run alone takes ~0.05 s)


def _need_sandbox() -> None:
    reason = LocalSandbox().static_check()
    if reason is not None:
        missing("bubblewrap", reason)


@pytest.fixture(scope="module")
def service_url():
    _need_sandbox()
    proc = subprocess.Popen([sys.executable, "-m", "fairway.cli", "sandbox", "--listen", "127.0.0.1:0",
                             "--max-concurrent", "6", "--per-tenant", "3"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("sandbox listening on "), line
        assert "off" not in line, line
        yield "grpc://" + line.split()[3]
    finally:
        proc.terminate()
        proc.wait(10)


async def _beside(url: str, code: str, limits: SandboxLimits = LIMITS):
    """Run the code as tenant "abuser" while a probe of tenant "probe" runs; both results."""
    client = GrpcSandbox(url)
    try:
        abuse = asyncio.ensure_future(client.run(code, limits, tenant="abuser"))
        await asyncio.sleep(0.3)  # the abuse is under way
        started = time.monotonic()
        probe = await client.run("print(1)", LIMITS, tenant="probe")
        probe_s = time.monotonic() - started
        result = await abuse
    finally:
        await client.close()
    assert probe.ok and probe.stdout == "1\n", probe
    assert probe_s < PROBE_S, f"the probe took {probe_s:.2f} s beside the abuse"
    assert result.error is None, result
    return result


async def test_print_through_the_service(service_url):
    client = GrpcSandbox(service_url)
    try:
        assert await client.check() is None
        result = await client.run("import sys; print(6 * 7); print('oops', file=sys.stderr); sys.exit(3)", LIMITS)
    finally:
        await client.close()
    assert (result.exit_code, result.stdout, result.stderr, result.limit) == (3, "42\n", "oops\n", None)


async def test_read_etc_shadow(service_url):
    result = await _beside(service_url, "print(open('/etc/shadow').read())")
    assert result.exit_code == 1 and "FileNotFoundError" in result.stderr
    assert not result.stdout


async def test_read_the_project_and_home(service_url):
    paths = [str(ROOT / "pyproject.toml"), "/root", "/home", "/etc", "/work"]
    code = f"import os\nfor p in {paths!r}:\n    print(p, os.path.exists(p))\n"
    result = await _beside(service_url, code)
    assert result.exit_code == 0
    assert all(line.endswith(" False") for line in result.stdout.splitlines()), result.stdout


async def test_another_tenants_files_and_processes(service_url):
    client = GrpcSandbox(service_url)
    try:
        writer = asyncio.ensure_future(client.run(
            "open('/tmp/secret', 'w').write('s3cret'); import time; time.sleep(1.5); print(open('/tmp/secret').read())",
            LIMITS, tenant="alice"))
        await asyncio.sleep(0.5)
        reader = await client.run(
            "import os\nprint(os.listdir('/tmp'))\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))",
            LIMITS, tenant="mallory")
        written = await writer
    finally:
        await client.close()
    assert written.stdout == "s3cret\n"
    listed, pids = reader.stdout.splitlines()
    assert listed == "[]"  # a /tmp of its own
    assert pids == "['1', '2']"  # bwrap's init and itself: no other run's processes


async def test_sockets_to_loopback_and_outside(service_url):
    code = ("import socket\nfor host in ('127.0.0.1', '8.8.8.8'):\n"
            "    try:\n        socket.create_connection((host, 6379), timeout=1); print(host, 'connected')\n"
            "    except OSError as e:\n        print(host, e.errno)\n")
    result = await _beside(service_url, code)
    assert result.stdout.splitlines() == ["127.0.0.1 1", "8.8.8.8 1"]  # EPERM: the seccomp filter


async def test_fork_bomb(service_url):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = await _beside(service_url, code)
    assert result.limit in ("wall_time", "cpu_time")  # bounded, and killed whole
    assert result.duration_s < LIMITS.wall_s + 1.5


async def test_allocate_4_gib(service_url):
    result = await _beside(service_url, "x = bytearray(4 * 1024 ** 3)\nprint('allocated')")
    assert result.exit_code == 1 and "MemoryError" in result.stderr and not result.stdout


def _need_cgroup() -> None:
    parent, why = find_parent()
    if parent is None:
        pytest.skip(f"no memory cgroup for runs here: {why}")


# Each child stays within the per-process bound (RLIMIT_AS 256 MiB); together they are past it.
FORKED_ALLOCATIONS = """import os, time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (100 * 1024 * 1024)
        time.sleep(0.5)
        os._exit(0)
    kids.append(pid)
print([os.waitpid(k, 0)[1] for k in kids])
"""


async def test_processes_together_past_the_memory_limit(service_url):
    _need_cgroup()
    result = await _beside(service_url, FORKED_ALLOCATIONS, ROOMY)
    assert result.limit == "memory", result  # the run's cgroup: the kernel killed one of them


async def test_runs_at_once_have_memory_cgroups_of_their_own_kept_for_the_next(monkeypatch):
    _need_sandbox()
    _need_cgroup()
    used: list[Path] = []

    class Recorded(RunGroup):
        def prepare(self, memory_bytes: int) -> None:
            super().prepare(memory_bytes)
            used.append(self.path)

    monkeypatch.setattr(runner, "RunGroup", Recorded)
    sandbox = LocalSandbox()
    try:
        await sandbox.check()
        used.clear()
        ok, over = await asyncio.gather(sandbox.run("print(1)", LIMITS), sandbox.run(FORKED_ALLOCATIONS, ROOMY))
        assert ok.ok and ok.stdout == "1\n", ok
        assert over.limit == "memory", over
        assert len(set(used)) == 2  # one each while both ran
        assert all(p.exists() and not (p / "cgroup.procs").read_text().strip() for p in used)  # kept, empty
    finally:
        await sandbox.close()
    assert not any(p.exists() for p in used)
    # One uid, so one group for every run: a run after an OOM kill there is not taken for one.
    single = LocalSandbox(RunnerSettings(uid_count=1, max_concurrent=1))
    try:
        await single.check()
        used.clear()
        over, ok = await single.run(FORKED_ALLOCATIONS, ROOMY), await single.run("print(1)", LIMITS)
    finally:
        await single.close()
    assert over.limit == "memory" and ok.ok and ok.limit is None, (over, ok)
    assert len(used) == 2 and len(set(used)) == 1


async def test_fill_the_disk(service_url):
    code = "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 1024 * 1024)\n    i += 1\n"
    result = await _beside(service_url, code)
    assert result.exit_code == 1 and "No space left on device" in result.stderr


async def test_nothing_but_tmp_and_shm_is_writable(service_url):
    """bwrap's root and /dev are tmpfs without a size, owned by the sandbox's uid: left writable, a
    run could fill memory there past /tmp's bound. /dev/shm (multiprocessing's) is bounded too."""
    code = ("import errno, os\nfor p in ('/x', '/dev/x', '/usr/x', '/bin/x'):\n"
            "    try:\n        open(p, 'w'); print(p, 'written')\n"
            "    except OSError as e:\n        print(p, errno.errorcode[e.errno])\n"
            "try:\n    for i in range(100):\n        open(f'/dev/shm/{i}', 'wb').write(b'x' * 1024 * 1024)\n"
            "except OSError as e:\n    print('shm', i, errno.errorcode[e.errno])\n"
            "for name in os.listdir('/dev/shm'):\n    os.remove('/dev/shm/' + name)\n"
            "import multiprocessing\nmultiprocessing.Lock()\nprint('lock')\n")
    result = await _beside(service_url, code)
    assert result.stdout.splitlines() == ["/x EROFS", "/dev/x EROFS", "/usr/x EROFS", "/bin/x EROFS",
                                          f"shm {LIMITS.tmp_mb} ENOSPC", "lock"], result


async def test_one_file_past_the_size_limit(service_url):
    code = "open('/tmp/big', 'wb').write(b'x' * 6 * 1024 * 1024)"
    result = await _beside(service_url, code)
    assert result.exit_code == 1 and result.limit == "file_size", result


async def test_infinite_loop(service_url):
    # (ROOMY's wall time: on a loaded machine 1 s of CPU can take longer than LIMITS' 2 s of wall)
    result = await _beside(service_url, "while True:\n    pass\n", ROOMY)
    assert result.limit == "cpu_time" and result.exit_code is None


async def test_sleep_for_ever(service_url):
    result = await _beside(service_url, "import time\ntime.sleep(10 ** 6)\n")
    assert result.limit == "wall_time" and result.signal == 9
    assert LIMITS.wall_s <= result.duration_s < LIMITS.wall_s + 1.0


async def test_print_100_mb(service_url):
    result = await _beside(service_url, "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1024 * 1024)\n")
    assert result.limit == "output" and result.truncated
    assert len(result.stdout) == LIMITS.output_bytes


async def test_kill_the_parent(service_url):
    code = ("import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError as e:\n        print(pid, e.errno)\nprint('still here')\n")
    result = await _beside(service_url, code)
    assert result.stdout.endswith("still here\n") and result.exit_code == 0


async def test_no_privileges_inside(service_url):
    code = ("import os\nstatus = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
            "print(os.getuid(), status['CapEff'], status['NoNewPrivs'], status['Seccomp'])\n"
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n")  # CLONE_NEWUSER
    result = await _beside(service_url, code)
    assert result.stdout.splitlines() == ["65534 0000000000000000 1 2", "unshare -1 1"]


NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts")


async def test_every_namespace_is_its_own(service_url):
    """Unshared, each of them: the seccomp filter refuses sockets anyway, so the network namespace
    is checked on its own (nothing but a loopback of its own, none of the host's interfaces)."""
    code = (f"import os\nprint([os.readlink('/proc/self/ns/' + n) for n in {NAMESPACES!r}])\n"
            "print([l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]])\n")
    result = await _beside(service_url, code)
    inside, interfaces = (ast.literal_eval(line) for line in result.stdout.splitlines())
    host = [os.readlink(f"/proc/self/ns/{n}") for n in NAMESPACES]
    assert [a == b for a, b in zip(inside, host, strict=True)] == [False] * len(NAMESPACES), (inside, host)
    assert interfaces == ["lo"]


async def test_limits_are_bounded_by_the_service(service_url):
    client = GrpcSandbox(service_url)
    try:
        result = await client.run("import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])",
                                  SandboxLimits(procs=10_000))
    finally:
        await client.close()
    assert int(result.stdout) <= RunnerSettings().ceiling.procs


async def test_in_process_runner_and_code_bounds():
    _need_sandbox()
    sandbox = LocalSandbox()
    ok = await sandbox.run("print('hi')", LIMITS)
    too_long = await sandbox.run("#" * (LIMITS.code_bytes + 1), LIMITS)
    assert ok.stdout == "hi\n" and ok.ok
    assert too_long.error and "longer than" in too_long.error and too_long.stdout == ""


async def test_without_bubblewrap_the_tool_is_off(monkeypatch, tmp_path):
    # A PATH with no bwrap on it: the sandbox says why it is off and refuses to run anything.
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox = LocalSandbox()
    reason = await sandbox.check()
    assert reason is not None and "bwrap is not installed" in reason
    marker = tmp_path / "ran"
    result = await sandbox.run(f"open({str(marker)!r}, 'w')", LIMITS)
    assert result.error == reason and not marker.exists()


async def test_unreachable_service_is_a_result_not_a_crash():
    client = GrpcSandbox("grpc://127.0.0.1:1", timeout_s=1.0)
    try:
        reason = await client.check()
        result = await client.run("print(1)", SandboxLimits(wall_s=1.0))
    finally:
        await client.close()
    assert reason and "unreachable" in reason
    assert result.error and "failed" in result.error


async def test_process_and_open_file_limits(service_url):
    """RLIMIT_NPROC and RLIMIT_NOFILE as the kernel applies them (the process limit only holds
    because the run is an unprivileged uid: as root it would not count)."""
    code = ("import os, time\nkids = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError as e:\n"
            "        print('fork', kids, e.errno); break\n    if pid == 0:\n        time.sleep(1); os._exit(0)\n"
            "    kids += 1\nfiles = []\nwhile True:\n    try:\n        files.append(open('/dev/null'))\n"
            "    except OSError as e:\n        print('open', len(files), e.errno); break\n")
    result = await _beside(service_url, code)
    forks, opens = (line.split() for line in result.stdout.splitlines())
    assert forks[0] == "fork" and 0 < int(forks[1]) < LIMITS.procs and forks[2] == "11", result  # EAGAIN
    assert opens[0] == "open" and 0 < int(opens[1]) < LIMITS.open_files and opens[2] == "24", result  # EMFILE
    assert result.exit_code == 0


async def test_the_service_refuses_a_malformed_request(service_url):
    import grpc

    from fairway.sandbox.service import SERVICE, _dumps, _loads, target_of

    async with grpc.aio.insecure_channel(target_of(service_url)) as channel:
        run = channel.unary_unary(f"/{SERVICE}/Run", request_serializer=_dumps, response_deserializer=_loads)
        for request in ({"limits": {}}, {"code": "print(1)", "limits": {"cpu_s": -1}},
                        {"code": "print(1)", "limits": {"memory_mb": "lots"}}):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await run(request, timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert (await run({"code": "print(1)"}, timeout=10))["stdout"] == "1\n"  # and it goes on serving


async def test_one_tenants_burst_leaves_room_for_others(service_url):
    """The service runs 6 at once, 3 of one tenant (the fixture's flags): a tenant that sends 6
    slow runs has 3 running and 3 waiting, and another tenant's run goes straight through."""
    client = GrpcSandbox(service_url)
    try:
        burst = [asyncio.ensure_future(client.run("import time; time.sleep(1.5); print('slow')", LIMITS, tenant="busy"))
                 for _ in range(6)]
        await asyncio.sleep(0.3)
        started = time.monotonic()
        probe = await client.run("print(1)", LIMITS, tenant="probe")
        probe_s = time.monotonic() - started
        results = await asyncio.gather(*burst)
        total_s = time.monotonic() - started + 0.3
    finally:
        await client.close()
    assert probe.stdout == "1\n" and probe_s < 1.0, (probe, probe_s)
    assert [r.stdout for r in results] == ["slow\n"] * 6
    assert total_s > 2 * 1.5  # the busy tenant's runs went three at a time: two waves


@pytest.mark.parametrize("argv", [["sandbox", "--max-concurrent", "0"], ["sandbox", "--per-tenant", "-1"],
                                  ["serve", "--max-tool-rounds", "0"], ["sandbox", "--max-concurrent", "many"]])
def test_counts_below_one_are_refused_at_the_command_line(argv, capsys):
    """(A sandbox with no slots would hold every run for ever; no tool rounds would read as the default.)"""
    from fairway.cli import build_parser

    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2 and argv[1] in capsys.readouterr().err
