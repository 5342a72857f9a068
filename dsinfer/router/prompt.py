"""A request body's prompt as the replica will see it: its token ids (the model's tokenizer and the chat template
the replicas serve, through the same protocol code as ``dsinfer serve``) and their block hash chain
(``kvcache.hashing``), for the load-aware policy's prompt length and the prefix-aware policy's hashes.

A body the router cannot read (invalid, a batch, a request-supplied template) is routed on its estimated length
alone (``len(body) / 4`` tokens); the replica then answers it (400 for an invalid one) as it would directly.
"""

from __future__ import annotations

import logging
from typing import Any

from dsinfer.kvcache.hashing import block_hash_chain
from dsinfer.router.policy import RequestInfo
from dsinfer.router.settings import RouterSettings

logger = logging.getLogger("dsinfer.router")
_BYTES_PER_TOKEN = 4  # the length estimate of a prompt the router cannot tokenize


class PromptReader:
    def __init__(self, tokenizer: Any, template: str):
        from dsinfer.protocol.chat_encoding import ChatEncoder

        self.tokenizer = tokenizer
        self.chat = ChatEncoder(tokenizer, template)

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> PromptReader:
        """The tokenizer of ``settings.tokenizer`` or of ``settings.model`` (the bundled model by default)."""
        from dsinfer.models.loader.resolve import resolve_model_dir
        from dsinfer.protocol.chat_formats import serving_template
        from dsinfer.tokenizer import Tokenizer

        path = settings.tokenizer or resolve_model_dir(settings.model, "auto")[0]
        tokenizer = Tokenizer.from_dir(path)
        return cls(tokenizer, serving_template(tokenizer, settings.chat_template, settings.chat_format))

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None when this body's prompt cannot be known here."""
        try:
            if path == "/v1/chat/completions":
                return self._chat(body)
            if path == "/v1/completions":
                return self._completion(body)
            if path == "/v1/messages":
                return self._messages(body)
        except Exception as exc:  # noqa: BLE001 - an unreadable body is the replica's to refuse; routed on length
            logger.debug("no prompt tokens for a %s body: %s", path, exc)
        return None

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        from dsinfer.protocol.conversation import openai_chat_messages, openai_chat_tools
        from dsinfer.protocol.openai_schemas import ChatCompletionRequest

        req = ChatCompletionRequest.model_validate(body)
        if req.chat_template is not None:
            return None
        encoded = self.chat.encode(openai_chat_messages(req.messages), tools=openai_chat_tools(req.tools),
                                   add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                                   template_kwargs=req.chat_template_kwargs,
                                   continue_final_message=req.continue_final_message)
        return encoded.token_ids

    def _completion(self, body: dict[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None  # a batch: its prompts may belong on different replicas; routed on length

    def _messages(self, body: dict[str, Any]) -> list[int] | None:
        from dsinfer.protocol.anthropic_schemas import MessagesRequest
        from dsinfer.protocol.chat_encoding import ends_with_prefill
        from dsinfer.protocol.conversation import anthropic_messages, anthropic_tools

        req = MessagesRequest.model_validate(body)
        messages = anthropic_messages(req)
        kwargs = {"enable_thinking": req.thinking.type != "disabled"} if req.thinking else None
        return self.chat.encode(messages, tools=anthropic_tools(req) if req.tools else None, template_kwargs=kwargs,
                                continue_final_message=ends_with_prefill(messages)).token_ids


def request_info(reader: PromptReader | None, path: str, body: dict[str, Any] | None, raw_size: int,
                 block_sizes: set[int]) -> RequestInfo:
    """The policies' view of one request: its prompt length and its hash chain for each replica block size."""
    ids = reader.token_ids(path, body) if reader is not None and body is not None else None
    if ids is None:
        return RequestInfo(max(raw_size // _BYTES_PER_TOKEN, 1))
    return RequestInfo(len(ids), {bs: block_hash_chain(ids, bs) for bs in block_sizes})
