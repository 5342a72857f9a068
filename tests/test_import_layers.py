"""The package layering of dsinfer, read from the source with ``ast`` (nothing is imported).

Every ``import`` counts: at module level, inside functions (lazy imports) and under ``if TYPE_CHECKING:``. A
module belongs to the node of its package (``dsinfer.runner.input_batch`` -> ``runner``); ``ops.triton`` is a node
of its own, and so is each top-level module (``tokenizer``, ``config``, ...). A node may import only nodes on a
lower row of ``LAYERS`` or on its own row. The edges that break that today are listed in ``KNOWN_VIOLATIONS`` with
who removes them: the test fails when a new one appears and when a listed one is gone (delete its line).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "dsinfer"

# Top to bottom; a node imports only nodes on lower rows (or on its own row).
LAYERS: list[tuple[str, ...]] = [
    ("dsinfer", "examples"),        # the package root (public names; LLM / EngineArgs lazily) and the demo
    ("server", "router"),           # FastAPI app, OpenAI / Anthropic routes, /metrics; the router over servers
    ("bench", "eval"),              # benchmarks (serving over HTTP, offline over LLM); accuracy over LLM
    ("entrypoints",),               # LLM, AsyncEngine, cli
    ("protocol",),                  # API schemas, chat encoding, tool / reasoning parsers
    ("engine",),                    # LLMEngine, SamplingParams, outputs, detokenizer
    ("scheduler", "kvcache"),       # token-budget scheduler and KV block manager: each other's contracts only
    ("executor",),                  # one interface over the runner (uni / mp)
    ("runner",),                    # ModelRunner, input batches, CUDA graphs
    ("kvstore",),                   # the KV store's tiers, keys, files (worker) and index (engine): core + config
    ("sampling", "structured"),     # the sampler; grammars and token bitmasks
    ("spec_decode",),               # drafters (n-gram), draft confidence, spec-decode counters: core + config only
    ("models",),                    # registry, loaders, llama, deepseek, mtp
    ("distributed",),               # EP dispatch / combine, EPLB (planner, balancer): over layers and ops
    ("layers",),                    # nn.Modules over ops
    ("distributed",),               # ParallelState and its collectives, rendezvous, process groups, NUMA binding
    ("ops",),                       # one public function per op: torch reference + dispatch to a kernel
    ("batch_invariant",),           # the deterministic mode's kernels, which the ops pick in that mode
    ("ops.triton",),                # the Triton kernels
    ("ops.base",),                  # ops/_common, options, dispatch: what the ops and their kernels share
    ("hf_tokenizer",),              # transformers' tokenizer API over the tokenizer
    ("tokenizer",),                 # tokenizers + tokenizer_config.json: nothing GPU
    ("chat_template",),             # the sandboxed jinja2 environment
    ("core",),                      # ForwardBatch, KVCacheSpec, Request: usable by all; imports config, envs
    ("config",),                    # EngineArgs -> EngineConfig: usable by all
    ("envs",),                      # environment variables: usable by all
]

# The only upward edges by design: the one ``dsinfer`` cli also has ``dsinfer serve``, ``dsinfer router``,
# ``dsinfer bench`` and ``dsinfer eval``, which import the server, router, bench and eval lazily, when that subcommand
# runs. The server and eval are built on entrypoints (AsyncEngine, LLM), so they sit above them, bench beside eval.
ALLOWED_UPWARD = {("entrypoints.cli", "server"), ("entrypoints.cli", "bench"), ("entrypoints.cli", "eval"),
                  ("entrypoints.cli", "router")}

# (importing module, imported node) -> who removes it: "boundary" (engine / scheduler / kvcache / runner / config)
# or "hidden-state" (layers / models / ops / batch_invariant / sampling).
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}  # none left: the boundary redesign removed the last ones

RANK = {node: row for row, nodes in enumerate(LAYERS) for node in nodes}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(module: str) -> bool:
    return (ROOT.parent / module.replace(".", "/") / "__init__.py").exists()


def _exists(module: str) -> bool:
    base = ROOT.parent / module.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def node_of(module: str) -> str:
    """``dsinfer.ops.triton.x`` -> ``ops.triton``; ``dsinfer.runner.x`` -> ``runner``; ``dsinfer`` -> ``dsinfer``."""
    parts = module.split(".")[1:]
    if not parts or parts[0] == "__main__":
        return "dsinfer"
    if parts[:2] == ["ops", "triton"]:
        return "ops.triton"
    if parts[:2] in (["ops", "_common"], ["ops", "options"], ["ops", "dispatch"]):
        return "ops.base"
    return parts[0]


def imported_modules(path: Path) -> set[str]:
    """Every dsinfer module ``path`` imports, anywhere in the file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for stmt in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(stmt, ast.Import):
            found |= {alias.name for alias in stmt.names}
        elif isinstance(stmt, ast.ImportFrom):
            if stmt.level:
                base = package.split(".")[: len(package.split(".")) - stmt.level + 1]
                source = ".".join(base + ([stmt.module] if stmt.module else []))
            else:
                source = stmt.module or ""
            # ``from dsinfer import ops``: the submodule; ``from dsinfer import SamplingParams``: the package root
            subs = {f"{source}.{alias.name}" for alias in stmt.names if _exists(f"{source}.{alias.name}")}
            found |= subs or {source}
            if len(subs) < len(stmt.names):
                found.add(source)
    return {name for name in found if name == "dsinfer" or name.startswith("dsinfer.")}


