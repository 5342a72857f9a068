"""The configuration tree: one frozen dataclass per concern, built once by ``EngineArgs.create_engine_config()``
(``engine/arg_utils.py``: what a user can set, validated and resolved against the model's files).

This module imports nothing of dsinfer but ``envs``, so every layer can read the tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsinfer import envs

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# weight-only quantized linears on CPU (layers/quant.py): "gguf" keeps a GGUF file's own 4/8-bit blocks, "int8" and
# "int4" quantize any checkpoint (a GGUF's blocks taken as they are where the layout allows)
QUANTIZATIONS = ("gguf", "int8", "int4")
# vLLM's distributed_executor_backend: "uni" runs the model in the engine's process, "mp" in worker processes
# (one per tensor-parallel rank)
EXECUTOR_BACKENDS = ("uni", "mp")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's parallel sizes that dsinfer does not split a model by yet: 1 is the only value (``check_parallel_size``);
# tensor_parallel_size and data_parallel_size are ParallelConfig's
PARALLEL_SIZES = ("pipeline_parallel_size",)
# vLLM's --kv-cache-dtype values: "auto" keeps the model's dtype; "fp8" is e4m3 (per-layer scales, see Attention)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}



@dataclass(frozen=True)
class ModelConfig:
    path: Path  # HF-style directory (config.json, weights, tokenizer)
    hf_config: dict[str, Any]  # config.json, after hf_overrides
    dtype: torch.dtype
    max_model_len: int
    served_model_name: str
    generation_config: dict[str, Any] = field(default_factory=dict)  # the model's generation_config.json
    trust_chat_template: bool = True
    # The SamplingParams values that requests (and LLM.generate without params) leave unset take (vLLM's
    # ModelConfig.get_diff_sampling_param): EngineArgs.generation_config's file, then override_generation_config
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # A ceiling on every server request's max_tokens (vLLM's override_max_tokens): the max_new_tokens of a
    # generation_config folder or of override_generation_config; the model's own file gives only a default
    max_tokens_limit: int | None = None
    # The most logprobs / prompt_logprobs (the server's top_logprobs) a request may ask for (vLLM's max_logprobs);
    # -1: up to the vocabulary size. ``logprobs_limit`` is the resolved number
    max_logprobs: int = 20
    # weight-only quantization of the linears (one of QUANTIZATIONS) or None: dense weights of ``dtype``
    quantization: str | None = None
    # the quantized checkpoint of a GGUF model (``quantization``'s packs, written once beside the converted
    # directory: ``models/loader/gguf_quant.py``); None: weights come from ``path``
    quantized_weights: Path | None = None

    @property
    def logprobs_limit(self) -> int:
        return self.vocab_size if self.max_logprobs == -1 else self.max_logprobs

    @property
    def architecture(self) -> str:
        return self.hf_config["architectures"][0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.generation_config.get("eos_token_id", self.hf_config.get("eos_token_id"))
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [int(eos)]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float | None = None  # KV budget; None: DSINFER_CPU_KV_CACHE_GB on CPU, free memory on GPU
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use in all
    num_kv_blocks: int | None = None  # exact block count (overrides the budget; tests use it to force preemption)
    cache_dtype: torch.dtype | None = None  # KV cache element type; None: the model's dtype
    # where the measured step-latency curve is kept (core/step_latency.py); None: $DSINFER_CACHE_DIR/step_latency,
    # "": not persisted (measured at every start)
    step_latency_dir: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # requests in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (the token budget)
    enable_chunked_prefill: bool = True  # split long prompts across steps
    policy: str = "fcfs"  # fcfs | priority: the waiting queue's order and who is preempted (scheduler.py)


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    seed: int = 0  # dummy weights and unseeded sampling start from this


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device
    deterministic: bool = False  # batch-invariant kernels
    async_scheduling: bool = True  # overlap CPU scheduling of step N+1 with GPU execution of step N
    enforce_eager: bool = False  # no CUDA graphs
    # steps with prompt tokens up to this many run through piecewise CUDA graphs (runner/prefill_graphs.py); 0: eager
    max_prefill_graph_tokens: int = 2048


# the models whose routed experts partition over expert-parallel ranks (``enable_expert_parallel``)
EP_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
EPLB_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


@dataclass(frozen=True)
class EplbConfig:
    """Expert-parallel load balancing (vLLM's ``eplb_config``): redundant experts and periodic rebalancing
    (``distributed/eplb``). ``from_dict`` validates the user's dict (a ValueError naming the field)."""

    window_size: int = 1000  # steps of expert loads the planner reads (the ring buffer's length)
    step_interval: int = 3000  # steps between rebalances (the first comes after a quarter of it)
    num_redundant_experts: int = 0  # physical experts per MoE layer beyond the logical ones (replicas)
    log_balancedness: bool = False  # log moe_lb (max rank load / mean) of the window at each rebalance

    @classmethod
    def from_dict(cls, value: Any) -> EplbConfig:
        if value is None or isinstance(value, EplbConfig):
            return value or cls()
        if not isinstance(value, dict):
            raise ValueError(f"eplb_config must be a dict, got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"eplb_config: unknown key(s) {unknown}; known: {sorted(known)}")
        out = cls()
        for name, low in (("window_size", 1), ("step_interval", 1), ("num_redundant_experts", 0)):
            got = value.get(name, getattr(out, name))
            if isinstance(got, bool) or not isinstance(got, int) or got < low:
                raise ValueError(f"eplb_config.{name} must be an integer >= {low}, got {got!r}")
        log = value.get("log_balancedness", False)
        if not isinstance(log, bool):
            raise ValueError(f"eplb_config.log_balancedness must be true or false, got {log!r}")
        return cls(**{**value, "log_balancedness": log})

    def check_model(self, enable_eplb: bool, hf_config: dict[str, Any]) -> None:
        """ValueErrors for EPLB settings this model cannot take."""
        if not enable_eplb:
            if self.num_redundant_experts:
                raise ValueError(f"eplb_config.num_redundant_experts={self.num_redundant_experts} needs "
                                 "enable_eplb=True (redundant experts are EPLB's)")
            return
        arch = (hf_config.get("architectures") or ["?"])[0]
        if arch not in EPLB_ARCHITECTURES or not hf_config.get("n_routed_experts"):
            raise ValueError(f"enable_eplb=True needs a DeepSeek V2 / V3 / V3.2 MoE model ({EPLB_ARCHITECTURES} "
                             f"with n_routed_experts); {arch} has no routed experts dsinfer can balance")


@dataclass(frozen=True)
class ParallelConfig:
    distributed_executor_backend: str = "uni"  # uni (in process) | mp (worker processes): dsinfer/executor/
    # ranks the model's heads, MLP columns and vocabulary are split over (one GPU each; "mp" above 1); the world
    # size of the torch.distributed group (dsinfer/distributed/)
    tensor_parallel_size: int = 1
    # vLLM's enable_expert_parallel: the routed experts partitioned over the ranks (EP size = tensor_parallel_size
    # x data_parallel_size) instead of split by intermediate columns
    enable_expert_parallel: bool = False
    # vLLM's data_parallel_size: with expert parallelism, DP attention: each rank its own scheduler, KV cache and
    # batch (engine/dp_engine.py), the MoE layers across all of them (tensor_parallel_size is then 1)
    data_parallel_size: int = 1
    enable_eplb: bool = False  # expert-parallel load balancing (vLLM's name): counters, replicas, rebalances
    eplb_config: EplbConfig = EplbConfig()  # its settings (vLLM's names)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are partitioned over (1: expert parallelism off)."""
        return self.world_size if self.enable_expert_parallel else 1


SPEC_METHODS = ("ngram", "mtp")  # vLLM's names: n-gram prompt lookup, the checkpoint's multi-token prediction layers
_REGISTERED_METHODS: set[str] = set()  # drafters plugged in by ``spec_decode.register_drafter`` (benchmarks)


def register_spec_method(name: str) -> None:
    """Accept ``name`` as a speculative_config method (``spec_decode.register_drafter`` supplies its drafter)."""
    _REGISTERED_METHODS.add(name)


SPEC_ACCEPTANCE = ("rejection", "exact")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): who drafts, how many tokens, how drafts are verified.

    ``from_dict`` reads the user's dict (validated: a ValueError naming the field); ``num_speculative_tokens == 0``
    is speculation off. Greedy requests keep a draft while it equals the target's argmax in either acceptance mode.
    """

    # draft tokens a step may verify per request (0: one-token steps); sizes the multi-token decode CUDA graphs
    num_speculative_tokens: int = 0
    method: str = "ngram"  # one of SPEC_METHODS
    prompt_lookup_min: int = 2  # n-gram: the shortest suffix of the tokens matched in prompt + output
    prompt_lookup_max: int = 4  # n-gram: the longest (tried first)
    # sampled requests: "exact" keeps d only when it equals the target's own seeded sample there, so a seeded
    # request's tokens are those of decoding without speculation; "rejection" keeps draft d with probability p(d)
    # (q one-hot) and otherwise resamples from p without d: the target's distribution, not its tokens. For one-hot
    # drafts (n-gram) both keep d with probability p(d), so "exact" is the default
    acceptance: str = "exact"
    # verify only the draft prefix whose predicted acceptance pays for its cost (drafts carry a confidence)
    confidence_scheduling: bool = False

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """A user's ``speculative_config`` (None or {}: off). Unknown keys, an unknown method or acceptance,
        k outside [1, MAX_SPECULATIVE_TOKENS] and prompt_lookup_min > prompt_lookup_max are ValueErrors naming the
        field. One of the two lookup bounds given alone sets the other too (vLLM's rule)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value or cls()
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        if not value:
            return cls()
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "acceptance",
                 "confidence_scheduling"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        method = value.get("method", "ngram")
        if method not in SPEC_METHODS and method not in _REGISTERED_METHODS:
            raise ValueError(f"speculative_config.method must be one of "
                             f"{SPEC_METHODS + tuple(sorted(_REGISTERED_METHODS))}, got {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required (the draft tokens a step "
                             f"verifies, 1 to {MAX_SPECULATIVE_TOKENS})")
        k = _spec_int("num_speculative_tokens", value["num_speculative_tokens"], 1, MAX_SPECULATIVE_TOKENS)
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:
            low, high = cls.prompt_lookup_min, cls.prompt_lookup_max
        low = _spec_int("prompt_lookup_min", high if low is None else low, 1, 1 << 10)
        high = _spec_int("prompt_lookup_max", low if high is None else high, 1, 1 << 10)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        acceptance = value.get("acceptance", cls.acceptance)
        if acceptance not in SPEC_ACCEPTANCE:
            raise ValueError(f"speculative_config.acceptance must be one of {SPEC_ACCEPTANCE}, got {acceptance!r}")
        confidence = value.get("confidence_scheduling", False)
        if not isinstance(confidence, bool):
            raise ValueError(f"speculative_config.confidence_scheduling must be true or false, got {confidence!r}")
        return cls(k, method, low, high, acceptance, confidence)

    def check_model(self, hf_config: dict[str, Any]) -> None:
        """A ValueError when the method cannot draft for this checkpoint (MTP without MTP layers)."""
        if self.enabled and self.method == "mtp":
            layers = int(hf_config.get("num_nextn_predict_layers") or 0)
            if layers < 1:
                raise ValueError("speculative_config.method='mtp' needs a checkpoint with MTP layers "
                                 f"(num_nextn_predict_layers >= 1); {hf_config.get('architectures')} has {layers}: "
                                 "use method='ngram'")


def _spec_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


DEFAULT_RETENTION = "default"  # the traffic class of a request that names none
DEFAULT_TTL_S = 7 * 86400.0  # that class's TTL unless ``ttl_s`` sets it


@dataclass(frozen=True)
class KVStoreConfig:
    """The KV cache store beyond GPU memory (``kvstore/``): off unless a host budget or a directory is given.

    ``from_dict`` reads the user's dict (``LLM(kv_store=...)``, ``dsinfer serve --kv-store JSON``) and raises a
    ValueError naming the field for an unknown key, a negative size, a grain that is not a multiple of the block
    size, or a directory that is missing or not writable.
    """

    host_gb: float = 0.0  # host-memory tier budget in GiB (pinned on CUDA); 0: no host tier
    dir: Path | None = None  # directory tier (local disk or a shared file system); None: none
    dir_gb: float | None = None  # the directory's budget in GiB (every model's entries); None: the disk's space
    grain: int = 128  # tokens per stored entry: a multiple of the KV block size
    # traffic class -> seconds an entry may go unused (a request names its class: ``kv_retention``)
    ttl_s: tuple[tuple[str, float], ...] = ((DEFAULT_RETENTION, DEFAULT_TTL_S),)
    save_queue: int = 256  # grains waiting to be written before further saves are dropped
    high_watermark: float = 0.95  # a tier past this fraction of its budget evicts (LRU) ...
    low_watermark: float = 0.85  # ... down to this fraction
    gc_interval_s: float = 60.0  # the background sweep's period (expiries, the directory's watermark)
    # loads read at once (file reads and checksums run outside the GIL): one 2k-token Llama-8B prefix is ~270 MB, a
    # single reader fell behind 8 requests/s of P/D on the H200
    load_threads: int = 4

    @property
    def enabled(self) -> bool:
        return self.host_gb > 0 or self.dir is not None

    def ttl_of(self, retention: str | None) -> float:
        """The TTL of a traffic class (None: the default class); ValueError for a class the config lacks."""
        classes = dict(self.ttl_s)
        name = retention or DEFAULT_RETENTION
        if name not in classes:
            raise ValueError(f"kv_retention={retention!r} is not a traffic class of kv_store.ttl_s; known: "
                             f"{sorted(classes)}")
        return classes[name]

    @classmethod
    def from_dict(cls, value: Any, block_size: int) -> KVStoreConfig:
        if value is None or isinstance(value, KVStoreConfig):
            return value or cls()
        if not isinstance(value, dict):
            raise ValueError(f"kv_store must be a dict, got {type(value).__name__}")
        known = {"host_gb", "dir", "dir_gb", "grain", "ttl_s", "save_queue", "high_watermark", "low_watermark",
                 "gc_interval_s", "load_threads"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_store: unknown key(s) {unknown}; known: {sorted(known)}")
        host_gb = _store_number("host_gb", value.get("host_gb", 0.0), 0.0)
        dir_gb = value.get("dir_gb")
        dir_gb = None if dir_gb is None else _store_number("dir_gb", dir_gb, 0.0, strict=True)
        grain = value.get("grain", cls.grain)
        if isinstance(grain, bool) or not isinstance(grain, int) or grain <= 0 or grain % block_size:
            raise ValueError(f"kv_store.grain must be a positive multiple of the KV block size ({block_size}), "
                             f"got {grain!r}")
        directory = value.get("dir")
        if directory is not None:
            directory = _store_dir(directory)
        elif dir_gb is not None:
            raise ValueError("kv_store.dir_gb is set but kv_store.dir is not: name the directory")
        ttl = value.get("ttl_s", {})
        if not isinstance(ttl, dict):
            raise ValueError(f"kv_store.ttl_s must map traffic classes to seconds, got {ttl!r}")
        classes = {DEFAULT_RETENTION: DEFAULT_TTL_S}
        for name, seconds in ttl.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"kv_store.ttl_s: a traffic class must be a non-empty string, got {name!r}")
            classes[name] = _store_number(f"ttl_s[{name!r}]", seconds, 0.0, strict=True)
        queue = value.get("save_queue", cls.save_queue)
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
            raise ValueError(f"kv_store.save_queue must be an integer >= 1, got {queue!r}")
        high = _store_number("high_watermark", value.get("high_watermark", cls.high_watermark), 0.0, strict=True)
        low = _store_number("low_watermark", value.get("low_watermark", cls.low_watermark), 0.0)
        if not low < high <= 1:
            raise ValueError(f"kv_store: need 0 <= low_watermark < high_watermark <= 1, got {low} and {high}")
        interval = _store_number("gc_interval_s", value.get("gc_interval_s", cls.gc_interval_s), 0.0, strict=True)
        threads = value.get("load_threads", cls.load_threads)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ValueError(f"kv_store.load_threads must be an integer in [1, 64], got {threads!r}")
        return cls(host_gb, directory, dir_gb, grain, tuple(sorted(classes.items())), queue, high, low, interval,
                   threads)


def _store_number(name: str, value: Any, low: float, strict: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and (value > low if strict else value >= low)
    if not ok:
        raise ValueError(f"kv_store.{name} must be a number {'>' if strict else '>='} {low:g}, got {value!r}")
    return float(value)


def _store_dir(value: Any) -> Path:
    if not isinstance(value, (str, Path)) or not str(value):
        raise ValueError(f"kv_store.dir must be a directory path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ValueError(f"kv_store.dir={str(value)!r} is not an existing directory (create it first)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"kv_store.dir={str(value)!r} is not writable by this process")
    return path


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels and overlaps a forward takes. Read once from the ``DSINFER_*`` variables at start-up
    (``from_envs``, in ``create_engine_config``), never during a forward. The model gets it at construction and
    hands each layer its fields; the first four pick a kernel inside every op call, so the loader sets them once
    for the process (``ops.options.configure``)."""

    use_triton: str = "auto"  # Triton kernels: auto (on CUDA), always (CPU: the interpreter) or never
    triton_gemv: bool = True  # linear layers of <= 64 rows take the tuned Triton tile where one beat cuBLAS
    pdl: bool = True  # Triton kernels launch with programmatic dependent launch on sm_90+ (ops/triton/pdl.py)
    pdl_early_trigger: str = "mla,split"  # with pdl, the kernel roles that signal their successor before waiting
    fused_silu_mul: bool = True  # an MLP's gate/up projection and SiLU-mul as one kernel where the tuner found one
    router_gemv: bool = True  # DeepSeek MoE on CUDA: small batches' gate logits from the split-K Triton GEMV
    side_stream: bool = True  # in CUDA graphs, overlap independent work on a second stream (``layers.streams``)
    fuse_shared_experts: bool = True  # DeepSeek MoE: shared experts as extra experts of the routed grouped GEMM
    cpu_fused_layer: bool = True  # quantized Llama family on CPU: a decode step's layers as one C++ call each

    @classmethod
    def from_envs(cls) -> KernelConfig:
        """The values of ``DSINFER_USE_TRITON``, ``_TRITON_GEMV``, ``_PDL``, ``_PDL_EARLY_TRIGGER``,
        ``_FUSED_SILU_MUL``, ``_ROUTER_GEMV``, ``_SIDE_STREAM``, ``_FUSE_SHARED_EXPERTS`` and ``_CPU_FUSED_LAYER``."""
        return cls(
            use_triton=envs.USE_TRITON.get(), triton_gemv=envs.TRITON_GEMV.get(), pdl=envs.PDL.get(),
            pdl_early_trigger=envs.PDL_EARLY_TRIGGER.get(), fused_silu_mul=envs.FUSED_SILU_MUL.get(),
            router_gemv=envs.ROUTER_GEMV.get(), side_stream=envs.SIDE_STREAM.get(),
            fuse_shared_experts=envs.FUSE_SHARED_EXPERTS.get(), cpu_fused_layer=envs.CPU_FUSED_LAYER.get(),
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    load: LoadConfig
    device: DeviceConfig
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    kernel: KernelConfig = field(default_factory=KernelConfig)  # the forward's kernel choices (``from_envs``)
    kv_store: KVStoreConfig = KVStoreConfig()  # the KV cache store's tiers (off by default)


def check_parallel_size(value: Any, spelled: str) -> None:
    """One of ``PARALLEL_SIZES`` as the user gave it (``spelled``: "pipeline_parallel_size=2" or
    "--pipeline-parallel-size 2"): a ValueError unless it is 1."""
    if type(value) is not int or value != 1:
        kind = spelled.lstrip("-").split("_")[0].split("-")[0]  # pipeline | data
        raise ValueError(f"{spelled}: dsinfer has no {kind} parallelism yet (only 1 is accepted); spread a "
                         "model over GPUs with tensor_parallel_size (-tp), or run one engine per GPU behind a load "
                         "balancer")
