"""The Hugging Face tokenizer surface of a dsinfer ``Tokenizer``: what ``LLM.get_tokenizer()`` returns.

vLLM's ``get_tokenizer()`` gives a transformers tokenizer, and vLLM scripts use its API (``tok("text")``,
``tok.eos_token_id``, ``apply_chat_template(...)`` returning token ids, ``decode`` keeping special tokens by default).
dsinfer does not depend on transformers at run time, so ``HFTokenizerView`` rebuilds that surface on the same
``tokenizers`` backend and ``tokenizer_config.json``. The engine keeps using the internal ``Tokenizer`` (its defaults
differ: ``decode`` skips special tokens, ``apply_chat_template`` returns a string); it is ``view.dsinfer_tokenizer``.

Defaults follow transformers 4.x where 5.x changed them (``apply_chat_template(..., return_dict=False)``), since
that is what vLLM scripts are written against.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from dsinfer.chat_template import render_template
from dsinfer.tokenizer import Tokenizer, _token_content

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (all_special_tokens lists them in this order)
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when the config gives none
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of the message to continue


class BatchEncoding(dict):
    """transformers' ``BatchEncoding`` as scripts use it: a dict whose keys are also attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFTokenizerView:
    """A transformers-``PreTrainedTokenizerFast``-like view of one dsinfer ``Tokenizer``.

    Special-token attributes (``pad_token`` etc.) can be set, as scripts do (``tok.pad_token = tok.eos_token``); that
    changes this view only, never the engine.
    """

    is_fast = True
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, tokenizer: Tokenizer):
        self._inner = tokenizer
        config = tokenizer.config
        for attr in SPECIAL_TOKEN_ATTRIBUTES:
            setattr(self, attr, _token_content(config.get(attr)))
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        if isinstance(extra, dict):  # transformers 5 also accepts {"image_token": "<image>", ...}
            extra = list(extra.values())
        self.additional_special_tokens: list[str] = [_token_content(t) for t in extra]
        self.model_max_length: int = int(config.get("model_max_length") or _VERY_LARGE_INTEGER)
        self.padding_side: str = config.get("padding_side", "right")
        self.truncation_side: str = config.get("truncation_side", "right")
        self.clean_up_tokenization_spaces: bool = bool(config.get("clean_up_tokenization_spaces", False))
        named = config.get("chat_template")
        # several named templates are a {name: template} dict, as transformers shows them
        self.chat_template: str | dict[str, str] | None = (
            {t["name"]: t["template"] for t in named} if isinstance(named, list) else tokenizer.chat_template)
        # padding and truncation are settings of a tokenizers.Tokenizer; they are set per call on this private copy
        # (under a lock) so that the engine's instance never changes
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HFTokenizerView(vocab_size={self.vocab_size}, special_tokens={self.special_tokens_map})"

    @property
    def dsinfer_tokenizer(self) -> Tokenizer:
        """The engine's own tokenizer, for dsinfer code (ChatEncoder, bad_words) that needs its API."""
        return self._inner

    @cached_property
    def backend_tokenizer(self) -> BackendTokenizer:
        return BackendTokenizer.from_str(self._inner.backend.to_str())

    # special tokens and vocabulary

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self.convert_tokens_to_ids(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_or_none(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_or_none(self.eos_token)

    @property
    def unk_token_id(self) -> int | None:
        # not through convert_tokens_to_ids, which falls back to this id
        return None if self.unk_token is None else self.backend_tokenizer.token_to_id(self.unk_token)

    @property
    def sep_token_id(self) -> int | None:
        return self._id_or_none(self.sep_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_or_none(self.pad_token)

    @property
    def cls_token_id(self) -> int | None:
        return self._id_or_none(self.cls_token)

    @property
    def mask_token_id(self) -> int | None:
        return self._id_or_none(self.mask_token)

    @property
    def special_tokens_map(self) -> dict[str, Any]:
        named: dict[str, Any] = {a: getattr(self, a) for a in SPECIAL_TOKEN_ATTRIBUTES if getattr(self, a) is not None}
        if self.additional_special_tokens:
            named["additional_special_tokens"] = list(self.additional_special_tokens)
        return named

    @property
    def all_special_tokens(self) -> list[str]:
        tokens = [getattr(self, a) for a in SPECIAL_TOKEN_ATTRIBUTES] + self.additional_special_tokens
        return list(dict.fromkeys(t for t in tokens if t is not None))  # unique, in first-seen order

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (``len(tok)`` counts those too), as in transformers."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    def get_added_vocab(self) -> dict[str, int]:
        return {token.content: i for i, token in self.added_tokens_decoder.items()}

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False):
        ids = _to_list(ids)
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend_tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    # encoding

    def __call__(
        self,
        text: str | Sequence[str],
        text_pair: str | Sequence[str] | None = None,
        add_special_tokens: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool | None = None,
    ) -> BatchEncoding:
        """``{"input_ids", "attention_mask"}`` for a string (lists) or a list of strings (lists of lists)."""
        batched = not isinstance(text, str)
        if batched and not isinstance(text, Sequence):
            raise TypeError(f"text must be a str or a list of str, got {type(text).__name__}")
        texts = list(text) if batched else [text]
        if text_pair is not None:
            pairs = list(text_pair) if batched else [text_pair]
            if batched == isinstance(text_pair, str) or len(pairs) != len(texts):
                raise ValueError("text_pair must match text: a str for a str, a list as long as text for a list")
            inputs: list[Any] = list(zip(texts, pairs))
        else:
            inputs = texts
        encodings = self._encode_batch(inputs, add_special_tokens, padding, truncation, max_length,
                                       pad_to_multiple_of, padding_side)
        out = BatchEncoding(input_ids=[e.ids for e in encodings])
        if return_attention_mask is not False:
            out["attention_mask"] = [e.attention_mask for e in encodings]
        if return_tensors is not None:  # tensors keep the batch dimension even for one string, as in transformers
            return _as_tensors(out, return_tensors)
        return out if batched else BatchEncoding({k: v[0] for k, v in out.items()})

    def _encode_batch(self, inputs, add_special_tokens, padding, truncation, max_length, pad_to_multiple_of,
                      padding_side):
        if padding is True:
            padding = "longest"
        if padding not in (False, "do_not_pad", "longest", "max_length"):
            raise ValueError(f"padding must be True, False, 'longest', 'max_length' or 'do_not_pad', got {padding!r}")
        if padding in ("longest", "max_length") and self.pad_token is None:
            raise ValueError("this tokenizer has no pad token: set tok.pad_token (e.g. = tok.eos_token) to pad")
        if truncation not in (None, False, True, "longest_first", "only_first", "only_second", "do_not_truncate"):
            raise ValueError(f"unknown truncation strategy {truncation!r}")
        limit = max_length if max_length is not None else self.model_max_length
        if limit >= _VERY_LARGE_INTEGER:  # no real limit: transformers neither truncates nor pads to it
            limit = None
        truncate = truncation not in (None, False, "do_not_truncate") and limit is not None
        if padding == "max_length" and limit is None:
            padding = "longest"
        backend = self.backend_tokenizer
        with self._lock:
            if truncate:
                strategy = "longest_first" if truncation is True else truncation
                backend.enable_truncation(limit, strategy=strategy, direction=self.truncation_side)
            else:
                backend.no_truncation()
            if padding in ("longest", "max_length"):
                backend.enable_padding(direction=padding_side or self.padding_side, pad_id=self.pad_token_id,
                                       pad_token=self.pad_token, pad_to_multiple_of=pad_to_multiple_of,
                                       length=limit if padding == "max_length" else None)
            else:
                backend.no_padding()
            return backend.encode_batch(inputs, add_special_tokens=add_special_tokens)

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, **kwargs: Any):
        return self(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.encode(text, pair, add_special_tokens=add_special_tokens).tokens

    # decoding

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str | list[str]:
        """Text of one sequence (an int, a list, a 1-d tensor), or a list of texts for a batch of sequences."""
        token_ids = _to_list(token_ids)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], list):
            return self.batch_decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces)
        text = self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        sequences = _to_list(sequences)
        if sequences and isinstance(sequences[0], int):  # one sequence: transformers 5 decodes it as one text
            return [self.decode(sequences, skip_special_tokens, clean_up_tokenization_spaces)]
        return [self.decode(seq, skip_special_tokens, clean_up_tokenization_spaces) for seq in sequences]

    # chat templates

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The template to render: ``chat_template`` (a template, or the name of one of the model's named
        templates), else the model's (its ``tool_use`` one when tools are given and it has one)."""
        if isinstance(self.chat_template, dict):
            by_name = self.chat_template
            if chat_template in by_name:
                return by_name[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in by_name:
                    return by_name["tool_use"]
                if "default" not in by_name:
                    raise ValueError(f"this model has several chat templates and no default: pass chat_template= "
                                     f"one of {sorted(by_name)}")
                return by_name["default"]
            return chat_template
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat_template and none was passed")
        return template

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        padding: bool | str = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = False,
        tokenizer_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        """Render (and by default tokenize) one conversation or a list of them, as transformers does: the
        rendered text is tokenized as a whole without added special tokens, so special-token strings typed in a
        message become special ids (``LLM.chat`` keeps them literal instead; the two agree for other text).
        ``**kwargs`` reach the template; the special tokens (``bos_token``, ...) are there too."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        for tool in tools or []:
            if not isinstance(tool, dict):  # transformers turns functions into schemas; that needs transformers
                raise TypeError(f"tools must be JSON-schema dicts, got {type(tool).__name__}")
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        batched = isinstance(conversation[0], list | tuple)
        conversations = list(conversation) if batched else [conversation]
        template = self.get_chat_template(chat_template, tools)
        context = {**self.special_tokens_map, **kwargs}  # the call's kwargs win over the special tokens
        rendered = [self._render(template, c, tools, documents, add_generation_prompt, continue_final_message, context)
                    for c in conversations]
        if not tokenize:
            return rendered if batched else rendered[0]
        out = self(rendered if batched else rendered[0], add_special_tokens=False, padding=padding,
                   truncation=truncation, max_length=max_length, return_tensors=return_tensors,
                   **(tokenizer_kwargs or {}))
        return out if return_dict else out["input_ids"]

    @staticmethod
    def _render(template, messages, tools, documents, add_generation_prompt, continue_final_message, context):
        # messages' None-valued keys are dropped (``content: None`` would render "None"), as transformers does
        messages = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        final = None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                raise ValueError("continue_final_message needs a final message with string content")
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        text = render_template(template, messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **context)
        if final is None:
            return text
        # cut right after the final message's text, so the model continues it (no end of turn)
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ValueError("continue_final_message: the chat template does not render the final message's text")
        at = text.rindex(_CONTINUE_TAG.strip())
        return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: drop the spaces a word-piece decode leaves before punctuation."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _to_list(value: Any) -> Any:
    """Token ids given as a tensor or numpy array, as plain Python ints / lists (transformers' ``to_py_obj``)."""
    return value.tolist() if hasattr(value, "tolist") else value


def _as_tensors(out: BatchEncoding, return_tensors: str | None) -> BatchEncoding:
    if return_tensors is None:
        return out
    if return_tensors == "pt":
        import torch

        return BatchEncoding({k: torch.tensor(v) for k, v in out.items()})
    if return_tensors == "np":
        import numpy as np

        return BatchEncoding({k: np.array(v) for k, v in out.items()})
    raise ValueError(f"return_tensors must be None, 'pt' or 'np', got {return_tensors!r}")
