"""The offline API, vLLM-compatible: ``LLM(model).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dsinfer.config import PARALLEL_SIZES, check_parallel_size
from dsinfer.engine.arg_utils import EngineArgs
from dsinfer.engine.heap import startup_heap_frozen
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from dsinfer.entrypoints.openmp_pool import release_thread_pool
from dsinfer.entrypoints.step_clock import StepClock, StepTimeoutError
from dsinfer.hf_tokenizer import HFTokenizerView

logger = logging.getLogger("dsinfer")

PromptType = str | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    """An offline engine. Keyword arguments are ``EngineArgs`` fields (max_num_seqs, block_size, ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        _take_vllm_only_args(kwargs)
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {sorted(unknown)}; "
                            f"valid: {sorted(EngineArgs.field_names())}")
        started = time.perf_counter()
        args = EngineArgs(model=model, **kwargs)
        if args.data_parallel_size != 1:  # DP attention: an engine per rank (validated when the config is made)
            from dsinfer.engine.dp_engine import DataParallelEngine

            self.engine = DataParallelEngine.from_engine_args(args)
        else:
            self.engine = LLMEngine.from_engine_args(args)
        self.load_seconds = time.perf_counter() - started
        self._ids = itertools.count()
        self._hf_tokenizer: HFTokenizerView | None = None
        self._dead: StepTimeoutError | None = None  # a step that hung: the engine is stuck in it for good

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, by vLLM's name for it (``llm.llm_engine``); dsinfer's is ``llm.engine``."""
        return self.engine

    def get_tokenizer(self) -> HFTokenizerView | None:
        """The tokenizer with the transformers API that vLLM's ``get_tokenizer()`` gives (``tok(text)``,
        ``eos_token_id``, ``apply_chat_template`` returning ids, ...); None for a model without one. dsinfer's own
        ``Tokenizer`` is ``llm.engine.tokenizer`` (or the view's ``dsinfer_tokenizer``)."""
        if self.engine.tokenizer is None:
            return None
        if self._hf_tokenizer is None or self._hf_tokenizer.dsinfer_tokenizer is not self.engine.tokenizer:
            # one view per LLM, so that a script's ``tok.pad_token = ...`` holds across calls
            self._hf_tokenizer = HFTokenizerView(self.engine.tokenizer)
        return self._hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``/``chat`` use when given no SamplingParams: vLLM's defaults with the sampling values the
        model's generation_config.json recommends (vLLM's ``generation_config="auto"``; the ``generation_config``
        and ``override_generation_config`` arguments change them as vLLM's do). The rule is the server's too:
        ``generation_config_sampling_defaults``, resolved once into ``ModelConfig.sampling_defaults``."""
        return SamplingParams(**self.engine.model_config.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
        kv_retention: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts. ``use_tqdm`` may be a
        tqdm class (or a function making one) to draw the progress bar with, as in vLLM.

        ``priority``: one integer per prompt, lower first, for an engine made with
        ``scheduling_policy="priority"`` (vLLM's). ``lora_request``: None (dsinfer serves no LoRA adapters).
        ``kv_retention``: the KV store's traffic class for every prompt (over each SamplingParams' own)."""
        _check_no_lora(lora_request)
        self._check_alive()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, bytearray)):
            raise ValueError("prompts must be a prompt (str, {'prompt': str} or {'prompt_token_ids': [...]}) or a "
                             f"list of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        params_list = self._params_for(len(prompts), sampling_params)
        priorities = _priorities(len(prompts), priority)
        for rank in priorities:  # all checked before the first request is added
            self.engine.check_priority(rank)
        request_ids = []
        try:
            for prompt, params, rank in zip(prompts, params_list, priorities):
                params = _final_only(params)
                if kv_retention is not None:
                    params = dataclasses.replace(params, kv_retention=kv_retention)
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params, priority=rank)
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            self._drain()
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate (vLLM's ``LLM.chat``).

        ``tools``: OpenAI-style tool definitions, given to the template (or described in the system prompt when
        the template has no tools). ``continue_final_message``: the last message is an assistant prefill that the
        model continues. Message text is tokenized literally: a special-token string typed in a message stays
        text (``protocol.chat_encoding``, as on the server)."""
        from dsinfer.protocol.chat_encoding import ChatEncoder
        from dsinfer.protocol.errors import ProtocolError

        _check_no_lora(lora_request)
        if not isinstance(messages, list | tuple):
            raise ValueError(f"messages must be a list of message dicts (or of such lists), got "
                             f"{type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        _check_tools(tools)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        template = chat_template or tokenizer.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template= or use generate() with raw text")
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # the prompt ends inside the last (assistant) turn
        encoder = ChatEncoder(tokenizer, template)
        prompts = []
        for conversation in conversations:
            if not isinstance(conversation, list | tuple):
                raise ValueError(f"a conversation must be a list of message dicts, got {conversation!r:.80}")
            try:
                encoded = encoder.encode([_text_content(m) for m in conversation], tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         template_kwargs=chat_template_kwargs,
                                         continue_final_message=continue_final_message)
            except ProtocolError as exc:
                raise ValueError(str(exc)) from None
            # the template already wrote BOS where the model wants it
            prompts.append({"prompt": encoded.text, "prompt_token_ids": encoded.token_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_for(self, count: int, params: SamplingParams | Sequence[SamplingParams] | None):
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * count
        if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                            f"{type(params).__name__}")
        params = list(params)
        wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got a "
                            f"list holding {type(wrong).__name__}")
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one or one per prompt")
        return params

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            with startup_heap_frozen():
                self._step_until_done(finished, bar)
        except BaseException:  # Ctrl-C, out of memory, a failing step: this call's requests end, the LLM stays usable
            if self._dead is None:  # (unless a step hangs: the engine is then another thread's for good)
                self.engine.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in request_ids]

    def _step_until_done(self, finished: dict[str, RequestOutput], bar: Any) -> None:
        """Step the engine in a thread of its own while this one waits, so that a step that hangs past
        ``DSINFER_STEP_TIMEOUT_S`` raises ``StepTimeoutError`` here instead of hanging the caller (where the
        executor does not bound its steps itself): the stuck thread is left behind and the LLM is dead. Ctrl-C
        lets the step in progress end first, within the same bound. This thread gives up its OpenMP pool first
        (``openmp_pool``: with two, torch's CPU kernels ran ~25% slower in the stepping thread)."""
        if self.engine.executor.bounds_step_time:  # the mp executor kills a worker that overruns
            self._drain_into(finished, bar)
            return
        clock = StepClock()
        stop = threading.Event()
        failed: list[BaseException] = []

        def loop() -> None:
            try:
                while not stop.is_set() and self.engine.has_unfinished_requests():
                    clock.begin()
                    outputs = self.engine.step()
                    clock.end()
                    for output in outputs:
                        if output.finished:
                            finished[output.request_id] = output
                            if bar is not None:
                                bar.update(1)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                failed.append(exc)

        stepper = threading.Thread(target=loop, name="dsinfer-generate", daemon=True)
        release_thread_pool()
        stepper.start()
        try:
            while stepper.is_alive():
                stepper.join(clock.poll_s)
                overdue = clock.overdue()
                if overdue is not None:
                    self._dead = overdue
                    raise overdue
        except BaseException:
            stop.set()
            if self._dead is None:
                stepper.join(clock.timeout_s)
                if stepper.is_alive():
                    self._dead = StepTimeoutError(f"a step ran longer than {clock.timeout_s:g}s "
                                                  "(DSINFER_STEP_TIMEOUT_S) after an interrupt")
            raise
        if failed:
            raise failed[0]

    def _drain_into(self, finished: dict[str, RequestOutput], bar: Any) -> None:
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if bar is not None:
                        bar.update(1)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise RuntimeError(f"this LLM's engine is dead ({type(self._dead).__name__}: {self._dead}): a step "
                               "never finished and still holds it; make a new LLM")

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _check_tools(tools: Any) -> None:
    """OpenAI tool definitions: [{"type": "function", "function": {"name": str, ...}}, ...]."""
    if tools is None:
        return
    if not isinstance(tools, list | tuple):
        raise ValueError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise ValueError('each tool must be {"type": "function", "function": {"name": str, "description": ..., '
                             f'"parameters": {{...}}}}}}, got {tool!r:.80}')
        if not isinstance(fn.get("parameters") or {}, dict) or not isinstance(fn.get("description") or "", str):
            raise ValueError(f"tool {fn['name']!r}: parameters must be a dict and description a string")


def _check_tool_calls(calls: Any) -> None:
    if not isinstance(calls, list | tuple):
        raise ValueError(f"tool_calls must be a list, got {type(calls).__name__}")
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str | dict)):
            raise ValueError('each tool call must be {"id": ..., "type": "function", "function": {"name": str, '
                             f'"arguments": str or dict}}}}, got {call!r:.80}')


