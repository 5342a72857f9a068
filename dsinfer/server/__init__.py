"""The OpenAI- and Anthropic-compatible HTTP server (FastAPI). Imported only by ``dsinfer serve``."""
