"""The configuration tree: one frozen dataclass per concern, built once by ``EngineArgs.create_engine_config()``.

``EngineArgs`` holds what a user can set (the ``LLM(...)`` keyword arguments and ``dsinfer`` CLI flags); it is
validated and resolved (model files located, dtype and lengths derived from the HF config) into ``EngineConfig``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
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
# vLLM's distributed_executor_backend: "uni" runs the model in the engine's process, "mp" in a worker process
EXECUTOR_BACKENDS = ("uni", "mp")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's parallel sizes: dsinfer runs one GPU per engine, so 1 is the only value (``check_parallel_size``)
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
# vLLM's --kv-cache-dtype values: "auto" keeps the model's dtype; "fp8" is e4m3 (per-layer scales, see Attention)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}

logger = logging.getLogger("dsinfer")


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


@dataclass(frozen=True)
class ParallelConfig:
    distributed_executor_backend: str = "uni"  # uni (in process) | mp (a worker process): dsinfer/executor/


@dataclass(frozen=True)
class SpeculativeConfig:
    # draft tokens a step may verify per request (0: one-token steps); sizes the multi-token decode CUDA graphs
    num_speculative_tokens: int = 0


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

    @classmethod
    def from_envs(cls) -> KernelConfig:
        """The values of ``DSINFER_USE_TRITON``, ``_TRITON_GEMV``, ``_PDL``, ``_PDL_EARLY_TRIGGER``,
        ``_FUSED_SILU_MUL``, ``_ROUTER_GEMV``, ``_SIDE_STREAM`` and ``_FUSE_SHARED_EXPERTS``."""
        return cls(
            use_triton=envs.USE_TRITON.get(), triton_gemv=envs.TRITON_GEMV.get(), pdl=envs.PDL.get(),
            pdl_early_trigger=envs.PDL_EARLY_TRIGGER.get(), fused_silu_mul=envs.FUSED_SILU_MUL.get(),
            router_gemv=envs.ROUTER_GEMV.get(), side_stream=envs.SIDE_STREAM.get(),
            fuse_shared_experts=envs.FUSE_SHARED_EXPERTS.get(),
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


@dataclass
class EngineArgs:
    """User-facing engine settings (LLM keyword arguments). ``create_engine_config()`` validates them."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    hf_overrides: dict[str, Any] | None = None
    served_model_name: str | None = None
    seed: int = 0
    block_size: int | None = None  # None: 64 for MLA models on CUDA, else 16 (``_resolve_block_size``)
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"  # auto | fp8 (= fp8_e4m3) | fp8_e5m2: halves the KV bytes (GQA and MLA caches)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # vLLM's scheduling_policy: "fcfs" (arrival order) or "priority" (each request's priority, lower first; then
    # arrival); a request with a priority other than 0 needs "priority"
    scheduling_policy: str = "fcfs"
    device: str | None = None
    deterministic: bool | None = None
    async_scheduling: bool | None = None
    enforce_eager: bool = False
    max_prefill_graph_tokens: int = 2048
    # where the default sampling values come from, as vLLM's --generation-config: "auto" (the model's
    # generation_config.json), "vllm" (none: SamplingParams' own defaults) or a folder holding a generation_config.json
    generation_config: str = "auto"
    # sampling values over the file's (vLLM's --override-generation-config), e.g. {"temperature": 0.5}
    override_generation_config: dict[str, Any] | None = None
    # the most logprobs / prompt_logprobs a request may ask for (vLLM's --max-logprobs); -1: up to the vocab size
    max_logprobs: int = 20
    # vLLM's distributed_executor_backend: "uni" (in process, the default) or "mp" (the model in a worker process)
    distributed_executor_backend: str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self, usage: str = "offline") -> EngineConfig:
        """``usage``: "offline" (the ``LLM`` class) or "server"; only the default token budget differs
        (``default_batched_tokens``)."""
        from dsinfer.models.loader.resolve import resolve_model_dir

        envs.validate_all()
        self._validate()
        device = _resolve_device(self.device)
        model_dir, load_format = resolve_model_dir(self.model, self.load_format)
        config_path = model_dir / "config.json"
        try:
            hf_config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
        if not isinstance(hf_config, dict):
            raise ValueError(f"{config_path} must hold a JSON object, got {type(hf_config).__name__}")
        hf_config.update(self.hf_overrides or {})
        hf_config["architectures"] = _architectures(hf_config, config_path)
        generation_config = _read_json(model_dir / "generation_config.json")
        sampling_defaults, max_tokens_limit = self._sampling_defaults(generation_config)
        model = ModelConfig(
            path=model_dir, hf_config=hf_config, dtype=_resolve_dtype(self.dtype, hf_config, device),
            max_model_len=_resolve_max_model_len(self.max_model_len, hf_config),
            served_model_name=self.served_model_name or self.model or "SmolLM2-135M-Instruct",
            generation_config=generation_config, sampling_defaults=sampling_defaults,
            max_tokens_limit=max_tokens_limit, max_logprobs=self.max_logprobs,
        )
        batched = self.max_num_batched_tokens or default_batched_tokens(device, self.max_num_seqs, usage)
        if not self.enable_chunked_prefill:
            batched = max(batched, model.max_model_len)
        deterministic = envs.DETERMINISTIC.get() if self.deterministic is None else self.deterministic
        # Default: on for CUDA (DSINFER_ASYNC_SCHEDULING turns it off); an explicit True also runs the overlap
        # logic on CPU (tests), where there is nothing to overlap.
        if self.async_scheduling is None:
            async_sched = envs.ASYNC_SCHEDULING.get() and device.type == "cuda"
        else:
            async_sched = self.async_scheduling
        return EngineConfig(
            model=model,
            cache=CacheConfig(_resolve_block_size(self.block_size, hf_config, device), self.enable_prefix_caching,
                              self.kv_cache_memory_gb, self.gpu_memory_utilization, self.num_kv_blocks,
                              KV_CACHE_DTYPES[self.kv_cache_dtype]),
            scheduler=SchedulerConfig(self.max_num_seqs, batched, self.enable_chunked_prefill,
                                      self.scheduling_policy),
            load=LoadConfig(load_format, self.seed),
            # deterministic mode keeps CUDA graphs: the runner captures them inside the batch-invariant mode, and
            # the invariant kernels give a row the same result whatever the (padded) batch around it
            device=DeviceConfig(device, bool(deterministic), bool(async_sched), self.enforce_eager,
                                self.max_prefill_graph_tokens),
            parallel=ParallelConfig(self.distributed_executor_backend or "uni"),
            kernel=KernelConfig.from_envs(),
        )

    def _sampling_defaults(self, model_generation_config: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """(ModelConfig.sampling_defaults, ModelConfig.max_tokens_limit), checked as SamplingParams values so that
        a bad file or override fails at startup rather than in every request."""
        from dsinfer.engine.sampling_params import SamplingParams, generation_config_sampling_defaults

        overrides = self.override_generation_config or {}
        if self.generation_config == "auto":
            source, where = model_generation_config, "the model's generation_config.json"
        elif self.generation_config == "vllm":
            source, where = {}, "override_generation_config"
        else:
            path = Path(self.generation_config).expanduser() / "generation_config.json"
            source, where = _read_json(path), str(path)
        if not isinstance(source, dict):
            raise ValueError(f"{where} must hold a JSON object, got {type(source).__name__}")
        defaults = generation_config_sampling_defaults(source, overrides)
        try:
            SamplingParams(**defaults)
        except ValueError as exc:
            raise ValueError(f"the default sampling values from {where} (with override_generation_config "
                             f"{overrides}) are invalid: {exc}") from None
        # vLLM: a folder's max_new_tokens caps every request (it was chosen for this server); the model's own
        # only fills in an unset max_tokens, unless override_generation_config sets it
        if self.generation_config in ("auto", "vllm"):
            limit = overrides.get("max_new_tokens")
        else:
            limit = defaults.get("max_tokens")
        return defaults, limit

    def _validate(self) -> None:
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1, 1024)
            if self.block_size & (self.block_size - 1):
                raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_int("max_num_seqs", self.max_num_seqs, 1, 1 << 16)
        _check_int("max_prefill_graph_tokens", self.max_prefill_graph_tokens, 0, 1 << 16)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 22)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1, 1 << 24)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 2, 1 << 26)
        if self.kv_cache_memory_gb is not None and not (0 < self.kv_cache_memory_gb < 1 << 20):
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got "
                             f"{self.distributed_executor_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        _check_int("seed", self.seed, -(1 << 63), (1 << 63) - 1)
        _check_int("max_logprobs", self.max_logprobs, -1, 1 << 31)  # -1: up to the vocabulary size
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder path, got "
                             f"{self.generation_config!r}")
        if self.generation_config not in ("auto", "vllm"):
            # vLLM falls back to no defaults when the folder has no file; a typo'd path should not pass silently
            folder = Path(self.generation_config).expanduser()
            if not (folder / "generation_config.json").is_file():
                raise ValueError(f"generation_config={self.generation_config!r}: expected 'auto', 'vllm' or a "
                                 f"folder holding a generation_config.json, and {folder} holds none")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict, got "
                             f"{type(self.override_generation_config).__name__}")


