"""Weight-only quantized linears on CPU, in blocks of 32 along K (ggml's Q4_0 / Q4_1 / Q8_0 block layout).

Formats (``QuantizedWeight``):
- ``int4``: ``qweight`` uint8 [N, K/2], block b's byte j holding element j (low nibble) and j + 16 (high nibble);
  ``scales`` d and ``mins`` m float16 [N, K/32]: w = d * q + m, q in 0..15 (Q4_0: m = -8 d; Q4_1 as stored; Q4_K
  sub-blocks: d = d * sc, m = -dmin * mn).
- ``int8``: ``qweight`` int8 [N, K], ``scales`` float16 [N, K/32]: w = d * q (Q8_0; int8 from other checkpoints).

``int4_linear`` / ``int8_linear`` quantize the activations per row in blocks of 32 to int16 (scale max|x| / 32767,
round half to even; llama.cpp's int8 activations changed the bundled model's greedy answers) and take each block's
dot product in integers: the C++ kernel (``csrc/cpu_quant.cpp``, AVX2 madd_epi16, weight rows over torch's
threads, one weight read per 4 activation rows),
built on first use with the machine's own ``-march=native`` and cached under ``$DSINFER_CACHE_DIR``. The
``*_ref`` functions are the same arithmetic in torch (the tests compare the two); ``dequantize`` gives the dense
weight. Where the kernel cannot be built (no compiler), ``native_available()`` is False and the quantized layers
keep a dense weight instead (``layers.quant``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dsinfer import envs

logger = logging.getLogger(__name__)

BLOCK = 32
ACTIVATION_QMAX = 32767  # activations are quantized to int16 per block
FORMATS = ("int4", "int8")
_BUILD_FLAGS = b"-O3 -march=native -fno-math-errno -ffp-contract=off -fopenmp"
# the extension: these linears, the fused RMSNorm (``ops.norm.rms_norm_cpu``), decode attention
# (``ops.attention.decode_attention_cpu``), rope + KV store (``ops.rotary.rotary_store_kv``'s ``native_cpu``) and
# a whole decoder layer of a decode step over them (``ops.cpu_layer``); cpu_ops.h declares what they share
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = tuple(_CSRC / name for name in ("cpu_quant.cpp", "cpu_norm.cpp", "cpu_attention.cpp", "cpu_rotary.cpp",
                                           "cpu_layer.cpp"))
_HEADERS = (_CSRC / "cpu_ops.h",)


@dataclass
class QuantizedWeight:
    """One weight [N, K] in a ``FORMATS`` layout (``mins`` only for int4)."""

    fmt: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.qweight.shape
        return rows, cols * 2 if self.fmt == "int4" else cols


# ------------------------------------------------------------------------------------------------------------
# the native kernel


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_features() -> dict[str, bool]:
    """The x86 features the CPU kernels care about (read once from /proc/cpuinfo; all False elsewhere)."""
    flags = set(_cpu_flags().split())
    names = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512_vnni": "avx512_vnni",
             "avx_vnni": "avx_vnni", "avx512_bf16": "avx512_bf16", "amx_tile": "amx_tile", "amx_int8": "amx_int8"}
    return {name: flag in flags for name, flag in names.items()}


@functools.cache
def native_available() -> bool:
    """Whether the C++ kernels (these linears and the ops ``_SOURCES`` names) are built and loaded (building them
    on the first call, about 30 s; then cached)."""
    if envs.CPU_QUANT_KERNEL.get() == "torch":
        return False
    source = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    key = hashlib.sha256(source + _cpu_flags().encode() + torch.__version__.encode() + _BUILD_FLAGS).hexdigest()[:16]
    build_dir = Path(envs.CACHE_DIR.get()) / "torch_extensions" / f"cpu_quant-{key}"
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=f"dsinfer_cpu_quant_{key}", sources=[str(path) for path in _SOURCES], build_directory=str(build_dir),
            # -fopenmp: at::parallel_for is an OpenMP pragma in the ATen headers (serial without it); the
            # libgomp.so.1 it needs is the one torch loaded, so the kernel shares torch's thread pool;
            # -ffp-contract=off: a * b - c * d rounded as torch's separate ops round it (rope, bit for bit)
            extra_cflags=_BUILD_FLAGS.decode().split(), extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=str(envs.LOG_LEVEL.get()).upper() == "DEBUG",
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the layers fall back to dense weights
        if envs.CPU_QUANT_KERNEL.get() == "native":
            raise RuntimeError(f"DSINFER_CPU_QUANT_KERNEL=native but the kernel did not build: {exc}") from exc
        logger.warning("the CPU quantized-linear kernel did not build (%s: %.300s); quantized layers run on "
                       "dequantized weights", type(exc).__name__, exc)
        return False
    _register_fakes()
    return True


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the contiguous float32 [M, K] the kernels take (x itself when it is one: a decode step's linears
    are ~120 calls, and each reshape / cast / copy dispatch costs ~1-2 us)."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.reshape(-1, x.shape[-1]).float().contiguous()


def _shaped(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def int4_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for an int4 ``w``: [..., N] float32 (the native kernel; see the module doc)."""
    return _shaped(torch.ops.dsinfer_cpu.int4_linear.default(_rows(x), w.qweight, w.scales, w.mins), x, bias)


