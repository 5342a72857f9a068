"""The tokenizer of a model directory: ``tokenizer.json`` (HF `tokenizers`) + ``tokenizer_config.json``.

dsinfer does not depend on transformers at run time; this wrapper gives the few things the engine needs: encode,
decode, special tokens, eos ids and the model's chat template (rendered by ``dsinfer.chat_template``).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from dsinfer.chat_template import render_template


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode/decode plus chat template for one model.

    ``encode(text, add_special_tokens=True)`` follows the tokenizer's post-processor (e.g. adds BOS);
    ``encode_literal(text)`` tokenizes special-token strings as plain text (for untrusted content).
    """

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], eos_token_ids: list[int]):
        self._tok = tokenizer
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # several named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()))
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.eos_token_ids = list(eos_token_ids)
        if not self.eos_token_ids and self.eos_token is not None:
            eos_id = self._tok.token_to_id(self.eos_token)
            if eos_id is not None:
                self.eos_token_ids = [eos_id]

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: list[int] | None = None) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}: dsinfer needs a fast (tokenizers) tokenizer")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = path / "chat_template.jinja"
        if "chat_template" not in config and template_file.exists():
            config["chat_template"] = template_file.read_text()
        return cls(HFTokenizer.from_file(str(tok_file)), config, eos_token_ids or [])

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    @cached_property
    def max_token_bytes(self) -> int:
        """The longest vocabulary entry's UTF-8 length: no token stands for more text than this (a byte-level or
        metaspace entry is longer than the text it stands for), so a text of more bytes than ``n`` times this has
        more than ``n`` tokens."""
        return max((len(token.encode()) for token in self._tok.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def special_tokens(self) -> frozenset[str]:
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: the same ids, but the batch call releases the GIL while it tokenizes, so a
        # server thread tokenizing a long prompt (seconds) does not stall the event loop (encode held it
        # throughout: 5.8 s without a turn for the loop, on 6 MB of text)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_literal(self, text: str) -> list[int]:
        """Tokenize ``text`` with special-token strings kept as literal text (no special ids produced).

        Uses a second tokenizer instance with ``encode_special_tokens`` set once, so it is thread-safe.
        """
        return self._literal_tok.encode_batch([text], add_special_tokens=False)[0].ids  # see ``encode``

    @cached_property
    def _literal_tok(self) -> HFTokenizer:
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's template (or ``chat_template``) to a prompt string."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template= or use generate() with raw text")
        return render_template(
            template, messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )
