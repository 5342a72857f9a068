"""SamplingParams: how one request is decoded (vLLM-compatible field names), validated at construction."""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from dsinfer.core.plan import SamplingRules
from dsinfer.structured.spec import StructuredOutputsParams, parse_structured_outputs

_MAX_N = 128
# vLLM's default max_logprobs: the most logprobs / prompt_logprobs a request may ask for unless the engine's
# max_logprobs (EngineArgs, ``--max-logprobs``) says otherwise; ``check_logprobs_limit`` applies it
DEFAULT_MAX_LOGPROBS = 20
_MAX_SEED = 2**63 - 1


_NUMERIC_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs",
                   "truncate_prompt_tokens")


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if not integer and math.isnan(value):
        raise ValueError(f"{name} must not be NaN")


# The sampling fields vLLM takes from a generation_config.json, with transformers' GenerationConfig defaults: vLLM
# reads the file through GenerationConfig.to_diff_dict(), so a value equal to transformers' default is not applied
# (a file's explicit top_k 50 leaves SamplingParams' top_k off, its temperature 1.0 changes nothing)
GENERATION_CONFIG_SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0, "max_new_tokens": None,
}


def generation_config_sampling_defaults(
    generation_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The SamplingParams keyword arguments a generation_config.json recommends (vLLM's
    ``ModelConfig.get_diff_sampling_param``): temperature, top_p, top_k, min_p and repetition_penalty where they
    differ from transformers' defaults, and max_new_tokens as ``max_tokens``. ``overrides`` (vLLM's
    ``override_generation_config``) apply after that comparison, so they count even at transformers' default
    value, and an override of None drops the file's value. Other keys (eos_token_id, do_sample, ...) are not
    sampling defaults and are left out."""
    known = GENERATION_CONFIG_SAMPLING_DEFAULTS
    values = {key: generation_config[key] for key, default in known.items()
              if key in generation_config and generation_config[key] != default}
    values.update((key, value) for key, value in (overrides or {}).items() if key in known)
    defaults = {key: value for key, value in values.items() if value is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens; -1 keeps as many as leave room for one
    output token (vLLM keeps max_model_len, which would leave none); None keeps them all."""
    if keep is None:
        return token_ids
    return token_ids[-(max_model_len - 1 if keep == -1 else keep):]


