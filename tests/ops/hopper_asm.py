"""Our Triton kernels compiled for Hopper (sm_90) on any machine, no GPU needed (Triton compiles for a named
target without a driver; ptxas ships in its wheel): the PTX a test checks (``test_pdl.py``,
``test_decode_attention_asm.py``). Pointers and strides are declared 16-divisible, as the launcher specializes
them in a real launch; without that Triton would emit byte loads. Run with TRITON_INTERPRET unset (the
interpreter compiles nothing), e.g. ``python -m tests.ops.hopper_asm --cache fp8e4nv`` prints the decode
kernel's shared memory and instruction counts as JSON (formerly ``benchmarks/kernel_asm.py``)."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# the instruction families worth watching in an attention kernel's inner loop
WATCH = re.compile(r"^\s*((?:ld|st)\.shared[\w.]*|ldmatrix[\w.]*|stmatrix[\w.]*|cp\.async[\w.]*|mma[\w.]*|"
                   r"wgmma[\w.]*|cvt[\w.]*|ex2[\w.]*)", re.M)


def compile_for_hopper(kernel, types: dict[str, str], constexprs: dict, **options):
    """``kernel`` compiled for sm_90: arguments named in ``constexprs`` take those values, ``types`` gives the
    others' Triton types (default ``*i32`` for ``*_ptr``, else ``i32``); pointers, strides and ``block_size``
    are declared 16-divisible. ``options``: num_warps, num_stages, launch_pdl, ..."""
    if not hasattr(kernel, "arg_names"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted functions, not compilable")
    signature = {name: "constexpr" if name in constexprs else types.get(name, "*i32" if name.endswith("_ptr")
                                                                          else "i32")
                 for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if name.endswith("_ptr") or name.startswith("stride") or name == "block_size"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_decode(cache: str = "fp8e4nv", block_n: int = 128, warps: int = 4, stages: int = 3,
                   fp8_cvt: bool = True):
    """The compiled ``_decode_kernel`` for a Llama-shaped layer (4 query heads per KV head, head dim 128)."""
    from dsinfer.ops.triton import attention

    fp8 = cache != "bf16"
    constexprs = dict(GROUP=4, GROUP_PAD=16, BLOCK_N=block_n, HEAD_DIM=128, BLOCK_D=128, HAS_WINDOW=False,
                      PRECISION="tf32", UPCAST=False, Q_F16=fp8, FP8_CVT=fp8 and fp8_cvt)
    types = {"q_ptr": "*bf16", "cache_ptr": f"*{cache}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
             "scale_log2": "fp32", "v_scale": "fp32"}
    return compile_for_hopper(attention._decode_kernel, types, constexprs, num_warps=warps, num_stages=stages)


def instruction_counts(ptx: str) -> dict[str, int]:
    return dict(Counter(WATCH.findall(ptx)).most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default="fp8e4nv", choices=["bf16", "fp8e4nv", "fp8e5"])
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--no-fp8-cvt", action="store_true", help="let Triton place the value tile's conversion")
    opts = parser.parse_args()
    compiled = compile_decode(opts.cache, opts.block_n, opts.warps, opts.stages, not opts.no_fp8_cvt)
    print(json.dumps({"shared_bytes": compiled.metadata.shared,
                      "instructions": instruction_counts(compiled.asm["ptx"])}))


if __name__ == "__main__":
    main()
