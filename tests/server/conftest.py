"""The live server fixture: one dsinfer server (default model) per test session; an official openai client for it
(``client``; a module may override it, as the Anthropic tests do with theirs), an anthropic one (``claude``) and the
served ``model``."""

from __future__ import annotations

import anthropic
import openai
import pytest

from .live_server import API_KEY, LiveServer, start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> LiveServer:
    live = start_server(tmp_path_factory.mktemp("server"))
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    """An official anthropic client for the same server."""
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
