"""One weather tool in each API's shape, and a question that calls for it: the tool-call tests' shared request."""

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": PARAMS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                    "parameters": PARAMS}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": PARAMS}]
