"""Ops: one public function each, a Triton kernel on CUDA and a torch reference elsewhere (same signature).

The torch reference is also the CPU production path. ``dispatch.use_triton(tensor)`` decides per call.
"""

from dsinfer.ops.activation import silu_and_mul
from dsinfer.ops.attention import paged_attention
from dsinfer.ops.bitmask import apply_token_bitmask
from dsinfer.ops.kv_cache import store_kv
from dsinfer.ops.norm import rms_norm
from dsinfer.ops.rotary import apply_rotary, rotary_store_kv
from dsinfer.ops.sampling import greedy_argmax, gumbel_argmax

__all__ = [
    "apply_rotary", "apply_token_bitmask", "greedy_argmax", "gumbel_argmax", "paged_attention", "rms_norm",
    "rotary_store_kv", "silu_and_mul", "store_kv",
]