def check_parallel_size(value: Any, spelled: str) -> None:
    """One of ``PARALLEL_SIZES`` as the user gave it (``spelled``: "tensor_parallel_size=2" or
    "--tensor-parallel-size 2"): a ValueError unless it is 1."""
    if type(value) is not int or value != 1:
        raise ValueError(f"{spelled}: dsinfer serves one GPU per process (only 1 is accepted); run one engine per "
                         "GPU (behind a load balancer when serving)")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def default_batched_tokens(device: torch.device, max_num_seqs: int, usage: str = "offline") -> int:
    """The token budget of a step when none is given, vLLM's defaults: on a CUDA GPU of 70 GiB or more 16,384
    offline and 8,192 serving (a smaller budget keeps a long prompt's chunks from stretching every running
    stream's inter-token gap), on a smaller one 8,192 / 2,048; 2,048 on CPU. Never below ``max_num_seqs``.
    Llama-3.1-8B offline, 512 x 1000 / 1000 on an H200: 9,996 out tok/s at 16,384 against 9,942 at 8,192."""
    if usage not in ("offline", "server"):
        raise ValueError(f"usage must be 'offline' or 'server', got {usage!r}")
    budget = 2048
    if device.type == "cuda":
        big = torch.cuda.get_device_properties(device).total_memory >= 70 << 30
        budget = (16384 if big else 8192) if usage == "offline" else (8192 if big else 2048)
    return max(budget, max_num_seqs)


