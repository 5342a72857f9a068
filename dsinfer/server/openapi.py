"""``GET /openapi.json``: FastAPI's schema with the request bodies the routes validate themselves.

The routes read their JSON with ``parse_body`` (so that every failure is a 400 in the API's own envelope, not
FastAPI's 422), which leaves FastAPI's schema without request bodies; client generators and schemathesis need
them. Each body's schema is its pydantic model's (JSON Schema 2020-12, which OpenAPI 3.1 takes), the
definitions in ``components/schemas``; a 400 in the route family's error envelope is listed beside each 200.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from dsinfer.protocol.anthropic_schemas import CountTokensRequest, MessagesRequest
from dsinfer.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
from dsinfer.protocol.responses_schemas import ResponsesRequest
from dsinfer.server.tokenize import DetokenizeRequest, TokenizeRequest

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
_REF = "#/components/schemas/{model}"
_ERROR = {"description": "the request is invalid (the error envelope names the field in `param`)",
          "content": {"application/json": {"schema": {"type": "object", "required": ["error"]}}}}


def _add_bodies(schema: dict[str, Any]) -> None:
    """The request bodies into ``schema``: one pydantic schema of all the models, which names apart two models of
    one name (OpenAI's and Anthropic's ``ContentPart``), its definitions the components."""
    refs, defs = models_json_schema([(model, "validation") for model in REQUEST_BODIES.values()],
                                    ref_template=_REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, model in REQUEST_BODIES.items():
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": refs[(model, "validation")]}}}
        operation.setdefault("responses", {})["400"] = _ERROR


def install_openapi(app: FastAPI) -> None:
    """Serve the schema with the request bodies (built once, on the first request for it)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _add_bodies(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
