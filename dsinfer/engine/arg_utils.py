"""EngineArgs: what a user can set (the ``LLM(...)`` keyword arguments and ``dsinfer`` CLI flags), validated and
resolved (model files located, dtype and lengths derived from the HF config) into the ``EngineConfig`` tree.

It lives in the engine layer, not in ``config``, because resolving reads the model's files (``models.loader``)
and checks the default sampling values (``engine.sampling_params``); ``config`` stays importable by every layer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from dsinfer import envs
from dsinfer.config import (
    _DTYPES,
    EP_ARCHITECTURES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    EplbConfig,
    KernelConfig,
    KVStoreConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from dsinfer.engine.sampling_params import SamplingParams, generation_config_sampling_defaults
from dsinfer.models.loader.resolve import gguf_source, resolve_model_dir

logger = logging.getLogger("dsinfer")


@dataclass
class EngineArgs:
    """User-facing engine settings (LLM keyword arguments). ``create_engine_config()`` validates them."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    # vLLM's --quantization: "int8" | "int4" (weight-only, CPU) or "gguf" (a GGUF file's own blocks); None: "gguf"
    # for a GGUF model on CPU with dtype "auto" (the measured fastest, docs/benchmarks.md), else dense weights
    quantization: str | None = None
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
    # vLLM's distributed_executor_backend: "uni" (in process, the default at one rank) or "mp" (the model in
    # worker processes; the default, and the only choice, above one rank)
    distributed_executor_backend: str | None = None
    # vLLM's tensor_parallel_size: ranks (GPUs) the model is split over; dsinfer spawns them, or joins a
    # torchrun / SLURM job's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    tensor_parallel_size: int = 1
    # vLLM's enable_expert_parallel: DeepSeek's routed experts partitioned over the ranks (EP size =
    # tensor_parallel_size x data_parallel_size) instead of split by intermediate columns; attention and the
    # shared experts stay tensor-parallel (data_parallel_size 1) or data-parallel
    enable_expert_parallel: bool = False
    # vLLM's data_parallel_size: with enable_expert_parallel (and tensor_parallel_size 1), DP attention: each rank
    # its own scheduler, KV cache and batch, the MoE layers across all ranks (``engine.dp_engine``)
    data_parallel_size: int = 1
    # vLLM's speculative_config: {"method": "ngram" | "mtp", "num_speculative_tokens": k, "prompt_lookup_min",
    # "prompt_lookup_max", "acceptance": "rejection" | "exact", "confidence_scheduling"} (``SpeculativeConfig``)
    speculative_config: dict[str, Any] | None = None
    # the KV cache store beyond GPU memory: {"host_gb": .., "dir": .., "dir_gb": .., "grain": 128,
    # "ttl_s": {class: seconds}} (``KVStoreConfig``); None: GPU prefix cache only
    kv_store: dict[str, Any] | None = None
    # vLLM's EPLB: expert load counters, redundant experts and rebalances (DeepSeek V2 / V3 / V3.2 only)
    enable_eplb: bool = False
    # {"window_size": steps, "step_interval": steps, "num_redundant_experts": n, "log_balancedness": bool}
    eplb_config: dict[str, Any] | None = None
    # where confidence scheduling keeps its step-latency curve (None: $DSINFER_CACHE_DIR/step_latency; "": nowhere)
    step_latency_dir: str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self, usage: str = "offline") -> EngineConfig:
        """``usage``: "offline" (the ``LLM`` class) or "server"; only the default token budget differs
        (``default_batched_tokens``)."""
        envs.validate_all()
        self._validate()
        speculative = SpeculativeConfig.from_dict(self.speculative_config)
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
        speculative.check_model(hf_config)
        if not isinstance(self.enable_eplb, bool):
            raise ValueError(f"enable_eplb must be true or false, got {self.enable_eplb!r}")
        eplb = EplbConfig.from_dict(self.eplb_config)
        eplb.check_model(self.enable_eplb, hf_config)
        self._check_expert_parallel(hf_config, eplb)
        quantization = _resolve_quantization(self.quantization, self.dtype, device, self.model, self.load_format,
                                             hf_config)
        if quantization is not None and self.tensor_parallel_size * self.data_parallel_size > 1:
            if self.quantization is not None:
                raise ValueError(f"quantization={self.quantization!r} is not supported with tensor_parallel_size > 1 "
                                 "yet (the packed CPU weights are not split across ranks)")
            quantization = None  # the bundled GGUF's default: unquantized weights split across the ranks
        quantized_weights = None
        if quantization is not None and (source := gguf_source(self.model, self.load_format)) is not None:
            from dsinfer.models.loader.gguf_quant import cached_gguf_quantized

            quantized_weights = cached_gguf_quantized(source, model_dir, quantization, hf_config)
        generation_config = _read_json(model_dir / "generation_config.json")
        sampling_defaults, max_tokens_limit = self._sampling_defaults(generation_config)
        model = ModelConfig(
            path=model_dir, hf_config=hf_config, dtype=_resolve_dtype(self.dtype, hf_config, device),
            max_model_len=_resolve_max_model_len(self.max_model_len, hf_config),
            served_model_name=self.served_model_name or self.model or "SmolLM2-135M-Instruct",
            generation_config=generation_config, sampling_defaults=sampling_defaults,
            max_tokens_limit=max_tokens_limit, max_logprobs=self.max_logprobs, quantization=quantization,
            quantized_weights=quantized_weights,
        )
        batched = self.max_num_batched_tokens or default_batched_tokens(device, self.max_num_seqs, usage)
        if not self.enable_chunked_prefill:
            batched = max(batched, model.max_model_len)
        deterministic = envs.DETERMINISTIC.get() if self.deterministic is None else self.deterministic
        world = self.tensor_parallel_size * self.data_parallel_size
        # Default: on for CUDA (DSINFER_ASYNC_SCHEDULING turns it off); an explicit True also runs the overlap
        # logic on CPU (tests), where there is nothing to overlap.
        if self.async_scheduling is None:
            async_sched = envs.ASYNC_SCHEDULING.get() and device.type == "cuda" and self.data_parallel_size == 1
        else:
            async_sched = self.async_scheduling
        block_size = _resolve_block_size(self.block_size, hf_config, device)
        kv_store = KVStoreConfig.from_dict(self.kv_store, block_size)
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size, self.enable_prefix_caching,
                              self.kv_cache_memory_gb, self.gpu_memory_utilization, self.num_kv_blocks,
                              KV_CACHE_DTYPES[self.kv_cache_dtype], self.step_latency_dir),
            scheduler=SchedulerConfig(self.max_num_seqs, batched, self.enable_chunked_prefill,
                                      self.scheduling_policy),
            load=LoadConfig(load_format, self.seed),
            # deterministic mode keeps CUDA graphs: the runner captures them inside the batch-invariant mode, and
            # the invariant kernels give a row the same result whatever the (padded) batch around it
            # DP attention runs eagerly: ep_moe reads its split sizes on the host
            device=DeviceConfig(device, bool(deterministic), bool(async_sched),
                                self.enforce_eager or self.data_parallel_size > 1, self.max_prefill_graph_tokens),
            parallel=ParallelConfig(self.distributed_executor_backend or ("mp" if world > 1 else "uni"),
                                    self.tensor_parallel_size, self.enable_expert_parallel, self.data_parallel_size,
                                    self.enable_eplb, eplb),
            speculative=speculative,
            kernel=KernelConfig.from_envs(),
            kv_store=kv_store,
        )

    def _check_data_parallel(self) -> None:
        """ValueErrors for what DP attention does not take (yet)."""
        if self.data_parallel_size == 1:
            return
        size = f"data_parallel_size={self.data_parallel_size}"
        if self.enable_expert_parallel is not True:
            raise ValueError(f"{size}: dsinfer has no data parallelism without enable_expert_parallel=True (DP "
                             "attention with the MoE experts across the ranks); for replicas of a model run one "
                             "engine per GPU behind `dsinfer router`")
        refused = {"tensor_parallel_size > 1": self.tensor_parallel_size > 1,
                   "speculative_config": bool(self.speculative_config), "kv_store": bool(self.kv_store),
                   "async_scheduling=True": self.async_scheduling is True,
                   "distributed_executor_backend='uni'": self.distributed_executor_backend == "uni"}
        for name, given in refused.items():
            if given:
                raise ValueError(f"{size} (DP attention) does not take {name} yet")

    def _check_expert_parallel(self, hf_config: dict[str, Any], eplb: EplbConfig) -> None:
        """ValueErrors for an expert-parallel setting this model or these sizes cannot take (before any rank
        starts)."""
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be true or false, got {self.enable_expert_parallel!r}")
        if not self.enable_expert_parallel:
            return
        arch = hf_config["architectures"][0]
        if arch not in EP_ARCHITECTURES or not hf_config.get("n_routed_experts"):
            raise ValueError(f"enable_expert_parallel=True needs a DeepSeek V2 / V3 MoE model ({EP_ARCHITECTURES} "
                             f"with n_routed_experts); {arch} has no routed experts to partition over ranks")
        experts, redundant = hf_config["n_routed_experts"], eplb.num_redundant_experts if self.enable_eplb else 0
        ep_size = self.tensor_parallel_size * self.data_parallel_size
        if (experts + redundant) % ep_size:
            spelled = f"n_routed_experts ({experts})" + (
                f" + eplb_config.num_redundant_experts ({redundant})" if redundant else "")
            raise ValueError(f"{spelled} is not divisible by the expert-parallel size tensor_parallel_size x "
                             f"data_parallel_size={ep_size} (enable_expert_parallel=True: each rank holds an "
                             "equal share of the physical experts); pick sizes that divide it"
                             + (", or set eplb_config.num_redundant_experts so that it does" if self.enable_eplb
                                else ""))

    def _sampling_defaults(self, model_generation_config: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """(ModelConfig.sampling_defaults, ModelConfig.max_tokens_limit), checked as SamplingParams values so that
        a bad file or override fails at startup rather than in every request."""
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
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 1 << 12)
        _check_int("data_parallel_size", self.data_parallel_size, 1, 1 << 12)
        self._check_data_parallel()
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} runs one worker process per rank: "
                             "distributed_executor_backend='uni' (in process) cannot; use 'mp' or leave it unset")
        if self.tensor_parallel_size > 1 and self.kv_store:
            raise ValueError("kv_store is not supported with tensor_parallel_size > 1 yet (each rank holds a slice "
                             "of the KV cache)")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
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
    if hf_config.get("model_type") == "deepseek_v4" or "DeepseekV4ForCausalLM" in (hf_config.get("architectures")
                                                                                  or ()):
        return _v4_block_size(block_size, hf_config)
    if block_size is not None:
        return block_size
    return 64 if device.type == "cuda" and hf_config.get("kv_lora_rank") else 16


