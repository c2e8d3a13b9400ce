"""The command line refuses, at start and in one line, what would start a server that then breaks
(fairway/cli.py): numeric options out of range, non-finite numbers, bad addresses, servers that do
not answer. Argument errors exit before the model loads, so these run in seconds."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from fairway.cli import build_parser
from fairway.engine.sampling_params import SamplingParams

REDIS = ["--redis", "redis://127.0.0.1:1/0"]
GATEWAY = ["gateway", *REDIS, "--database", "sqlite://"]


def fairway(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fairway.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def refused(argv: list[str], capsys) -> str:
    """argparse's one-line error for argv (it exits 2)."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,says", [
    ([*GATEWAY, "--keepalive", "0"], "--keepalive: must be a number of seconds above 0"),
    (["serve", "--keepalive", "-1"], "--keepalive: must be a number of seconds above 0"),
    (["serve", "--keepalive", "nan"], "--keepalive: must be a finite number"),
    (["serve", "--port", "70000"], "--port: a TCP port is 1 to 65535, not 70000"),
    (["serve", "--port", "-1"], "--port: a TCP port is 1 to 65535"),
    (["up", "--port", "0"], "--port: a TCP port is 1 to 65535"),
    (["serve", "--log-ttl", "-5"], "--log-ttl: must be a number of seconds above 0"),
    (["serve", "--idle-cancel", "0"], "--idle-cancel: must be a number of seconds above 0"),
    (["serve", "--default-max-tokens", "0"], "--default-max-tokens: must be at least 1"),
    ([*GATEWAY, "--default-max-tokens", "-3"], "--default-max-tokens: must be at least 1"),
    (["serve", "--max-model-len", "0"], "--max-model-len: must be at least 128 tokens"),
    (["replica", *REDIS, "--max-model-len", "-1"], "--max-model-len: must be at least 128 tokens"),
    (["replica", *REDIS, "--max-inflight", "0"], "--max-inflight: must be at least 1"),
    (["replica", *REDIS, "--drain-grace", "-1"], "--drain-grace: must be 0 or more"),
    (["replica", *REDIS, "--health-port", "70000"], "--health-port: a TCP port is 1 to 65535 (or 0"),
    (["serve", "--ip-rpm", "0"], "--ip-rpm: must be at least 1"),
    (["serve", "--max-in-flight", "0"], "--max-in-flight: must be at least 1"),
    (["serve", "--max-waiting", "-1"], "--max-waiting: must be 0 or more"),
    (["serve", "--admission-timeout", "-1"], "--admission-timeout: must be 0 or more"),
    (["serve", "--memory-idle", "0"], "--memory-idle: must be a number of seconds above 0"),
    ([*GATEWAY, "--overflow-rel", "-0.5"], "--overflow-rel: must be 0 or more"),
    ([*GATEWAY, "--overflow-abs", "-1"], "--overflow-abs: must be 0 or more"),
    (["serve", "--max-wait", "inf"], "--max-wait: must be a finite number"),
    (["serve", "--shorter-max-tokens", "0"], "--shorter-max-tokens: must be at least 1"),
    (["serve", "--max-sentence-chars", "0"], "--max-sentence-chars: must be at least 1"),
    (["serve", "--prompt-price-per-1k", "-1"], "--prompt-price-per-1k: must be 0 or more"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens: must be at least 1"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature: must be a finite number"),
    (["chat", "--temperature", "inf"], "--temperature: must be a finite number"),
    (["chat", "--temperature", "-1"], "--temperature: must be 0 or more"),
    (["chat", "--max-model-len", "64"], "--max-model-len: must be at least 128 tokens"),
    (["generate", "--prompt", "x", "--max-model-len", "64"], "--max-model-len: must be at least 128 tokens"),
    (["fleet", "--cooldown", "nan"], "--cooldown: must be a finite number"),
    (["fleet", "--metrics-port", "99999"], "--metrics-port: a TCP port is 1 to 65535"),
    (["serve", "--keepalive", "soon"], "--keepalive: 'soon' is not a number"),
])
def test_numbers_that_would_break_the_server_are_refused_at_start(argv, says, capsys):
    assert says in refused(argv, capsys)


