"""Data flows one way: a part imports only parts below it in LAYERS, never one above.

Read from the source (ast), nothing imported: every import counts, including those inside a
function and those only for type checking, since each is an arrow in the design. A back-arrow
means an interface is missing (or sits in the wrong part): move the shared piece down, don't
import up.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom first. A module belongs to the longest entry it starts with; it may import its own part
# and any part listed before it.
LAYERS = [
    # shared, imported by any layer; none imports a Fairway part above this group
    "fairway.domain",  # the domain's words: reply states, finish reasons, tiers, lanes, priorities
    "fairway.cache_dir",  # the cache folder (models' weights and tokenizers, compiled C)
    "fairway.block_hash",  # KV block prefix hashes: the engine's prefix cache, the router's affinity
    "fairway.server_gc",  # the garbage collector set for a long-running server process
    "fairway.uncancelled",  # work a cancelled caller leaves running to its end (a stream's cleanup)
    "fairway.native_build",  # compiling the C sources (the models' kernels, the relay's fast path)
    "fairway.usage.metrics",  # the Prometheus metrics: a leaf that replica and gateway both count in
    "fairway.redis_client",  # Redis connections (the relay, the replica registry and the limits use them)
    # one replica's model and engine
    "fairway.models",
    "fairway.engine",
    "fairway.safety",  # the classifiers: the replica's output check, the conversation's input check
    "fairway.sandbox",  # untrusted code under bubblewrap, in process or as a gRPC service
    # the serving middle, bottom up
    "fairway.relay",  # token log, job queue, inbox
    "fairway.tools",  # function calling: tool specs, prompts, the call parser, the execute_code loop
    "fairway.replica",  # the replica process, its job and report formats, the replica registry
    "fairway.router",  # placement: reads the registry
    "fairway.limits",  # quotas, rates, idempotency, single-flight: used by usage and the gateway
    "fairway.conversation",  # store, context builder, reply recorder
    "fairway.retrieval",  # embeddings and the vector index (in the conversation store's database)
    "fairway.memory",  # facts across conversations: extraction on the background lane, injection
    "fairway.files",  # uploads, their chunks, retrieval into a turn
    "fairway.usage",  # usage records and cost (accounting, pricing): settles the limits' reservations
    # the edge and the processes
    "fairway.web",  # the chat page's static files, served by the gateway
    "fairway.gateway",
    "fairway.assembly",  # putting the parts together: embedded, gateway and replica processes
    "fairway.up",  # `fairway up`: gateway and replica processes on this machine
    "fairway.fleet",  # `fairway fleet`: forecasts arrivals, adds and drains replicas (local or Kubernetes)
    "fairway.cli",
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str | None:
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(matches, key=len, default=None)


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) for each Fairway module the file imports; `from a import b` names a.b when b
    is a module of its own (as in `from fairway.usage import metrics`)."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = any((root / Path(*sub.split("."))).with_suffix(s).exists() for s in (".py", ""))
                found.append((node.lineno, sub if is_module else base))
    return sorted({(line, name) for line, name in found if name == "fairway" or name.startswith("fairway.")})


def back_arrows(root: Path) -> list[str]:
    """Every import from a lower part to a higher one, and every module with no place in LAYERS."""
    rank = {p: i for i, p in enumerate(LAYERS)}
    problems: list[str] = []
    for path in sorted((root / "fairway").rglob("*.py")):
        module = module_name(path, root)
        if module == "fairway":
            continue
        own = part_of(module)
        where = path.relative_to(root)
        if own is None:
            problems.append(f"{where}: {module} has no place in LAYERS (tests/test_layering.py): add its part")
            continue
        for line, target in imported_modules(path, root):
            other = part_of(target)
            if other is None:
                problems.append(f"{where}:{line} imports {target}, which has no place in LAYERS")
            elif rank[other] > rank[own]:
                problems.append(f"{where}:{line} imports {target}: {own} may not import {other}, which sits above it")
    return problems


def test_no_part_imports_a_higher_one():
    problems = back_arrows(ROOT)
    assert not problems, "back-arrows in the layering:\n" + "\n".join(problems)


def test_a_gateway_loads_no_torch():
    """What a gateway process imports (and the block hash the router will match) stays light:
    torch is for replicas alone."""
    code = ("import sys, fairway.block_hash, fairway.router, fairway.gateway, fairway.assembly; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_back_arrow_is_named(tmp_path):
    # The check itself, on a small tree: an engine module importing the gateway (through a
    # function-local and a relative import), and a module no layer claims.
    engine = tmp_path / "fairway" / "engine"
    engine.mkdir(parents=True)
    (tmp_path / "fairway" / "__init__.py").write_text("")
    (engine / "__init__.py").write_text("from fairway.models import llama\n")
    (engine / "step.py").write_text("def f():\n    from fairway.gateway.app import create_app\n")
    (engine / "ok.py").write_text("from . import step\nfrom .step import f\n")
    (tmp_path / "fairway" / "stray.py").write_text("")
    (tmp_path / "fairway" / "usage").mkdir()
    (tmp_path / "fairway" / "usage" / "__init__.py").write_text("")
    (tmp_path / "fairway" / "usage" / "metrics.py").write_text("")
    (tmp_path / "fairway" / "replica.py").write_text("from fairway.usage import metrics\n")
    assert back_arrows(tmp_path) == [
        "fairway/engine/step.py:2 imports fairway.gateway.app: fairway.engine may not import fairway.gateway, "
        "which sits above it",
        "fairway/stray.py: fairway.stray has no place in LAYERS (tests/test_layering.py): add its part",
    ]
