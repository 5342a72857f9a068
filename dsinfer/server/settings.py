"""Server settings: one frozen dataclass built from the command line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[
        str, ...
    ] = ()  # names accepted in "model" (answers carry the requested one, else the first); () = any
    api_keys: tuple[str, ...] = ()  # accepted keys; () = no authentication
    max_body_bytes: int = 8 << 20  # larger request bodies are answered 413
    max_json_depth: int = 64  # deeper JSON nesting is answered 400 before parsing
    max_waiting_requests: int = 256  # requests queued beyond this are answered 429 (529 on Anthropic routes)
    max_waiting_tokens: int | None = None  # queued prompt tokens beyond this: the same 429 / 529; None: no bound
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight requests may finish
    chat_template: str | None = None  # template text overriding the model's
    chat_format: str = "auto"  # built-in format when the model has no template: auto | chatml | deepseek_v3
    tool_call_parser: str = "auto"  # auto | hermes | deepseek_v3
    reasoning_parser: str = "auto"  # auto (on when the vocabulary has <think>) | think | none
    trust_request_chat_template: bool = False  # allow the "chat_template" request field
    # tool_choice "none" keeps the tools in the prompt (vLLM's default; the model is only not parsed for calls);
    # True leaves them out, as vLLM's --exclude-tools-when-tool-choice-none
    exclude_tools_when_tool_choice_none: bool = False
    # CORS (vLLM's --allowed-origins/-methods/-headers, --allow-credentials). None: no CORS headers at all; vLLM
    # always allows every origin, dsinfer only once a CORS flag asks for it (a browser page then reads the answers)
    cors_allowed_origins: tuple[str, ...] | None = None
    cors_allowed_methods: tuple[str, ...] = ("*",)
    cors_allowed_headers: tuple[str, ...] = ("*",)
    cors_allow_credentials: bool = False
    root_path: str = ""  # path prefix of a proxy in front (vLLM's --root-path); "" = none
    # logprobs tokens as "token_id:N" (vLLM's --return-tokens-as-token-ids); a request's own field wins
    return_tokens_as_token_ids: bool = False
    # the role of chat completion answers that follow a generation prompt (vLLM's --response-role)
    response_role: str = "assistant"
    version: str = "0.1.0"

    @property
    def model_name(self) -> str:
        return self.served_model_names[0] if self.served_model_names else "default"