def test_numbers_in_range_are_taken():
    args = build_parser().parse_args([*GATEWAY, "--keepalive", "0.5", "--port", "65535", "--max-waiting", "0",
                                      "--admission-timeout", "0", "--overflow-abs", "0"])
    assert (args.keepalive, args.port, args.max_waiting, args.admission_timeout_s) == (0.5, 65535, 0, 0.0)
    replica = build_parser().parse_args(["replica", *REDIS, "--health-port", "0", "--drain-grace", "0",
                                         "--max-model-len", "128"])
    assert (replica.health_port, replica.drain_grace, replica.max_model_len) == (0, 0.0, 128)


@pytest.mark.parametrize("argv", [["chat"], ["serve", "--port", "1"], ["replica", *REDIS],
                                  ["generate", "--prompt", "x"]])
def test_a_window_past_the_models_context_length_is_refused_before_the_load(argv):
    """The bundled model is trained on 8,192 positions, its RoPE table as long: a longer
    --max-model-len was taken, and a prompt past 8,192 tokens read the table out of its bounds
    (the reply was "-----")."""
    out = fairway(*argv, "--max-model-len", "20000", timeout=30)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr == ("fairway: --max-model-len 20000 is longer than the model's context length of 8192 tokens "
                          "(its trained positions, the size of its RoPE table): use at most 8192, or set "
                          "FAIRWAY_ALLOW_LONG_MAX_MODEL_LEN=1 to run past it, with replies likely garbage there\n")


def test_generate_runs_in_the_window_max_model_len_gives():
    """generate took no --max-model-len, where serve, replica and chat do (one option for every
    command that builds an engine): a prompt past that window is one line naming it, exit 2."""
    prompt = "one two three " * 60  # ~180 tokens: within the model's window, past 128
    out = fairway("generate", "--prompt", prompt, "--max-tokens", "4", "--max-model-len", "128")
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith("fairway: prompt has ") and "the context window is 128 tokens" in out.stderr, out
    assert out.stderr.count("\n") == 1, out


def test_a_window_past_the_models_context_length_runs_when_allowed(tiny_model, monkeypatch):
    """With the override the engine takes the window and its RoPE tables cover it: a prompt past
    the trained positions is answered, not read out of the tables' bounds."""
    from fairway.engine import EngineConfig, LLMEngine

    trained = tiny_model.cfg.max_position_embeddings
    config = EngineConfig(max_model_len=trained * 2, bound_step_time=False, speculative=None)
    with pytest.raises(ValueError, match=f"context length of {trained} tokens"):
        LLMEngine(tiny_model, config)
    monkeypatch.setenv("FAIRWAY_ALLOW_LONG_MAX_MODEL_LEN", "1")
    engine = LLMEngine(tiny_model, config)
    assert engine.max_model_len == trained * 2 and tiny_model.rotary.positions >= trained * 2
    engine.add_request("long", [1] * (trained + 16), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("argv", [["serve"], ["replica", *REDIS], GATEWAY, ["chat"], ["serve", "--mini-model"]])
def test_a_model_that_is_not_there_is_refused_at_parsing(argv, tmp_path, capsys):
    """A missing --model was a FileNotFoundError traceback in the gateway, and serve and the
    replica exited 1 only after their server checks; a folder without config.json the same."""
    missing = tmp_path / "no-such-model.gguf"
    flag = argv[-1] if argv[-1].startswith("--") else "--model"
    argv = argv if flag != "--mini-model" else argv[:-1]
    assert refused([*argv, flag, str(missing)], capsys).endswith(
        f"argument {flag}: '{missing}' does not exist: pass a .gguf file or a Hugging Face folder")
    assert refused([*argv, flag, str(tmp_path)], capsys).endswith(
        f"argument {flag}: '{tmp_path}' is a folder without config.json: pass a .gguf file or a Hugging Face folder")


def test_a_model_file_that_is_no_model_is_one_line_and_exit_2(tmp_path):
    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model\n" * 100)
    out = fairway("generate", "--prompt", "x", "--model", str(notes))
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out
    assert out.stderr.startswith(f"fairway: model file {notes} is not a readable GGUF file"), out


def test_a_zero_keepalive_gateway_exits_at_once_with_one_line():
    """It flooded every stream with keepalives and then ignored SIGINT/SIGTERM."""
    out = fairway(*GATEWAY, "--keepalive", "0")
    assert out.returncode == 2 and "--keepalive: must be a number of seconds above 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_tier_limit_of_zero_is_refused(capsys):
    from fairway.cli import _limits_config

    with pytest.raises(ValueError, match="at least 1"):
        _limits_config(build_parser().parse_args(["serve", "--tpm", "free=0"]))


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), float("-inf")])
def test_sampling_params_refuse_a_temperature_that_is_not_finite(temperature):
    """NaN passed `temperature < 0` (every comparison with NaN is False) and reached the sampler."""
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "nonsense", "127.0.0.1:", ":50051"])
def test_a_sandbox_address_that_is_not_host_port_is_one_line(listen):
    """gRPC took port 99999 as "any port" and printed a traceback for the rest."""
    out = fairway("sandbox", "--listen", listen)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--listen takes host:port" in out.stderr, out.stderr


