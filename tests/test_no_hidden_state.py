"""The forward path keeps no hidden state and imports one way, checked on the source (``ast``).

- ops, layers and models hold no ``global`` statement, read no ``DSINFER_*`` variable inside a function and write
  no module-level container from a function (what a step derives lives on its ``ForwardBatch``; kernel choices
  come from ``KernelConfig`` at start-up), except what is allow-listed below with its reason;
- ops, layers and models never import the runner, the engine, the scheduler or the executor;
- imports run one way below the layers: ``ops`` -> ``batch_invariant`` -> ``ops.triton`` -> the ops' leaf helpers
  (``ops._common``, ``ops.options``, ``ops.dispatch``), and ``ops`` never imports ``sampling``.

Imports inside functions count as much as module-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dsinfer"
FORWARD_PATH = ("ops", "layers", "models")
# module (dotted, under dsinfer) -> functions allowed a ``global`` statement, and why
GLOBALS_ALLOWED = {
    "ops.options": {"configure": "the process-wide kernel options, set once at start-up by the model loader"},
}
# module -> functions allowed to read ``envs.X.get()`` / ``.raw``, and why
ENV_READS_ALLOWED = {
    "ops.options": {"_from_envs": "the process-wide kernel options' initial values, read once at import"},
    "models.loader.gguf": {"cached_gguf_dir": "where converted GGUF models are cached: read when a model is "
                                              "resolved, at start-up"},
    "ops.cpu_quant": {"native_available": "the CPU quantized-linear kernel's choice and build directory: read once "
                                          "(functools.cache) when a quantized model finishes loading"},
}
# module -> module-level containers that functions may write, and why
MODULE_CONTAINERS_ALLOWED = {
    "ops.triton.moe_align": {"_PAIR_BLOCKS": "constants (sorted ids, padded count) keyed by pair count, block size "
                                             "and device: made in the warm-up, never per-step data"},
    "layers.rotary": {"_CACHES": "one cos/sin table per rope setup and device, made while the model is built"},
}
UPPER_PACKAGES = ("runner", "engine", "scheduler", "executor")
OPS_LEAVES = ("ops._common", "ops.options", "ops.dispatch")


def _modules(*packages: str) -> dict[str, ast.Module]:
    found = {}
    for package in packages:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return found


def _functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _is_env_read(node: ast.AST) -> bool:
    """``envs.NAME.get()`` or ``envs.NAME.raw``."""
    if isinstance(node, ast.Call):
        node = node.func
        if not (isinstance(node, ast.Attribute) and node.attr == "get"):
            return False
    elif not (isinstance(node, ast.Attribute) and node.attr == "raw"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "envs"
            and owner.attr.isupper())


def _imports(tree: ast.Module) -> set[str]:
    """Every dsinfer module a file imports (``from pkg import sub`` names ``pkg.sub`` when it is a module), as
    dotted names under dsinfer."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            modules = [s for s in subs if _is_module(s)]
            names |= set(modules) if modules else {node.module}
    return {n.removeprefix("dsinfer.") for n in names if n.startswith("dsinfer.")}


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _layer(module: str) -> str:
    """The import layer of an ops / batch_invariant module."""
    if module.startswith(OPS_LEAVES):
        return "leaf"
    if module.startswith("ops.triton"):
        return "ops.triton"
    return module.split(".")[0]


def test_no_global_statements_on_the_forward_path():
    found = []
    for name, tree in _modules(*FORWARD_PATH).items():
        for fn in _functions(tree):
            if any(isinstance(node, ast.Global) for node in ast.walk(fn)) and fn.name not in GLOBALS_ALLOWED.get(
                    name, {}):
                found.append(f"{name}.{fn.name}")
    assert found == [], f"global statements (per-step state belongs on the ForwardBatch): {found}"


def test_no_environment_reads_inside_functions_on_the_forward_path():
    found = []
    for name, tree in _modules(*FORWARD_PATH).items():
        for fn in _functions(tree):
            if fn.name in ENV_READS_ALLOWED.get(name, {}):
                continue
            found += [f"{name}.{fn.name}:{node.lineno}" for node in ast.walk(fn) if _is_env_read(node)]
    assert found == [], f"DSINFER_* read during a forward (read it into KernelConfig at start-up): {found}"


def _module_containers(tree: ast.Module) -> set[str]:
    containers = set()
    for node in tree.body:
        target, value = (node.targets[0], node.value) if isinstance(node, ast.Assign) else (
            (node.target, node.value) if isinstance(node, ast.AnnAssign) else (None, None))
        if isinstance(target, ast.Name) and isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict")):
            containers.add(target.id)
    return containers


MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add", "remove",
            "discard"}


def test_functions_write_no_module_level_container():
    found = []
    for name, tree in _modules(*FORWARD_PATH).items():
        shared = _module_containers(tree) - set(MODULE_CONTAINERS_ALLOWED.get(name, {}))
        for fn in _functions(tree):
            for node in ast.walk(fn):
                target = None
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                    targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                    target = next((t.value.id for t in targets if isinstance(t, ast.Subscript)
                                   and isinstance(t.value, ast.Name) and t.value.id in shared), None)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name)):
                    target = node.func.value.id if node.func.value.id in shared else None
                if target is not None:
                    found.append(f"{name}.{fn.name} writes {target}")
    assert found == [], f"module-level state written by a function: {found}"


def test_the_allow_lists_name_what_exists():
    """An allow-list entry whose module or function went away is dropped, not kept as a blank cheque."""
    modules = _modules(*FORWARD_PATH)
    for allowed in (GLOBALS_ALLOWED, ENV_READS_ALLOWED):
        for name, functions in allowed.items():
            assert set(functions) <= {fn.name for fn in _functions(modules[name])}, name
    for name, containers in MODULE_CONTAINERS_ALLOWED.items():
        assert set(containers) <= _module_containers(modules[name]), name


@pytest.mark.parametrize("package", FORWARD_PATH + ("batch_invariant", "core"))
def test_below_the_runner_nothing_imports_it(package):
    found = {f"{name} -> {target}" for name, tree in _modules(package).items() for target in _imports(tree)
             if target.split(".")[0] in UPPER_PACKAGES}
    assert found == set(), f"{package} imports the runner's side: {sorted(found)}"


# which layers a module of each layer may import (its own included)
MAY_IMPORT = {
    "ops": {"ops", "batch_invariant", "ops.triton", "leaf"},
    "batch_invariant": {"batch_invariant", "ops.triton", "leaf"},
    "ops.triton": {"ops.triton", "leaf"},
    "leaf": {"leaf"},
}


def test_ops_batch_invariant_and_kernels_import_one_way():
    found = []
    for name, tree in _modules("ops", "batch_invariant").items():
        for target in _imports(tree):
            if target == "envs" or target.startswith("config"):
                continue
            if target.split(".")[0] == "sampling" or (
                    target.split(".")[0] in ("ops", "batch_invariant") and _layer(target) not in MAY_IMPORT[
                        _layer(name)]):
                found.append(f"{name} ({_layer(name)}) -> {target} ({_layer(target)})")
    assert found == [], f"imports against ops -> batch_invariant -> ops.triton -> leaves: {found}"
