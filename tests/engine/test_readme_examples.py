"""README.md states signatures, flags and install steps; these checks keep it true without loading a model."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsinfer.engine.arg_utils import EngineArgs
from dsinfer.entrypoints.cli import build_parser
from dsinfer.entrypoints.llm import LLM

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _signature(prefix: str) -> list[tuple[str, object]]:
    """The ``name=default`` pairs of the README's ```prefix(...)``` (a ``"a" | "b"`` default is its first value)."""
    start = README.index(f"`{prefix}(") + len(prefix) + 2
    body = README[start:README.index(")`", start)]
    params = []
    for item in re.split(r",\s*", " ".join(body.split())):
        name, eq, default = item.partition("=")
        params.append((name, ast.literal_eval(default.split(" | ")[0]) if eq else inspect.Parameter.empty))
    return params


def test_llm_arguments_and_defaults_are_engine_args():
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    listed = dict(_signature("LLM"))
    assert listed == fields


def test_llm_chat_signature():
    actual = [(name, p.default) for name, p in inspect.signature(LLM.chat).parameters.items() if name != "self"]
    assert _signature("LLM.chat") == actual


def _options(parser) -> set[str]:
    """Every option string of the parser and of its subcommands, nested ones (``dsinfer bench serve``) included."""
    out = set()
    for action in parser._actions:
        out |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _options(sub)
    return out


def test_every_flag_in_the_cli_section_is_accepted():
    cli = README[README.index("## CLI"):README.index("## Supported models")]
    # `--opt_name` names vLLM's underscore spelling; `--flag value` the error format
    flags = {f for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]+", cli) if "_" not in f} - {"--flag", "--help"}
    known = _options(build_parser())
    assert flags and flags <= known, sorted(flags - known)
    short = set(re.findall(r"(?<![\w-])-(?:tp|pp|dp)\b", cli))
    assert short == {"-tp", "-pp", "-dp"} and short <= known


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("has_cuda, torch_line", [
    ("", 'pip install -q --no-deps --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"'),
    ("1", 'pip install -q  "torch>=2.11"'),
])
def test_make_install_takes_the_cpu_torch_wheel_without_cuda(has_cuda, torch_line):
    # README: `make demo` installs "torch (CPU wheel without CUDA)"; PyPI's Linux torch is the CUDA build
    result = subprocess.run(["make", "-n", "-W", "pyproject.toml", "install", f"HAS_CUDA={has_cuda}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert torch_line in result.stdout, result.stdout
