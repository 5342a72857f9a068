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
    max_waiting_requests: int = 256  # requests queued beyond this are answered 429
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight requests may finish
    chat_template: str | None = None  # template text overriding the model's
    chat_format: str = "auto"  # built-in format when the model has no template: auto | chatml | deepseek_v3
    tool_call_parser: str = "auto"  # auto | hermes | deepseek_v3
    reasoning_parser: str = "auto"  # auto (on when the vocabulary has <think>) | think | none
    trust_request_chat_template: bool = False  # allow the "chat_template" request field
    # tool_choice "none" keeps the tools in the prompt (vLLM's default; the model is only not parsed for calls);
    # True leaves them out, as vLLM's --exclude-tools-when-tool-choice-none
    exclude_tools_when_tool_choice_none: bool = False
    version: str = "0.1.0"

    @property
    def model_name(self) -> str:
        return self.served_model_names[0] if self.served_model_names else "default"
