"""Built-in chat templates for models that ship none: ChatML (with Hermes/Qwen tools) and DeepSeek-V3.

Both take HF-style ``messages`` (role, content, tool_calls with ``arguments`` as JSON text or an object,
tool_call_id) and ``tools`` (OpenAI function tools), like the models' own templates.
"""

from __future__ import annotations

import json
from typing import Any

CHATML_TEMPLATE = """\
{%- set ns = namespace(system=none, start=0) -%}
{%- if messages and messages[0]['role'] in ('system', 'developer') -%}
{%- set ns.system = messages[0]['content'] or '' -%}{%- set ns.start = 1 -%}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
{% if ns.system is not none %}{{ ns.system }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif ns.system is not none -%}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif -%}
{%- for message in messages[ns.start:] -%}
{%- if message['role'] == 'tool' -%}
{%- if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message['content'] or '' }}
</tool_response>
{%- if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>
{% endif -%}
{%- elif message['role'] == 'assistant' -%}
<|im_start|>assistant
{{ message['content'] or '' }}
{%- for tc in message['tool_calls'] or [] %}{%- set args = tc['function']['arguments'] %}
{{- '\n' if message['content'] or not loop.first else '' }}<tool_call>
{"name": "{{ tc['function']['name'] }}", "arguments": {{ args if args is string else args | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] or '' }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

DEEPSEEK_V3_TEMPLATE = """\
{%- set ns = namespace(system='', in_tools=false) -%}
{%- for message in messages if message['role'] in ('system', 'developer') -%}
{%- set ns.system = ns.system + ('\\n\\n' if ns.system else '') + (message['content'] or '') -%}
{%- endfor -%}
{{ bos_token }}{{ ns.system }}
{%- if tools %}{{ '\\n\\n' if ns.system else '' }}## Tools
You have access to the following tools:
{% for tool in tools %}
### {{ tool['function']['name'] }}
Description: {{ tool['function']['description'] or '' }}

Parameters: {{ (tool['function']['parameters'] or {}) | tojson }}
{% endfor %}
IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name
```json
tool_call_arguments
```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
{%- endif -%}
{%- for message in messages if message['role'] not in ('system', 'developer') -%}
{%- if message['role'] != 'tool' and ns.in_tools -%}
<｜tool▁outputs▁end｜>{% set ns.in_tools = false %}
{%- endif -%}
{%- if message['role'] == 'user' -%}
<｜User｜>{{ message['content'] or '' }}
{%- elif message['role'] == 'assistant' -%}
<｜Assistant｜>{{ message['content'] or '' }}
{%- if message['tool_calls'] -%}
<｜tool▁calls▁begin｜>
{%- for tc in message['tool_calls'] -%}{%- set args = tc['function']['arguments'] -%}
{{ '\\n' if not loop.first else '' }}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc['function']['name'] }}
```json
{{ args if args is string else args | tojson }}
```<｜tool▁call▁end｜>
{%- endfor -%}
<｜tool▁calls▁end｜>
{%- endif -%}
<｜end▁of▁sentence｜>
{%- elif message['role'] == 'tool' -%}
{%- if not ns.in_tools %}<｜tool▁outputs▁begin｜>{% set ns.in_tools = true %}{% else %}\n{% endif -%}
<｜tool▁output▁begin｜>{{ message['content'] or '' }}<｜tool▁output▁end｜>
{%- endif -%}
{%- endfor -%}
{%- if ns.in_tools %}<｜tool▁outputs▁end｜>{% endif -%}
{%- if add_generation_prompt %}<｜Assistant｜>{% endif -%}
"""

BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE, "deepseek_v3": DEEPSEEK_V3_TEMPLATE}
DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"


def default_format_for(special_tokens: frozenset[str]) -> str:
    """The built-in format a model without a template most likely speaks, from its special tokens."""
    return "deepseek_v3" if DEEPSEEK_BOS in special_tokens else "chatml"


def serving_template(tokenizer: Any, chat_template: str | None, chat_format: str = "auto") -> str:
    """The template a server renders chats with: ``chat_template`` (--chat-template), else the tokenizer's, else
    (or when ``chat_format`` names one) a built-in format. ``dsinfer router`` picks it the same way."""
    template = chat_template or tokenizer.chat_template
    if template is None or chat_format != "auto":
        fmt = default_format_for(frozenset(tokenizer.special_tokens)) if chat_format == "auto" else chat_format
        template = BUILTIN_TEMPLATES[fmt]
    return template


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes-style tool instructions, for a model template that does not render ``tools`` itself."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