def _resolve_block_size(block_size: int | None, hf_config: dict[str, Any], device: torch.device) -> int:
    """The KV block size: the one asked for, else 64 tokens for MLA models on CUDA (the MLA decode kernel
    fetches whole 32-row key tiles of one block by TMA, ``ops.triton.mla_tma``; FlashMLA needs 64 too), else 16."""
    if block_size is not None:
        return block_size
    return 64 if device.type == "cuda" and hf_config.get("kv_lora_rank") else 16


# config.json's model_type -> architecture, for configs written without "architectures" (as transformers infers)
_ARCHITECTURE_OF_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                         "mistral": "MistralForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                         "deepseek_v3": "DeepseekV3ForCausalLM"}


def _architectures(hf_config: dict[str, Any], path: Path) -> list[str]:
    architectures = hf_config.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise ValueError(f"{path}: architectures must be a list of class names, got {architectures!r}")
        return architectures
    model_type = hf_config.get("model_type")
    if model_type in _ARCHITECTURE_OF_TYPE:
        return [_ARCHITECTURE_OF_TYPE[model_type]]
    raise ValueError(f"{path} names no architectures and its model_type {model_type!r} is not one of "
                     f"{sorted(_ARCHITECTURE_OF_TYPE)}")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _resolve_device(name: str | None) -> torch.device:
    name = name or envs.DEVICE.get()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def _resolve_dtype(dtype: str, hf_config: dict[str, Any], device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls are fastest and exact in float32
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    resolved = _DTYPES.get(str(declared).replace("torch.", ""), torch.bfloat16)
    if resolved == torch.float32:
        # said out loud: a float32 checkpoint silently run in bf16 looks like a kernel bug in parity checks
        logger.info("the checkpoint is float32; dtype='auto' runs it in bfloat16 on %s (pass dtype='float32' "
                    "to keep float32)", device.type)
        return torch.bfloat16
    return resolved


def _resolve_max_model_len(requested: int | None, hf_config: dict[str, Any]) -> int:
    limit = int(hf_config.get("max_position_embeddings") or hf_config.get("max_sequence_length") or 4096)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings ({limit}); "
            "pass a value <= that or set hf_overrides={'max_position_embeddings': ...} deliberately"
        )
    return requested