def _v4_block_size(block_size: int | None, hf_config: dict[str, Any]) -> int:
    """DeepSeek-V4 pages compressed entries only: a block of B tokens holds B / rate entries of every compressed
    layer, so B must be a multiple of each rate; by default 16 entries of the most compressed layers (16 x 128 =
    2,048 tokens for V4-Flash, 512 entries of its CSA layers)."""
    from dsinfer.models.deepseek_v4.config import V4Config

    v4 = V4Config.of(hf_config).with_mtp_layers()  # an MTP layer's entries are paged by the same blocks
    rates = sorted({v4.rate(i) for i in range(v4.num_layers)} - {0})
    if block_size is None:
        return 16 * v4.max_rate
    if any(block_size % rate for rate in rates):
        raise ValueError(f"block_size={block_size} must be a multiple of every compression rate of the model "
                         f"({rates}): a block holds block_size / rate compressed entries")
    return block_size


# config.json's model_type -> architecture, for configs written without "architectures" (as transformers infers)
_ARCHITECTURE_OF_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                         "mistral": "MistralForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                         "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
                         "deepseek_v4": "DeepseekV4ForCausalLM"}


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


def _resolve_quantization(requested: str | None, dtype: str, device: torch.device, model: str | None,
                          load_format: str, hf_config: dict[str, Any]) -> str | None:
    """The quantization a run takes: the one asked for (CPU only, Llama-family models), else "gguf" for a GGUF
    model on CPU left at dtype "auto" (dtype="float32" keeps the exact dense path)."""
    source = gguf_source(model, load_format)
    if requested is None:
        return "gguf" if source is not None and device.type == "cpu" and dtype == "auto" else None
    if device.type != "cpu":
        raise ValueError(f"quantization={requested!r} runs on CPU only (device is {device.type})")
    if requested == "gguf" and source is None:
        raise ValueError("quantization='gguf' needs a GGUF model file; use 'int8' or 'int4' for other checkpoints")
    from dsinfer.models.registry import model_class

    if not getattr(model_class(hf_config["architectures"][0]), "supports_cpu_quantization", False):
        raise ValueError(f"quantization={requested!r} is supported for Llama-family models only, not "
                         f"{hf_config['architectures'][0]}")
    return requested


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