def token_id_list(value: Any) -> list[int] | None:
    """``value`` as a list of Python ints when it is a sequence (or a numpy / torch array, by ``tolist``) of
    integers of any integral type; None when it is not (bools are not ids), for the caller to refuse."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return None
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in value):
        return None
    return [int(t) for t in value]


@dataclass
class SamplingParams(SamplingRules):
    """Per-request decoding settings. Invalid values raise ``ValueError`` naming the field and its range.

    ``structured_outputs`` ends as in vLLM: once the grammar is complete and allows nothing more, only EOS may be
    sampled; the output ends with that EOS id in ``token_ids`` (with its logprob; its text is not in ``text``),
    finish_reason "stop" and stop_reason None. While the grammar may go on, ``min_tokens`` holds EOS back as usual;
    once EOS is the only token the grammar allows, the grammar's end wins over ``min_tokens`` (which would ban it)
    and over ``ignore_eos``: such an output can be shorter than min_tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled token always included)
    prompt_logprobs: int | None = None
    # False: the output has token ids only (text "", logprobs without decoded_token); stop strings need text
    detokenize: bool = True
    skip_special_tokens: bool = True
    # vLLM's field; its fast-tokenizer detokenizer (the one dsinfer has: tokenizers' DecodeStream) ignores it too
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: as many as leave room to answer
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only these (vLLM)
    bad_words: list[str] | None = None  # never generate these words (vLLM: with and without a leading space)
    structured_outputs: dict[str, Any] | StructuredOutputsParams | None = None  # a dict once made
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra: dict[str, Any] = field(default_factory=dict)
    # the KV store's traffic class of this request's saved prefix (``kv_store.ttl_s``'s keys); None: "default"
    kv_retention: str | None = None

    def __post_init__(self) -> None:
        self._native_numbers()
        # vLLM's spellings: seed -1 is "no seed"; logprobs=True asks for one top token (True is an int, so this
        # comes before the check that rejects other bools)
        if type(self.seed) is int and self.seed == -1:
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop_token_ids", "allowed_token_ids"):  # numpy ids and arrays, as the single numbers
            ids = token_id_list(getattr(self, name))
            if ids is not None:
                setattr(self, name, ids)
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list | tuple):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for name in ("ignore_eos", "include_stop_str_in_output", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                                 f"got {self.output_kind!r}") from None
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words) if self.bad_words else None
        if self.top_k == 0:
            self.top_k = -1
        if self.kv_retention is not None and (not isinstance(self.kv_retention, str) or not self.kv_retention):
            raise ValueError(f"kv_retention must be a traffic class name (a non-empty string), got "
                             f"{self.kv_retention!r}")
        self._validate()

    def _native_numbers(self) -> None:
        """Numbers of other types (numpy's, a Fraction) as Python ints and floats, as vLLM takes them; bools and
        anything that is not a number are left for the checks to refuse."""
        for name in _NUMERIC_FIELDS:
            value = getattr(self, name)
            if value is None or isinstance(value, (bool, int, float)):
                continue
            if isinstance(value, numbers.Integral):
                setattr(self, name, int(value))
            elif isinstance(value, numbers.Real):
                setattr(self, name, float(value))

    def _validate(self) -> None:
        _check_number("n", self.n, integer=True)
        if not 1 <= self.n <= _MAX_N:
            raise ValueError(f"n must be in [1, {_MAX_N}], got {self.n}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
        if not 0.0 <= self.temperature <= 1e4:
            raise ValueError(f"temperature must be in [0, 1e4], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        # no upper bound, as vLLM's SamplingParams (the server's request schema has its own)
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be finite, got {self.repetition_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        self._validate_lengths()
        self._validate_logprobs_and_ids()
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, StructuredOutputsParams):  # vLLM's type: kept as its dict
                self.structured_outputs = self.structured_outputs.as_dict()
            parse_structured_outputs(self.structured_outputs)  # shape only; the grammar is checked at add_request

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not -_MAX_SEED - 1 <= self.seed <= _MAX_SEED:
                raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: they are matched in the output text")
        if self.truncate_prompt_tokens is not None:
            _check_number("truncate_prompt_tokens", self.truncate_prompt_tokens, integer=True)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens}")

    def _validate_logprobs_and_ids(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_number(name, value, integer=True)
            # the upper bound is the engine's max_logprobs (check_logprobs_limit, at add_request), as in vLLM;
            # -1 is vLLM's "the whole vocabulary" (``with_vocab_logprobs``)
            if value < -1:
                raise ValueError(f"{name} must be >= 0, or -1 for the whole vocabulary, got {value}")
        for tid in self.stop_token_ids:
            _check_number("stop_token_ids", tid, integer=True)
            if tid < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {tid}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            for tid in self.allowed_token_ids:
                _check_number("allowed_token_ids", tid, integer=True)
                if tid < 0:
                    raise ValueError(f"allowed_token_ids must be >= 0, got {tid}")
        for word in self.bad_words or []:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must be non-empty strings, got {word!r}")
        for tid, bias in (self.logit_bias or {}).items():
            _check_number("logit_bias key", tid, integer=True)
            _check_number("logit_bias value", bias)
            # any finite bias, as vLLM's SamplingParams (the OpenAI server's schema keeps [-100, 100])
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias value must be finite, got {tid}: {bias}")
            if tid < 0:
                raise ValueError(f"logit_bias must map token ids >= 0 to finite values, got {tid}: {bias}")

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``): per-request edits leave the original alone."""
        return copy.deepcopy(self)

    def with_vocab_logprobs(self, vocab_size: int) -> SamplingParams:
        """These params with vLLM's -1 for logprobs / prompt_logprobs resolved to ``vocab_size`` (a copy; self when
        neither is -1)."""
        resolved = {name: vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(self, name) == -1}
        return dataclasses.replace(self, **resolved) if resolved else self

    def check_logprobs_limit(self, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """logprobs and prompt_logprobs must not exceed an engine's max_logprobs (already resolved: vLLM's -1 is
        the vocabulary size); without an engine, vLLM's default limit."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name} must be in [0, {max_logprobs}] (the engine's max_logprobs), got {value}")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Token ids given in the params must exist in the model's vocabulary."""
        for tid in self.stop_token_ids:
            if tid >= vocab_size:
                raise ValueError(f"stop_token_ids contains {tid}, outside the vocabulary [0, {vocab_size})")
        for tid in self.logit_bias or {}:
            if tid >= vocab_size:
                raise ValueError(f"logit_bias contains token id {tid}, outside the vocabulary [0, {vocab_size})")
        for tid in self.allowed_token_ids or []:
            if tid >= vocab_size:
                raise ValueError(f"allowed_token_ids contains {tid}, outside the vocabulary [0, {vocab_size})")

