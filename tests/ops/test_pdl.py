"""Programmatic dependent launch (``ops.triton.pdl``): off CUDA nothing changes; every kernel that takes PDL waits
before its first load or store (checked in its source); for Hopper the kernels compile to a ``griddepcontrol``
wait before their first dependent load (the dense GEMM's L2 prefetch before it); on the GPU a chain of ops gives
the same bits with PDL on and off, eagerly and in a CUDA graph."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsinfer import envs
from dsinfer.ops.triton import pdl

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()

_COMPILE = """
from tests.ops.hopper_asm import compile_for_hopper
from dsinfer.ops.triton import moe, norm

bf16 = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr")}
ptx = compile_for_hopper(norm._rms_norm_kernel, dict(bf16, eps="fp32"),
                         dict(HAS_RESIDUAL=True, BLOCK_N=1024, PDL=True), num_warps=4, launch_pdl=True).asm["ptx"]
print(ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents"), ptx.rfind("ld.global"))
ptx = compile_for_hopper(norm._rms_norm_kernel, dict(bf16, eps="fp32"),
                         dict(HAS_RESIDUAL=True, BLOCK_N=1024, PDL=2), num_warps=4, launch_pdl=True).asm["ptx"]
print(ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents"), ptx.rfind("ld.global"))
ptrs = {n: "*bf16" for n in moe._gemm_kernel.arg_names if n.endswith("_ptr")}
ptrs.update(expert_ids_ptr="*i64", sorted_ids_ptr="*i32", num_padded_ptr="*i32", a_scale_ptr="*fp32",
            b_scale_ptr="*fp32", weight_ptr="*fp32")
const = dict(A_DIV=1, GATHER=False, GATED=False, FUSE_GU=False, MUL_WEIGHT=False, HAS_BIAS=False, FP8=False,
             GROUP_N=1, GROUP_K=1, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, EVEN_K=True, SCALAR_BS=False,
             A_DESC=False, B_DESC=False, UPCAST=False, A_SORTED=False, C_SORTED=False, SPLIT_K=1, PREFETCH_K=256,
             PDL=True)
ptx = compile_for_hopper(moe._gemm_kernel, ptrs, const, num_warps=4, num_stages=4, launch_pdl=True).asm["ptx"]
print(ptx.find("prefetch.global.L2"), ptx.find("griddepcontrol.wait"), ptx.count("prefetch.global.L2"))
"""


def test_off_cuda_nothing_changes(kernel_options):
    assert pdl.launch_args(torch.device("cpu")) == {}
    kernel_options(pdl_early_trigger="all")
    assert pdl.launch_args(torch.device("cpu")) == {}
    assert not pdl.enabled(torch.device("cpu"))
    kernel_options(pdl=False)
    assert pdl.launch_args(torch.device("cpu")) == {}


def test_early_trigger_policy(monkeypatch, kernel_options):
    """Which kernels signal before their wait, by role (``launch_args`` on a device that has PDL)."""
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    cuda = torch.device("cuda")
    roles = (pdl.OTHER, pdl.MOE, pdl.MLA_COMBINE, pdl.NORM, pdl.SPLIT_SUM)
    expected = {"off": (1, 1, 1, 1, 1), "all": (2, 2, 2, 2, 2), "dense": (2, 1, 2, 2, 2), "mla": (1, 1, 2, 1, 1),
                "norm, mla": (1, 1, 2, 2, 1), "split,other": (2, 1, 1, 1, 2)}
    for policy, orders in expected.items():
        monkeypatch.setenv("DSINFER_PDL_EARLY_TRIGGER", policy)  # parsed as start-up parses it
        kernel_options(pdl_early_trigger=envs.PDL_EARLY_TRIGGER.get())
        got = tuple(pdl.launch_args(cuda, role)["PDL"] for role in roles)
        assert got == orders, policy
    assert pdl.launch_args(cuda)["launch_pdl"] is True
    monkeypatch.delenv("DSINFER_PDL_EARLY_TRIGGER")
    kernel_options(pdl_early_trigger=envs.PDL_EARLY_TRIGGER.get())
    default = tuple(pdl.launch_args(cuda, role)["PDL"] for role in roles)
    assert default == (1, 1, 2, 1, 2)  # mla,split


def test_the_variable_is_validated(monkeypatch):
    from dsinfer import envs

    monkeypatch.setenv("DSINFER_PDL", "sometimes")
    with pytest.raises(ValueError, match="DSINFER_PDL"):
        envs.PDL.get()
    for bad in ("1", "mla,attention", ",", "off,mla"):
        monkeypatch.setenv("DSINFER_PDL_EARLY_TRIGGER", bad)
        with pytest.raises(ValueError, match="DSINFER_PDL_EARLY_TRIGGER"):
            envs.PDL_EARLY_TRIGGER.get()
    monkeypatch.setenv("DSINFER_PDL_EARLY_TRIGGER", " rope ,mla,rope")
    assert envs.PDL_EARLY_TRIGGER.get() == "mla,rope"


def test_prefetch_sizes():
    from dsinfer.ops.triton import moe

    assert moe.prefetch_elements(4096, 4096, 2) == 1024  # 8 MiB over 4,096 rows: 2 KiB a row
    assert moe.prefetch_elements(128, 1408, 2) == 1024  # capped by K (22 lines), rounded down to 16
    assert moe.prefetch_elements(1 << 20, 4096, 2) == 64  # at least one line
    assert moe.prefetch_elements(4096, 4096, 1) == 2048  # e4m3: 128 elements a line
    try:
        moe.PREFETCH_BYTES = 0
        assert moe.prefetch_elements(4096, 4096, 2) == 0
    finally:
        moe.PREFETCH_BYTES = 8 << 20


def test_kernels_compile_for_hopper_with_the_wait_before_their_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr:  # a Triton without the CUDA toolchain: nothing to check
        pytest.skip("this Triton cannot assemble for sm_90")
    assert done.returncode == 0, done.stderr[-2000:]
    norm_line, early_line, gemm_line = done.stdout.strip().splitlines()
    wait, launch, load = map(int, norm_line.split())
    assert 0 <= wait < launch < load  # wait, let the next kernel launch, then read (the weight may come first)
    wait, launch, load = map(int, early_line.split())
    assert 0 <= launch < wait < load  # TRIGGER_FIRST: let the next kernel launch, wait, then read
    first_prefetch, wait, count = map(int, gemm_line.split())
    assert 0 <= first_prefetch < wait and count >= 1  # the dense GEMM's weight prefetches go before the wait


def _chain(x, residual, norm_w, w_o, w13, w2, topk_w, topk_ids):
    """A V2-Lite decode layer's kernel kinds at one token: norm, a split-K GEMV tile (prefetching before its
    wait) and its sum, the residual norm, the fused MoE (pair blocks, router-chosen experts, the top-k sum)."""
    from dsinfer.ops import rms_norm
    from dsinfer.ops.moe import fused_moe
    from dsinfer.ops.triton.gemv import linear_triton

    h = rms_norm(x, norm_w, 1e-6)
    o = linear_triton(h, w_o, None, dict(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4,
                                         num_stages=4, split_k=4))
    h2, res2 = rms_norm(o, norm_w, 1e-6, residual)
    return fused_moe(h2, w13, w2, topk_w, topk_ids), res2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_same_bits_with_and_without_pdl_in_a_graph(kernel_options):
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    hidden, inter, experts = 2048, 1408, 16
    args = (torch.randn(1, hidden, generator=gen, **bf), torch.randn(1, hidden, generator=gen, **bf),
            1 + 0.1 * torch.randn(hidden, generator=gen, **bf),
            torch.randn(hidden, hidden, generator=gen, **bf) / hidden**0.5,
            torch.randn(experts, 2 * inter, hidden, generator=gen, **bf) / hidden**0.5,
            torch.randn(experts, hidden, inter, generator=gen, **bf) / inter**0.5,
            torch.rand(1, 6, generator=gen, device="cuda"),
            torch.randperm(experts, generator=gen, device="cuda")[:6].view(1, 6))
    results = {}
    for flag in ("0", "1", "early"):
        kernel_options(pdl=flag != "0", pdl_early_trigger="all" if flag == "early" else "off")
        eager = _chain(*args)
        _chain(*args)  # warm-up outside the capture (compiles, the pair-block constants)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain(*args)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        results[flag] = (eager, captured)
    for flag in ("1", "early"):
        for a, b in zip(results["0"][0] + results["0"][1], results[flag][0] + results[flag][1], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(results[flag][0], results[flag][1], strict=True):
            assert torch.equal(a, b)


# what a kernel may read before its wait: weights and the step's metadata, which no kernel of a forward writes
# (``pdl``'s module doc); by pointer argument, and through helpers that read only these
EARLY_POINTERS = {"w_ptr", "w_uk_ptr", "slot_ptr", "query_start_loc_ptr", "seq_lens_ptr"}
EARLY_HELPERS = {"_prefetch_rows", "_w_uk_tile", "_cos_sin_at", "_row_split"}


def test_every_pdl_kernel_waits_before_its_first_load_or_store():
    """A kernel launched with PDL may run beside the previous one: its source must call ``enter(PDL)`` before any
    load or store, but for loads of weights or of the step's metadata (``EARLY_POINTERS``, ``EARLY_HELPERS``)."""
    import importlib
    import inspect
    import pkgutil
    import re

    import dsinfer.ops.triton as package

    checked = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, fn in vars(module).items():  # JIT or (under TRITON_INTERPRET) interpreted kernels
            if "PDL" not in getattr(fn, "arg_names", ()) or fn.fn is pdl.enter.fn \
                    or fn.fn.__module__ != module.__name__:
                continue  # not a kernel of this module (``pdl.enter`` is imported everywhere)
            source = re.split(r"\)\s*:\n", inspect.getsource(fn.fn), maxsplit=1)[1]  # past the signature
            body = source.split('"""')[-1]  # past the docstring, if any
            wait = body.find("enter(PDL)")
            assert wait >= 0, f"{info.name}.{name} takes PDL but never calls enter(PDL)"
            early = body[:wait]
            assert not re.search(r"tl\.(store|atomic_\w+)\(|\.load\(\[|\.store\(\[", early), \
                f"{info.name}.{name} stores or loads a descriptor before its wait"
            for pointer in re.findall(r"tl\.load\(\s*(\w+)", early):
                assert pointer in EARLY_POINTERS, f"{info.name}.{name} reads {pointer} before its wait"
            for helper in re.findall(r"\b(_\w+)\(", early):
                helper_fn = getattr(module, helper, None)
                assert helper in EARLY_HELPERS or not hasattr(helper_fn, "fn"), \
                    f"{info.name}.{name} calls {helper} before its wait"
            checked.append(name)
    assert len(checked) >= 28 and "_gemm_kernel" in checked and "_rms_norm_kernel" in checked


def test_the_early_read_check_fails_a_kernel_that_reads_activations_early():
    """The source check above is not vacuous: the same patterns flag an activation load before the wait."""
    import re

    early = "    x = tl.load(x_ptr + cols)\n    w = tl.load(w_ptr + cols)\n"
    assert [p for p in re.findall(r"tl\.load\(\s*(\w+)", early) if p not in EARLY_POINTERS] == ["x_ptr"]
