"""The live server fixture: one dsinfer server (default model) per test session."""

from __future__ import annotations

import pytest

from .live_server import LiveServer, start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> LiveServer:
    live = start_server(tmp_path_factory.mktemp("server"))
    yield live
    stop_server(live)
