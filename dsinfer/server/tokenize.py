"""vLLM-compatible POST /tokenize, POST /detokenize and GET /tokenizer_info.

/tokenize is bounded as a generation request is: a text too long for the context whatever its tokens is refused
before it is tokenized, and a result of more tokens than the context holds is a 400."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictStr

from dsinfer.protocol.conversation import openai_chat_messages, openai_chat_tools
from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.fields import ShortStr, TokenId, WireModel
from dsinfer.protocol.openai_schemas import ChatMessage, Tool
from dsinfer.protocol.sampling import check_prompt_ids
from dsinfer.server.context import ServingContext, parse_body

router = APIRouter()


class TokenizeRequest(WireModel):
    model: ShortStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False
    chat_template: Annotated[str, Field(max_length=1 << 20)] | None = None  # as on chat completions
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(WireModel):
    model: ShortStr | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    ctx: ServingContext = request.app.state.ctx
    req = await parse_body(request, TokenizeRequest)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ProtocolError('give exactly one of "prompt" or "messages"', param="prompt")
    if req.messages is None and (req.chat_template is not None or req.chat_template_kwargs is not None):
        field = "chat_template" if req.chat_template is not None else "chat_template_kwargs"
        raise ProtocolError(f'"{field}" applies to "messages", not to "prompt"', param=field)
    if req.messages is not None:
        if (req.continue_final_message and req.add_generation_prompt
                and "add_generation_prompt" in req.model_fields_set):
            raise ProtocolError("continue_final_message and add_generation_prompt cannot both be true",
                                param="continue_final_message")
        encoded = await ctx.encode_chat(
            openai_chat_messages(req.messages),
            openai_chat_tools(req.tools),
            req.chat_template,
            req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
        )
        tokens = encoded.token_ids
    else:
        ctx.check_prompt_text(req.prompt)
        tokens = await asyncio.to_thread(ctx.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
    ctx.check_prompt_tokens(len(tokens), "messages" if req.messages is not None else "prompt")
    result: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}
    if req.return_token_strs:
        result["token_strs"] = await asyncio.to_thread(lambda: [ctx.tokenizer.id_to_token(t) for t in tokens])
    # a JSONResponse: json.dumps at C speed, not FastAPI's per-element encoder (seconds on the event loop for a
    # few million tokens)
    return JSONResponse(result)


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    ctx: ServingContext = request.app.state.ctx
    req = await parse_body(request, DetokenizeRequest)
    ctx.check_model(req.model)
    if req.tokens:
        check_prompt_ids(req.tokens, ctx.vocab_size, param="tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    """vLLM's /tokenizer_info (lm-eval-harness's remote tokenizer reads it): the tokenizer's configuration
    (tokenizer_config.json), its class, and the chat template the server applies."""
    ctx: ServingContext = request.app.state.ctx
    config = {key: value for key, value in ctx.tokenizer.config.items() if key != "added_tokens_decoder"}
    info = {**config, "tokenizer_class": config.get("tokenizer_class") or "PreTrainedTokenizerFast",
            "chat_template": ctx.chat.template, "model_max_length": ctx.max_model_len,
            "bos_token": ctx.tokenizer.bos_token, "eos_token": ctx.tokenizer.eos_token}
    return JSONResponse(info)