def module_edges() -> set[tuple[str, str]]:
    """(importing module, imported node) for every import that crosses from one node to another."""
    edges = set()
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for target in imported_modules(path):
            if node_of(target) != node_of(module):
                edges.add((module.removeprefix("dsinfer."), node_of(target)))
    return edges


def _upward(edge: tuple[str, str]) -> bool:
    module, target = edge
    source = node_of(f"dsinfer.{module}")
    return RANK[target] < RANK[source] and edge not in ALLOWED_UPWARD


def test_every_node_is_in_the_table():
    nodes = {node_of(_module_name(p)) for p in ROOT.rglob("*.py")}
    assert nodes <= set(RANK), f"place these in LAYERS: {sorted(nodes - set(RANK))}"


def test_imports_go_down_the_layers():
    upward = {edge for edge in module_edges() if _upward(edge)}
    new = sorted(upward - set(KNOWN_VIOLATIONS))
    gone = sorted(set(KNOWN_VIOLATIONS) - upward)
    assert not new, "imports up the layers (import from below, or move the code down): " + ", ".join(
        f"{m} -> {t}" for m, t in new)
    assert not gone, "fixed: delete these from KNOWN_VIOLATIONS: " + ", ".join(f"{m} -> {t}" for m, t in gone)


def test_allowed_upward_edges_are_still_there():
    assert ALLOWED_UPWARD <= module_edges()


def test_known_violations_name_their_owner():
    assert set(KNOWN_VIOLATIONS.values()) <= {"boundary", "hidden-state"}


def test_core_imports_only_config_envs_torch_numpy_msgpack():
    core = {t for m, t in module_edges() if node_of(f"dsinfer.{m}") == "core"}
    assert core <= {"config", "envs"}, sorted(core)
    third_party = set()
    for path in (ROOT / "core").rglob("*.py"):
        for stmt in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(stmt, ast.Import):
                third_party |= {alias.name.partition(".")[0] for alias in stmt.names}
            elif isinstance(stmt, ast.ImportFrom) and not stmt.level:
                third_party.add((stmt.module or "").partition(".")[0])
    third_party -= set(sys.stdlib_module_names) | {"__future__", "dsinfer"}
    assert third_party <= {"torch", "numpy", "msgpack"}, sorted(third_party)


def test_spec_decode_imports_only_core_and_config():
    """The drafters run on the engine's side (the n-gram one) or, later, beside the model (MTP): they see plain
    requests and the config, never the engine, the scheduler or the runner."""
    spec = {t for m, t in module_edges() if node_of(f"dsinfer.{m}") == "spec_decode"}
    assert spec <= {"core", "config"}, sorted(spec)


def test_config_imports_nothing_of_engine_models_runner_scheduler():
    config = {(m, t) for m, t in module_edges() if m == "config" and t in {"engine", "models", "runner", "scheduler"}}
    assert config <= set(KNOWN_VIOLATIONS), sorted(config - set(KNOWN_VIOLATIONS))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_packages():
    """Counted without the known violations (every cycle today runs through one of them) and without the cli's
    lazy start of the server; ``ops``, ``ops.triton`` and ``batch_invariant`` are nodes of their own."""
    graph = defaultdict(set)
    for module, target in module_edges() - set(KNOWN_VIOLATIONS) - ALLOWED_UPWARD:
        graph[node_of(f"dsinfer.{module}")].add(target)
    assert not _cycles(graph)


HEAVY = ("fastapi", "uvicorn", "xgrammar", "gguf", "jinja2", "transformers")


def test_import_dsinfer_leaves_heavy_modules_unloaded():
    code = f"import dsinfer, sys; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT.parent, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [], f"import dsinfer loads {run.stdout.strip()}: import it where it is used"
