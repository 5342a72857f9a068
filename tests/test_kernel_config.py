"""``KernelConfig``: the ``DSINFER_*`` kernel switches read once at start-up, handed to the model's layers when it
is built, and set for the process (``ops.options``) by the loader; changing the environment afterwards changes
nothing in a running model."""

from __future__ import annotations

import dataclasses

from dsinfer import LLM, envs
from dsinfer.config import KernelConfig
from dsinfer.ops import options

# field -> (its variable, a value to set, what the field reads then)
VARIABLES = {
    "use_triton": ("DSINFER_USE_TRITON", "never", "never"),
    "triton_gemv": ("DSINFER_TRITON_GEMV", "0", False),
    "pdl": ("DSINFER_PDL", "0", False),
    "pdl_early_trigger": ("DSINFER_PDL_EARLY_TRIGGER", "rope, mla", "mla,rope"),
    "fused_silu_mul": ("DSINFER_FUSED_SILU_MUL", "0", False),
    "router_gemv": ("DSINFER_ROUTER_GEMV", "0", False),
    "side_stream": ("DSINFER_SIDE_STREAM", "0", False),
    "fuse_shared_experts": ("DSINFER_FUSE_SHARED_EXPERTS", "0", False),
    "cpu_fused_layer": ("DSINFER_CPU_FUSED_LAYER", "0", False),
}


def test_every_field_has_its_variable_and_the_defaults_agree():
    declared = {var.name: var for var in envs.all_vars()}
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    assert fields == set(VARIABLES)
    for name, (var, _, _) in VARIABLES.items():
        assert getattr(KernelConfig(), name) == declared[var].default, name


def test_from_envs_reads_each_variable(monkeypatch):
    for var, raw, _ in VARIABLES.values():
        monkeypatch.setenv(var, raw)
    kernel = KernelConfig.from_envs()
    assert {name: getattr(kernel, name) for name in VARIABLES} == {n: v[2] for n, v in VARIABLES.items()}


def test_the_engine_reads_them_at_start_up_and_the_layers_keep_them(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DSINFER_FUSED_SILU_MUL", "0")
    monkeypatch.setenv("DSINFER_TRITON_GEMV", "0")
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32")
    model = llm.engine.runner.model
    assert [layer.mlp.fused_silu_mul for layer in model.layers] == [False, False]
    assert options.current().triton_gemv is False  # set for the process by the loader
    monkeypatch.setenv("DSINFER_FUSED_SILU_MUL", "1")  # after start-up: nothing reads it again
    monkeypatch.setenv("DSINFER_TRITON_GEMV", "1")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}])
    assert [layer.mlp.fused_silu_mul for layer in model.layers] == [False, False]
    assert options.current().triton_gemv is False


def test_configure_returns_what_it_replaces():
    before = options.configure(options.configured(use_triton="always"))
    assert options.current().use_triton == "always"
    assert options.configure(before).use_triton == "always" and options.current() == before