def _text_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI-style content parts (``[{"type": "text", "text": ...}]``) joined into one string by newlines, as
    vLLM does; a missing or null content is empty. Other part types (images) are a ValueError: text models only.
    A message that is not a dict with a string role is a ValueError too."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"each message must be a dict with a string 'role', got {message!r:.80}")
    if message.get("tool_calls") is not None:
        _check_tool_calls(message["tool_calls"])
    content = message.get("content")
    if isinstance(content, str):
        return message
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"message content parts must be {{'type': 'text', 'text': str}}, got {part!r:.80}")
            texts.append(part["text"])
        return {**message, "content": "\n".join(texts)}
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _check_no_lora(lora_request: Any) -> None:
    """vLLM's ``lora_request`` (one, or one per prompt): dsinfer loads no adapters, so only None passes."""
    requests = lora_request if isinstance(lora_request, list | tuple) else [lora_request]
    given = next((r for r in requests if r is not None), None)
    if given is not None:
        raise ValueError(f"lora_request={given!r:.100}: dsinfer serves no LoRA adapters; merge the adapter into "
                         "the weights and load the merged model")


def _priorities(count: int, priority: Any) -> list[int]:
    """vLLM's ``priority``: None (all 0) or one integer per prompt (checked by the engine as each is added)."""
    if priority is None:
        return [0] * count
    if isinstance(priority, (str, bytes, Mapping)) or not isinstance(priority, Iterable):
        raise ValueError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
    priority = list(priority)
    if len(priority) != count:
        raise ValueError(f"got {len(priority)} priorities for {count} prompts; pass one per prompt")
    return priority


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    from dataclasses import replace

    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _take_vllm_only_args(kwargs: dict[str, Any]) -> None:
    """vLLM's LLM arguments that dsinfer answers as ``dsinfer serve`` answers the flags: a pipeline or data
    parallel size of 1 (``tensor_parallel_size`` is an ``EngineArgs`` field), and trust_remote_code, which changes
    nothing (dsinfer never runs a model's own Python code)."""
    for name in PARALLEL_SIZES:
        value = kwargs.pop(name, 1)
        check_parallel_size(value, f"{name}={value!r}")
    trust = kwargs.pop("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise ValueError(f"trust_remote_code must be a bool, got {trust!r}")
