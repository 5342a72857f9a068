"""Every ``DSINFER_*`` environment variable, declared once: name, type, default and doc.

Nothing else in dsinfer reads ``os.environ``. Values are parsed and validated when first read (and all of them by
``validate_all()`` at engine start-up), so a typo in a value fails loudly instead of being ignored. ``dsinfer env``
lists them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE - {''})}, got {raw!r}")


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"expected one of {list(choices)}, got {raw!r}")
        return raw

    return parse


PDL_ROLES = ("moe", "mla", "norm", "rope", "gqa", "split", "other")  # ops/triton/pdl.py's kernel roles


def _parse_early_trigger(raw: str) -> str:
    """off | all | dense | a comma-separated list of ``PDL_ROLES``, normalized (sorted, no spaces)."""
    if raw in ("off", "all", "dense"):
        return raw
    roles = sorted({part.strip() for part in raw.split(",")})
    unknown = [r for r in roles if r not in PDL_ROLES]
    if unknown or not roles:
        raise ValueError(f"expected off, all, dense or a comma-separated list of {list(PDL_ROLES)}, got {raw!r}")
    return ",".join(roles)


def _parse_positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError(f"expected a number > 0, got {raw!r}")
    return value


def _parse_non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {raw!r}")
    return value


@dataclass(frozen=True)
class EnvVar:
    name: str
    type_name: str
    default: Any
    doc: str
    parse: Callable[[str], Any]

    @property
    def raw(self) -> str | None:
        return os.environ.get(self.name)

    def get(self) -> Any:
        raw = self.raw
        if raw is None:
            return self.default
        key = (self.name, raw)
        if key not in _PARSED:  # parse each distinct value once (start-up and tests read them repeatedly)
            try:
                _PARSED[key] = self.parse(raw)
            except ValueError as exc:
                raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {exc}") from None
        return _PARSED[key]


_PARSED: dict[tuple[str, str], Any] = {}


_REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, type_name: str, default: Any, doc: str, parse: Callable[[str], Any]) -> EnvVar:
    assert name.startswith("DSINFER_") and name not in _REGISTRY, name
    var = EnvVar(name, type_name, default, doc, parse)
    _REGISTRY[name] = var
    return var


CACHE_DIR = _declare(
    "DSINFER_CACHE_DIR", "path", str(Path.home() / ".cache" / "dsinfer"),
    "Where converted models (GGUF -> safetensors + tokenizer.json) are cached.", str,
)
CPU_KV_CACHE_GB = _declare(
    "DSINFER_CPU_KV_CACHE_GB", "float", 2.0,
    "KV cache budget in GiB on CPU when `kv_cache_memory_gb` is not given.", _parse_positive_float,
)
DEVICE = _declare(
    "DSINFER_DEVICE", "str", "auto",
    "Device to run on: auto (cuda when available), cuda or cpu.", _parse_choice("auto", "cuda", "cpu"),
)
LOG_LEVEL = _declare(
    "DSINFER_LOG_LEVEL", "str", "INFO",
    "Log level of the dsinfer logger (any case).",
    lambda raw: _parse_choice("DEBUG", "INFO", "WARNING", "ERROR")(raw.upper()),
)
CPU_THREADS = _declare(
    "DSINFER_CPU_THREADS", "int", 0,
    "torch intra-op threads on CPU (0: leave torch's default).", _parse_non_negative_int,
)
CPU_SPIN_COUNT = _declare(
    "DSINFER_CPU_SPIN_COUNT", "int", 10_000_000,
    "GOMP_SPINCOUNT that `import dsinfer` sets before torch loads (when neither is loaded nor GOMP_SPINCOUNT / "
    "OMP_WAIT_POLICY set): torch's idle threads spin this long before sleeping, so a decode step's ~120 "
    "small parallel regions do not each wake a sleeping thread (0: libgomp's default).", _parse_non_negative_int,
)
CPU_QUANT_KERNEL = _declare(
    "DSINFER_CPU_QUANT_KERNEL", "str", "auto",
    "Quantized linears on CPU: auto (the C++ int8-dot kernel, built on first use, else dequantized weights), "
    "native (that kernel or an error) or torch (dequantized weights).", _parse_choice("auto", "native", "torch"),
)
ASYNC_SCHEDULING = _declare(
    "DSINFER_ASYNC_SCHEDULING", "bool", True,
    "Overlap CPU scheduling of step N+1 with GPU execution of step N (CUDA only).", _parse_bool,
)
DETERMINISTIC = _declare(
    "DSINFER_DETERMINISTIC", "bool", False,
    "Batch-invariant mode: reduction orders that do not depend on the batch.", _parse_bool,
)
STRUCTURED_CACHE_MB = _declare(
    "DSINFER_STRUCTURED_CACHE_MB", "float", 512.0,
    "Byte bound (MiB) of the compiled-grammar cache for structured outputs (least recently used evicted).",
    _parse_positive_float,
)
STRUCTURED_COMPILE_THREADS = _declare(
    "DSINFER_STRUCTURED_COMPILE_THREADS", "int", 2,
    "Threads that compile structured-output grammars off the scheduler thread (0 is taken as 1).",
    _parse_non_negative_int,
)
FUSE_SHARED_EXPERTS = _declare(
    "DSINFER_FUSE_SHARED_EXPERTS", "bool", True,
    "DeepSeek MoE: run the shared experts as extra experts of the routed grouped GEMM (off: a separate MLP).",
    _parse_bool,
)
SIDE_STREAM = _declare(
    "DSINFER_SIDE_STREAM", "bool", True,
    "In CUDA graphs, overlap independent work on a second stream: DeepSeek's separate shared experts beside the "
    "router and the routed experts, MLA's rope and latent-cache store beside the query absorption (off: one "
    "stream, in sequence).",
    _parse_bool,
)
CPU_FUSED_LAYER = _declare(
    "DSINFER_CPU_FUSED_LAYER", "bool", True,
    "A quantized Llama-family model's CPU decode steps run each decoder layer as one C++ call "
    "(ops/csrc/cpu_layer.cpp: the same kernels in the same order, bit for bit the module path); off: module by "
    "module.",
    _parse_bool,
)
FUSED_SILU_MUL = _declare(
    "DSINFER_FUSED_SILU_MUL", "bool", True,
    "An MLP's merged gate/up projection and its SiLU-mul run as one Triton kernel where benchmarks/tune_gemv.py "
    "stored one beating the projection followed by the SiLU-mul kernel (configs/moe.json, dense_silu_mul,N,K,"
    "<dtype>); off: always the two.",
    _parse_bool,
)
ROUTER_GEMV = _declare(
    "DSINFER_ROUTER_GEMV", "bool", True,
    "DeepSeek MoE on CUDA: batches of up to 64 tokens get their gate logits from a split-K Triton GEMV whose "
    "partial sums the routing kernel adds (off: cuBLAS's GEMV, in one thread block at these sizes). V2-Lite "
    "decode at batch 1 / 16 / 64: 0.08-0.11 ms a step faster (docs/benchmarks.md, session 16).",
    _parse_bool,
)
TRITON_GEMV = _declare(
    "DSINFER_TRITON_GEMV", "bool", True,
    "Linear layers of up to 64 rows on CUDA run the Triton tile that benchmarks/tune_gemv.py stored for their "
    "weight shape where it beat cuBLAS on the GPU (configs/moe.json, dense,N,K,<dtype>); off: always cuBLAS.",
    _parse_bool,
)
PDL = _declare(
    "DSINFER_PDL", "bool", True,
    "On CUDA sm_90+, launch dsinfer's Triton kernels with programmatic dependent launch: a kernel starts (and the "
    "dense GEMM prefetches its first weight tiles) while the previous one finishes, waiting for its results "
    "before it reads them (ops/triton/pdl.py). Off: every kernel starts after the previous one has finished.",
    _parse_bool,
)
PDL_EARLY_TRIGGER = _declare(
    "DSINFER_PDL_EARLY_TRIGGER", "str", "mla,split",
    "With DSINFER_PDL, which kernels let the next one launch before they wait for their own predecessor (not "
    "after), so that a GEMV's weight prefetch and a kernel's metadata reads start while the kernel two back still "
    "runs (ops/triton/pdl.py): off; all; dense (all but moe); or a comma-separated list of kernel roles: moe "
    "(routing and expert kernels), mla (the MLA decode's split combine), norm (RMSNorm), rope (rotary / MLA "
    "preamble and cache store), gqa (the GQA decode's split combine), split (split-K sums), other. Default "
    "mla,split: at batch 1 V2-Lite 1-4% and Llama 1% faster than with mla alone, V2-Lite ties at 16 and 64 "
    "(session 20); gqa was 1% slower for Llama; all 6-8% slower for V2-Lite.",
    _parse_early_trigger,
)
USE_TRITON = _declare(
    "DSINFER_USE_TRITON", "str", "auto",
    "Use Triton kernels: auto (on CUDA), always (also TRITON_INTERPRET on CPU) or never.",
    _parse_choice("auto", "always", "never"),
)


def _parse_fault(raw: str) -> tuple[str, int] | None:
    """``kind:step=N`` (kind: raise, stall or kill; N >= 1) as ``(kind, N)``; "" or "off" as None."""
    if raw in ("", "off"):
        return None
    kind, _, rest = raw.partition(":")
    key, _, number = rest.partition("=")
    if kind not in ("raise", "stall", "kill") or key != "step" or not number.isdigit() or int(number) < 1:
        raise ValueError(f"expected raise:step=N, stall:step=N or kill:step=N (N >= 1) or off, got {raw!r}")
    return kind, int(number)


FAULT_INJECT = _declare(
    "DSINFER_FAULT_INJECT", "str", None,
    "Testing only: a fault in the model's N-th step (counted from 1 by the executor, read at start-up): "
    "raise:step=N raises in it, stall:step=N hangs in it (for DSINFER_STEP_TIMEOUT_S to catch), kill:step=N "
    "kills the worker process with SIGKILL (mp executor only). Unset or off: no fault.",
    _parse_fault,
)
STEP_TIMEOUT_S = _declare(
    "DSINFER_STEP_TIMEOUT_S", "float", 600.0,
    "Watchdog: a model step running longer than this many seconds kills the engine (every request in flight "
    "fails, the server exits non-zero; offline, the mp executor's worker is killed and generate raises).",
    _parse_positive_float,
)


def all_vars() -> list[EnvVar]:
    return list(_REGISTRY.values())


def validate_all() -> None:
    """Parse every variable that is set; raise a ValueError naming the first bad one."""
    for var in _REGISTRY.values():
        var.get()
DIST_TIMEOUT_S = _declare(
    "DSINFER_DIST_TIMEOUT_S", "float", 120.0,
    "Tensor parallelism: a collective (all-reduce, all-gather) that has not completed within this many seconds "
    "fails its rank, so a rank that died or hangs is noticed (ranks spawned by dsinfer are also watched through "
    "their processes, at once).",
    _parse_positive_float,
)
NUMA_BIND = _declare(
    "DSINFER_NUMA_BIND", "bool", True,
    "Tensor parallelism: bind each rank's CPU threads to the NUMA node of its GPU (CPU runs: disjoint core sets "
    "per rank); off: leave the affinity as inherited.",
    _parse_bool,
)


# The launcher's variables (torchrun, SLURM wrappers, Kubernetes): standard names, not dsinfer's, read here as
# every variable is. ``launcher_env()`` gives those that are set.
LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launcher_env() -> dict[str, str]:
    """The launcher's rendezvous variables that are set (``LAUNCHER_VARS``), unparsed."""
    return {name: os.environ[name] for name in LAUNCHER_VARS if os.environ.get(name)}


def torchelastic_agent_store() -> bool:
    """torchrun's agent hosts the rendezvous store on MASTER_PORT (``TORCHELASTIC_USE_AGENT_STORE``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (None: every GPU is visible)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")