def test_a_sandbox_on_a_taken_address_exits_saying_so():
    """gRPC's default SO_REUSEPORT let a second sandbox bind beside the first one (sharing its
    connections); a port another program holds was a "Failed to bind" traceback."""
    first = subprocess.Popen([sys.executable, "-m", "fairway.cli", "sandbox", "--listen", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        assert line.startswith("sandbox listening on "), line
        address = line.split()[3]
        second = fairway("sandbox", "--listen", address)
        assert second.returncode == 1 and second.stderr.strip() == \
            f"fairway sandbox: cannot listen on {address}: Address already in use", second.stderr
    finally:
        first.terminate()
        first.wait(10)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        address = f"127.0.0.1:{other.getsockname()[1]}"
        out = fairway("sandbox", "--listen", address)
    assert out.returncode == 1 and out.stderr.strip() == \
        f"fairway sandbox: cannot listen on {address}: Address already in use", out.stderr
    unknown = fairway("sandbox", "--listen", "no-such-host.invalid:50051")
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1 and "cannot listen" in unknown.stderr


@pytest.mark.parametrize("value", ["bogus", "grpc://", "grpc://host", "grpc://host:0", "grpc://host:70000",
                                   "host:50051", "http://host:50051"])
def test_a_sandbox_that_is_not_local_off_or_grpc_is_refused(value, capsys):
    """`--sandbox bogus` (a typo of local) was taken as a gRPC host: the tool was off on every run."""
    assert "--sandbox: takes local, off or grpc://host:port" in refused(["serve", "--sandbox", value], capsys)


@pytest.mark.parametrize("value", ["local", "off", "grpc://127.0.0.1:50051", "grpc://sandbox.svc:50051/"])
def test_the_documented_sandboxes_are_taken(value):
    assert build_parser().parse_args(["replica", *REDIS, "--sandbox", value]).sandbox == value


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once it is closed


@pytest.mark.parametrize("command,server", [
    (GATEWAY, "Redis"),
    (["gateway", "--redis", "redis://127.0.0.1:6379/0", "--database", "postgresql://postgres@127.0.0.1:{port}/x"],
     "PostgreSQL"),
    (["serve", "--database", "postgresql://postgres@127.0.0.1:{port}/x"], "PostgreSQL"),
    (["replica", "--redis", "redis://127.0.0.1:{port}/0"], "Redis"),
    (["keys", "list", "--database", "postgresql://postgres@127.0.0.1:{port}/x"], "PostgreSQL"),
])
def test_a_server_that_does_not_answer_is_one_line_before_the_model_loads(command, server):
    """As `fairway up` says it (fairway/up.py); each was a long traceback, the model loaded first."""
    port = closed_port()
    argv = [arg.format(port=port) for arg in command]
    out = fairway(*argv)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"fairway {argv[0]}: no {server} answers at "), \
        out.stderr


@pytest.mark.parametrize("url", ["mysql://u@h/db", "notaurl"])
def test_a_database_url_no_store_takes_is_one_line(url):
    out = fairway("keys", "list", "--database", url)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--database takes postgresql://" in out.stderr, \
        out.stderr


class Terminal:
    """A `fairway` process with its output gathered as it comes (a thread per stream)."""

    def __init__(self, *args: str) -> None:
        # Ctrl-C as a terminal delivers it: a suite started in the background (`cmd &` in a script)
        # hands its children SIGINT ignored, and Python then keeps it ignored.
        self.proc = subprocess.Popen([sys.executable, "-m", "fairway.cli", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, into), daemon=True).start()

    @staticmethod
    def _pump(stream, into: list[str]) -> None:
        while char := stream.read(1):
            into.append(char)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, ready, what: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                f"no {what}: {self.stdout[-500:]!r} {self.stderr[-2000:]!r}"
            time.sleep(0.02)

    def type(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()


# Greedy, the bundled model lists these up to the token limit (~20 s here): a reply still going
# when the test's Ctrl-C lands, however slow the machine ("Count from 1 to 1000" stops at 20).
COUNT = "List the numbers from 1 to 500, separated by commas."


def test_chat_ctrl_c_stops_a_reply_a_long_message_is_refused_and_the_chat_goes_on():
    """Ctrl-C was a KeyboardInterrupt traceback, and a message too long for the window ended the
    session (exit 2, the conversation lost)."""
    chat = Terminal("chat", "--max-tokens", "3000", "--temperature", "0")
    try:
        chat.wait_for(lambda: chat.stdout.count("> ") == 1, "prompt")
        chat.type(COUNT)
        chat.wait_for(lambda: "3" in chat.stdout, "reply")
        chat.proc.send_signal(signal.SIGINT)
        chat.wait_for(lambda: chat.stdout.count("> ") == 2, "prompt after the stopped reply")
        assert "[stopped]" in chat.stderr
        chat.type("word " * 10_000)
        chat.wait_for(lambda: chat.stdout.count("> ") == 3, "prompt after the refused message")
        assert "context window is" in chat.stderr and "not sent" in chat.stderr
        chat.type("What did I ask you to count to?")  # the conversation is still there
        chat.wait_for(lambda: chat.stdout.count("> ") == 4, "prompt after a reply")
        chat.proc.send_signal(signal.SIGINT)  # at the prompt: the chat ends
        assert chat.proc.wait(30) == 130
    finally:
        chat.proc.kill()
        chat.proc.wait()
    assert "Traceback" not in chat.stderr, chat.stderr


def test_chat_longer_than_the_window_drops_the_oldest_turns_and_every_turn_is_answered():
    """Once the history outgrew the window every later message was refused ("not sent"), however
    short: a long session died. Now the oldest turns are left out, as the API's context builder
    does, and the user is told once."""
    line = "Tell me about the sea, the ships that sail on it and the sailors who work on those ships."
    turns = 5  # each about 40 tokens with its reply: three fill the 128-token window
    chat = subprocess.run(
        [sys.executable, "-m", "fairway.cli", "chat", "--max-model-len", "128", "--max-tokens", "8",
         "--temperature", "0"], input=f"{line}\n" * turns, capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr
    replies = chat.stdout.split("> ")[1:-1]  # (the last prompt met the end of input)
    assert len(replies) == turns and all(reply.strip() for reply in replies), chat.stdout
    assert chat.stderr.count("the oldest turns no longer fit the 128-token window") == 1, chat.stderr
    assert "not sent" not in chat.stderr and "Traceback" not in chat.stderr, chat.stderr


def test_chat_ctrl_d_ends_the_line():
    chat = Terminal("chat")
    try:
        chat.wait_for(lambda: "> " in chat.stdout, "prompt")
        chat.proc.stdin.close()
        assert chat.proc.wait(30) == 0
    finally:
        chat.proc.kill()
        chat.proc.wait()
    assert chat.stdout.endswith("> \n")


def test_generate_interrupted_exits_130_without_a_traceback():
    generate = Terminal("generate", "--prompt", COUNT, "--chat", "--max-tokens", "3000", "--temperature", "0")
    try:
        generate.wait_for(lambda: "3" in generate.stdout, "output")
        generate.proc.send_signal(signal.SIGINT)
        assert generate.proc.wait(30) == 130
    finally:
        generate.proc.kill()
        generate.proc.wait()
    assert "Traceback" not in generate.stderr and "KeyboardInterrupt" not in generate.stderr, generate.stderr


def test_keys_list_shows_the_name_and_a_second_revoke_says_when_the_first_was(tmp_path):
    database = f"sqlite:///{tmp_path / 'keys.db'}"
    created = fairway("keys", "create", "--user", "ann", "--name", "laptop", "--database", database)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    (row,) = fairway("keys", "list", "--database", database).stdout.strip().splitlines()[1:]
    assert row.split()[1] == "ann" and row.endswith(" laptop"), row  # the name was stored, never shown
    first = fairway("keys", "revoke", key, "--database", database)
    assert first.returncode == 0 and first.stdout.startswith("Revoked key_"), first
    again = fairway("keys", "revoke", key, "--database", database)
    assert again.returncode == 0 and "was already revoked, at " in again.stdout, again
    (row,) = fairway("keys", "list", "--database", database).stdout.strip().splitlines()[1:]
    revoked_at = again.stdout.split("at ")[-1].removesuffix(" UTC\n")
    assert revoked_at in row and row.endswith(" laptop"), row


def test_a_log_dir_that_cannot_be_a_folder_is_refused_at_start(tmp_path, capsys):
    """A file (or a path under one) was a FileExistsError traceback at the fleet's first replica."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder")
    assert f"--log-dir: '{notes}' is a file, not a folder" in refused(["fleet", "--log-dir", str(notes)], capsys)
    assert f"--log-dir: cannot make the folder '{notes}/logs': Not a directory" in \
        refused(["fleet", "--log-dir", str(notes / "logs")], capsys)
    new = tmp_path / "fleet" / "logs"  # (the README's --log-dir .fairway/fleet need not exist yet)
    assert build_parser().parse_args(["fleet", "--log-dir", str(new)]).log_dir == new and new.is_dir()


def test_a_files_folder_that_is_a_file_stops_the_server_at_start(tmp_path):
    """`serve --files` naming a file started a server whose every upload then failed."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder")
    run = fairway("serve", "--files", str(notes), "--port", "1")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines()[-1].endswith(f"--files: '{notes}' is a file, not a folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any folder")
def test_a_files_folder_that_cannot_be_written_is_refused_at_start(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert f"--files: cannot write in the folder '{locked}'" in refused([*GATEWAY, "--files", str(locked)], capsys)


def test_a_files_folder_is_made_and_a_bucket_taken_as_it_is(tmp_path):
    new = tmp_path / "uploads" / "files"
    assert build_parser().parse_args(["serve", "--files", str(new)]).files == str(new) and new.is_dir()
    assert build_parser().parse_args([*GATEWAY, "--files", "s3://bucket"]).files == "s3://bucket"


@pytest.mark.parametrize("command", [["serve"], ["gateway", "--redis", "redis://127.0.0.1:6379/0"],
                                     ["gateway", "--redis", "redis://127.0.0.1:6379/0", "--reuse-port"]])
def test_a_taken_port_or_an_unknown_host_is_one_line_before_the_model_loads(command, tmp_path):
    """The API's port is bound at start: one held by another program was found only once the
    server had loaded the model and started (uvicorn's lines, exit 3), and `fairway up`'s
    SO_REUSEPORT gateways' bind was an OSError traceback once."""
    database = ["--database", f"sqlite:///{tmp_path / 'fairway.db'}"]
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        taken = fairway(*command, *database, "--port", str(port), timeout=30)
    assert taken.returncode == 2 and taken.stdout == "", taken
    assert taken.stderr == f"fairway {command[0]}: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    unknown = fairway(*command, *database, "--host", "no-such-host.invalid", "--port", "8000", timeout=30)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown
    assert unknown.stderr.startswith(f"fairway {command[0]}: cannot listen on no-such-host.invalid:8000: "), unknown


def test_a_replicas_taken_health_port_is_one_line_before_the_model_loads():
    """It was an OSError traceback once the model had loaded."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        taken = fairway("replica", "--redis", "redis://127.0.0.1:6379/0", "--namespace", "cli-test:",
                        "--health-port", str(port), timeout=30)
    assert taken.returncode == 2 and taken.stdout == "", taken
    assert taken.stderr == f"fairway replica: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_fleet_without_kubernetes_credentials_is_one_line(tmp_path, capsys):
    """A missing or broken kubeconfig was a ConfigException traceback."""
    from fairway.cli import main

    broken, scalar = tmp_path / "broken", tmp_path / "scalar"
    broken.write_text("not: [a kubeconfig")
    scalar.write_text("hello")
    for path in (tmp_path / "missing", broken, scalar):
        assert main(["fleet", "--backend", "kubernetes", "--kubeconfig", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fairway fleet: no Kubernetes credentials ({path}): ") and err.count("\n") == 1, err


def test_up_on_a_database_that_is_not_postgresql_says_so(capsys):
    """asyncpg's "invalid DSN: scheme is expected to be ..." was all it said (FAIRWAY_DATABASE_URL
    may well be serve's SQLite)."""
    from fairway.cli import main

    assert main(["up", "--database", "sqlite:///x.db"]) == 2
    assert capsys.readouterr().err == ("fairway: --database takes postgresql://user@host/db (up's gateways share "
                                       "one PostgreSQL), not 'sqlite:///x.db'\n")


def test_a_sqlite_database_that_is_not_one_is_one_line(tmp_path, capsys):
    """A text file or a folder as --database was the store's traceback (serve's after the model loaded)."""
    from fairway.cli import main

    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n" * 100)
    assert main(["keys", "list", "--database", f"sqlite:///{notes}"]) == 2
    assert capsys.readouterr().err == \
        f"fairway: --database sqlite:///{notes}: {notes} is not a SQLite database (file is not a database)\n"
    assert main(["keys", "list", "--database", f"sqlite:///{tmp_path}"]) == 2
    assert "is a folder, not a SQLite database" in capsys.readouterr().err
    assert notes.read_text() == "not a database\n" * 100


def test_keys_without_a_subcommand_names_them(capsys):
    """It said "the following arguments are required: keys_command", the code's name for it."""
    assert refused(["keys"], capsys).endswith("the following arguments are required: {create,revoke,list}")


def test_a_malformed_safety_policy_is_reported_before_the_model_loads(tmp_path):
    """The policy is read first: its one-line error comes at once (here the model named is no
    model, so an error about the model would mean the policy was read after it)."""
    policy = tmp_path / "policy.toml"
    policy.write_text('thresholds = "x"\n')
    not_a_model = tmp_path / "not-a-model.gguf"
    not_a_model.write_text("not a model\n")
    done = fairway("serve", "--safety-policy", str(policy), "--model", str(not_a_model), "--port", "1")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "policy.toml" in last and "[thresholds] must be a table" in last, done.stderr


@pytest.mark.parametrize("argv", [["generate"], ["chat"], ["serve"], ["gateway"], ["replica"], ["sandbox"], ["up"],
                                  ["fleet"], ["keys", "create"], ["keys", "revoke"], ["keys", "list"]])
def test_every_option_has_a_line_of_help(argv, capsys):
    """`fairway up --help` listed most of its options bare: each says what it is."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args([*argv, "--help"])
    assert caught.value.code == 0
    shown = "".join(capsys.readouterr().out.split())  # argparse wraps lines, within words too
    parser = build_parser()
    for word in argv:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    bare = [a.option_strings or a.dest for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and not (a.help and "".join(a.help.split()) in shown)]
    assert not bare, f"fairway {' '.join(argv)}: no help for {bare}"