def int8_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for an int8 ``w``: [..., N] float32 (the native kernel; see the module doc)."""
    return _shaped(torch.ops.dsinfer_cpu.int8_linear.default(_rows(x), w.qweight, w.scales), x, bias)


def quant_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` by the native kernel of ``w``'s format (RuntimeError where it cannot be built)."""
    if not native_available():
        raise RuntimeError("the CPU quantized-linear kernel is not available (see the warning at start-up)")
    return int4_linear(x, w, bias) if w.fmt == "int4" else int8_linear(x, w, bias)


# ------------------------------------------------------------------------------------------------------------
# torch reference and (de)quantization


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int16-valued float32 [M, K/32, 32], scale [M, K/32]) as the kernel quantizes."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / ACTIVATION_QMAX
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-ACTIVATION_QMAX, ACTIVATION_QMAX)
    return q, d


def quant_linear_ref(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in float64 torch (exact integer block sums): the reference the tests compare."""
    flat = x.reshape(-1, x.shape[-1])
    q, d = quantize_activations_ref(flat)
    wq = unpack_int4(w.qweight) if w.fmt == "int4" else w.qweight
    wq = wq.double().reshape(wq.shape[0], -1, BLOCK)  # [N, B, 32]
    dots = torch.einsum("mbk,nbk->mnb", q.double(), wq)  # integer block sums
    y = (dots * d.double()[:, None, :] * w.scales.double()[None]).sum(-1)
    if w.fmt == "int4":
        y = y + (w.mins.double()[None] * (d.double() * q.double().sum(-1))[:, None, :]).sum(-1)
    y = y.float().view(*x.shape[:-1], -1)
    return y if bias is None else y + bias


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the block layout -> the values 0..15 as uint8 [N, K]."""
    blocks = qweight.reshape(qweight.shape[0], -1, BLOCK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(qweight.shape[0], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``unpack_int4``: values 0..15 [N, K] -> uint8 [N, K/2]."""
    blocks = values.to(torch.uint8).reshape(values.shape[0], -1, BLOCK)
    return (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).reshape(values.shape[0], -1)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The dense float32 weight [N, K]."""
    wq = unpack_int4(w.qweight) if w.fmt == "int4" else w.qweight
    blocks = wq.float().reshape(wq.shape[0], -1, BLOCK) * w.scales.float().unsqueeze(-1)
    if w.fmt == "int4":
        blocks = blocks + w.mins.float().unsqueeze(-1)
    return blocks.reshape(wq.shape[0], -1)


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """A dense [N, K] weight (K a multiple of 32) in ``fmt``: int8 symmetric (d = max|w| / 127), int4
    asymmetric (d = (max - min) / 15, m = min), per block of 32, rounding to nearest."""
    if fmt not in FORMATS:
        raise ValueError(f"quantization format must be one of {FORMATS}, got {fmt!r}")
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"a quantized weight needs K a multiple of {BLOCK}, got shape {tuple(weight.shape)}")
    blocks = weight.float().reshape(rows, -1, BLOCK)
    if fmt == "int8":
        d = (blocks.abs().amax(-1) / 127).half()
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d.float()))
        q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q.reshape(rows, cols).contiguous(), d.contiguous())
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / 15).half()
    m = low.half()
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d.float()))
    q = torch.round((blocks - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
    return QuantizedWeight("int4", pack_int4(q.reshape(rows, cols)), d.contiguous(), m.contiguous())


def _fake_linear(x: torch.Tensor, qweight: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


def _fake_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def _fake_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _fake_decode_attention(q: torch.Tensor, *rest) -> torch.Tensor:
    return torch.empty_like(q)


def _fake_rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, *rest) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype)


def _register_fakes() -> None:
    """Output shapes of the native ops, so ``torch.compile`` can trace through them."""
    for name in ("int4_linear", "int8_linear"):
        torch.library.register_fake(f"dsinfer_cpu::{name}")(_fake_linear)
    torch.library.register_fake("dsinfer_cpu::rms_norm")(_fake_rms_norm)
    torch.library.register_fake("dsinfer_cpu::add_rms_norm")(_fake_add_rms_norm)
    torch.library.register_fake("dsinfer_cpu::decode_attention")(_fake_decode_attention)
    torch.library.register_fake("dsinfer_cpu::rotary_store_kv")(_fake_rotary_store_kv)
