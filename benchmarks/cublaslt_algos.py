"""Do cuBLASLt algorithms other than the one torch's cuBLAS call takes run Llama's decode GEMMs faster?

    python3 benchmarks/cublaslt_algos.py [M ...]      # default: M = 256 and 128 rows (decode batch sizes)

For each Llama-3.1-8B projection (qkv, o_proj, gate/up, down, lm_head) this times torch's matmul and every algorithm
cublasLtMatmulAlgoGetHeuristic returns (up to 64), through ctypes, each CUDA-graph timed while rotating over enough
weight copies (>= 400 MB) that the weights come from HBM and not L2, as in a decode step. The last line sums a
B=256 step's GEMMs (32 layers + lm_head) both ways. Session 25 (docs/benchmarks.md): a tie (torch / best:
6.024 / 6.001, 6.116 / 6.143 and 6.056 / 6.096 ms).
"""
import ctypes
import glob
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.roofline import capture_one_call  # noqa: E402


def load_lt():
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import site
    for d in site.getsitepackages():
        for p in glob.glob(os.path.join(d, "nvidia", "**", "libcublasLt.so*"), recursive=True):
            return ctypes.CDLL(p)
    raise RuntimeError("no libcublasLt")


vp = ctypes.c_void_p
lt = handle = workspace = None  # set by main(): the script needs a CUDA device


def ck(st, what):  # cublasStatus_t: 0 is success
    if st != 0:
        raise RuntimeError(f"{what}: cublas status {st}")


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeurResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


CUBLAS_COMPUTE_32F = 68
CUDA_R_32F = 0
CUDA_R_16BF = 14
WS = 32 << 20


def set_attr(fn, obj, attr, value, ctype):
    v = ctype(value)
    ck(fn(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), f"attr {attr}")


def make(M, N, K):
    """y[M,N] = x[M,K] @ w[N,K]^T as column-major D[N,M] = op(A=w)^T(KxN -> NxK) * B=x(KxM)."""
    desc = vp()
    ck(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
    set_attr(lt.cublasLtMatmulDescSetAttribute, desc, 3, 1, ctypes.c_int32)  # TRANSA = T
    set_attr(lt.cublasLtMatmulDescSetAttribute, desc, 4, 0, ctypes.c_int32)  # TRANSB = N
    a, b, d = vp(), vp(), vp()
    ck(lt.cublasLtMatrixLayoutCreate(ctypes.byref(a), CUDA_R_16BF, ctypes.c_uint64(K), ctypes.c_uint64(N),
                                     ctypes.c_int64(K)), "a")
    ck(lt.cublasLtMatrixLayoutCreate(ctypes.byref(b), CUDA_R_16BF, ctypes.c_uint64(K), ctypes.c_uint64(M),
                                     ctypes.c_int64(K)), "b")
    ck(lt.cublasLtMatrixLayoutCreate(ctypes.byref(d), CUDA_R_16BF, ctypes.c_uint64(N), ctypes.c_uint64(M),
                                     ctypes.c_int64(N)), "d")
    pref = vp()
    ck(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
    set_attr(lt.cublasLtMatmulPreferenceSetAttribute, pref, 1, WS, ctypes.c_uint64)
    res = (HeurResult * 64)()
    n = ctypes.c_int(0)
    ck(lt.cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, pref, 64, res, ctypes.byref(n)), "heur")
    return desc, a, b, d, [res[i] for i in range(n.value) if res[i].state == 0]


alpha = ctypes.c_float(1.0)
beta = ctypes.c_float(0.0)


def lt_mm(desc, a, b, d, algo, x, w, y):
    ck(lt.cublasLtMatmul(handle, desc, ctypes.byref(alpha), vp(w.data_ptr()), a, vp(x.data_ptr()), b,
                         ctypes.byref(beta), vp(y.data_ptr()), d, vp(y.data_ptr()), d, ctypes.byref(algo),
                         vp(workspace.data_ptr()), ctypes.c_size_t(WS),
                         vp(torch.cuda.current_stream().cuda_stream)), "matmul")


def graph_time(fn, reps=20):
    """Best of five means of ``reps`` back-to-back replays of a graph of one fn() call, in ms."""
    g = capture_one_call(fn)
    g.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / reps)
    return best


def time_shape(M, N, K):
    """(torch's µs, [(µs, heuristic index, max |diff| to torch) ...] fastest first, number of algorithms)."""
    copies = max(2, int(400e6 // (N * K * 2)) + 1)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    t_torch = graph_time(lambda: [torch.matmul(x, w.t(), out=y) for w, y in zip(ws, ys)]) / copies
    ref = F.linear(x, ws[0])
    desc, a, b, d, algos = make(M, N, K)
    times = []
    for i, h in enumerate(algos):
        try:
            t = graph_time(lambda h=h: [lt_mm(desc, a, b, d, h.algo, x, w, y) for w, y in zip(ws, ys)]) / copies
            lt_mm(desc, a, b, d, algos[i].algo, x, ws[0], ys[0])
            torch.cuda.synchronize()
            times.append((t * 1e3, i, (ys[0].float() - ref.float()).abs().max().item()))
        except RuntimeError as exc:
            print("  algo", i, "failed:", exc)
    return t_torch * 1e3, sorted(times), len(algos)


SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def main():
    global lt, handle, workspace
    lt = load_lt()
    handle = vp()
    ck(lt.cublasLtCreate(ctypes.byref(handle)), "create")
    workspace = torch.empty(WS, dtype=torch.uint8, device="cuda")
    Ms = [int(m) for m in (sys.argv[1:] or ["256", "128"])]
    torch.manual_seed(0)
    print(f"{'shape':8s} {'M':>4s} {'torch us':>9s} {'lt best us':>10s} {'#algos':>6s} {'lt[0] us':>9s} "
          f"{'TF/s torch':>10s} {'TF/s best':>9s} maxdiff")
    total_t = total_b = 0.0
    for M in Ms:
        for name, (N, K) in SHAPES.items():
            t_torch, times, n_algos = time_shape(M, N, K)
            t_best, i_best, diff = times[0]
            t0 = next((t for t, i, _ in times if i == 0), float("nan"))
            fl = 2 * M * N * K
            print(f"{name:8s} {M:4d} {t_torch:9.2f} {t_best:10.2f} {n_algos:6d} {t0:9.2f} {fl / t_torch / 1e6:10.0f} "
                  f"{fl / t_best / 1e6:9.0f} {diff:.3g} (algo #{i_best})")
            if M == 256:
                layers = 1 if name == "lm_head" else 32
                total_t += layers * t_torch / 1e3
                total_b += layers * t_best / 1e3
            torch.cuda.empty_cache()
    print(f"M=256 step GEMMs: torch {total_t:.3f} ms, best-of-lt {total_b:.3f} ms, saving {total_t - total_b:.3f} ms")


if __name__ == "__main__":
    main()
