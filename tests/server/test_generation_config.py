"""The server's default sampling values from the model's generation_config.json (vLLM's ``--generation-config auto``):
a field the request leaves unset (or sends as null) takes the file's value, a field it sets wins; max_new_tokens is
a default max_tokens, or a ceiling when it comes from a ``--generation-config`` folder. Live servers on a copy of
the default model (SmolLM2, converted from GGUF) with a generation_config.json added; plus the max_tokens rule, the
request-field merge and the flags without a server."""

from __future__ import annotations

import argparse
import json

import pytest

from dsinfer.protocol.errors import ProtocolError
from dsinfer.protocol.sampling import build_sampling_params, resolve_max_tokens
from dsinfer.server.cli import add_serve_args, engine_args

from .live_server import start_server, stop_server

# greedy and 5 tokens unless the request says otherwise
GENERATION_CONFIG = {"temperature": 0.0, "top_k": 1, "max_new_tokens": 5}
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _model_with_generation_config(tmp_path, extra: dict) -> str:
    """The default model's converted directory, linked file by file, with ``extra`` added to its
    generation_config.json."""
    from dsinfer.models.loader.gguf import cached_gguf_dir, default_model_path

    source = cached_gguf_dir(default_model_path())
    model = tmp_path / "model"
    model.mkdir()
    for f in source.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((source / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **extra}))
    return str(model)


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("genconfig_auto")
    live = start_server(tmp, _model_with_generation_config(tmp, GENERATION_CONFIG))
    yield live
    stop_server(live)


def _chat(server, **fields) -> dict:
    r = server.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def _texts(body: dict, key: str = "message") -> list[str]:
    return [c[key]["content"] if key == "message" else c["text"] for c in body["choices"]]


def test_chat_unset_fields_take_the_generation_config(auto_server):
    greedy = _chat(auto_server, temperature=0.0, top_k=1, max_tokens=5)
    body = _chat(auto_server, n=3)
    assert body["usage"]["completion_tokens"] == 3 * 5  # max_new_tokens 5, for each choice
    assert _texts(body) == _texts(greedy) * 3  # temperature 0 from the file: every choice is the greedy one
    # a null counts as unset
    assert _texts(_chat(auto_server, n=2, temperature=None, max_tokens=None, top_k=None)) == _texts(greedy) * 2


def test_chat_set_fields_win_over_the_generation_config(auto_server):
    greedy = _texts(_chat(auto_server, max_tokens=8))
    # the model's own max_new_tokens is only a default: a larger max_tokens is served in full
    assert _chat(auto_server, max_tokens=8)["usage"]["completion_tokens"] == 8
    assert _chat(auto_server, max_completion_tokens=7)["usage"]["completion_tokens"] == 7
    # temperature 1.5 alone still samples from the file's top_k 1: greedy
    assert _texts(_chat(auto_server, n=4, max_tokens=8, temperature=1.5, seed=3)) == greedy * 4
    # with top_k off too, the four samples are not all the greedy answer
    sampled = _texts(_chat(auto_server, n=4, max_tokens=8, temperature=1.5, top_k=-1, seed=3))
    assert any(text != greedy[0] for text in sampled)


def test_completions_take_the_generation_config(auto_server):
    def complete(**fields) -> dict:
        r = auto_server.post("/v1/completions", json={"prompt": "The sky is", "ignore_eos": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()

    # an unset max_tokens is the completions' own 16, as in vLLM; an explicit null takes max_new_tokens
    assert complete()["usage"]["completion_tokens"] == 16
    assert complete(max_tokens=None)["usage"]["completion_tokens"] == 5
    assert complete(max_tokens=9)["usage"]["completion_tokens"] == 9
    greedy = _texts(complete(max_tokens=6, temperature=0.0), "text")
    assert _texts(complete(max_tokens=6, n=3), "text") == greedy * 3
    sampled = _texts(complete(max_tokens=6, n=4, temperature=1.5, top_k=0, seed=3), "text")
    assert any(text != greedy[0] for text in sampled)


def test_anthropic_and_responses_take_the_generation_config(auto_server):
    greedy = _texts(_chat(auto_server, max_tokens=6, ignore_eos=False))[0]
    r = auto_server.post("/v1/messages", json={"max_tokens": 6, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == greedy  # temperature and top_k from the file
    r = auto_server.post("/v1/responses", json={"input": MESSAGES[0]["content"]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] <= 5  # max_new_tokens (EOS may come first: no ignore_eos here)


def test_a_generation_config_folder_caps_max_tokens(tmp_path):
    """``--generation-config DIR``: DIR's file replaces the model's, and its max_new_tokens is a ceiling (vLLM's
    override_max_tokens); ``--override-generation-config`` goes over it."""
    folder = tmp_path / "genconfig"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 4}))
    live = start_server(tmp_path, "--generation-config", str(folder),
                        "--override-generation-config", '{"top_k": 1}')
    try:
        body = _chat(live, n=2, max_tokens=10, temperature=1.5, seed=3)
        assert body["usage"]["completion_tokens"] == 2 * 4  # capped at the folder's max_new_tokens
        texts = _texts(body)
        assert texts[0] == texts[1]  # the override's top_k 1
        r = live.post("/v1/messages", json={"max_tokens": 10, "messages": MESSAGES})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] <= 4
    finally:
        stop_server(live)


# -- without a server --------------------------------------------------------------------------------------------


def test_max_tokens_default_and_limit():
    # unset: the default, clamped to the room left (a default the client did not ask for is never a 400)
    assert resolve_max_tokens(None, 10, 100, default=5) == 5
    assert resolve_max_tokens(None, 98, 100, default=5) == 2
    assert resolve_max_tokens(None, 10, 100) == 90
    # set: the request wins over the default, and is still a 400 beyond the room
    assert resolve_max_tokens(30, 10, 100, default=5) == 30
    with pytest.raises(ProtocolError, match="maximum context length"):
        resolve_max_tokens(95, 10, 100, default=5, limit=20)
    # the limit caps both
    assert resolve_max_tokens(30, 10, 100, default=5, limit=20) == 20
    assert resolve_max_tokens(None, 10, 100, limit=20) == 20
    assert resolve_max_tokens(16, 90, 100, clamp=True, limit=8) == 8


def test_request_fields_over_server_defaults():
    defaults = {"temperature": 0.0, "top_k": 1, "repetition_penalty": 1.2}
    params = build_sampling_params({"temperature": None, "top_k": 5, "max_tokens": 3}, 100, False, defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (0.0, 5, 1.2, 3)
    params = build_sampling_params({"top_p": 0.5}, 100, True)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, -1, 0.5)


def _parse(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_generation_config_flags_reach_engine_args():
    args = engine_args(_parse("--generation-config", "vllm", "--override-generation-config",
                              '{"temperature": 0.5, "max_new_tokens": 7}'))
    assert (args.generation_config, args.override_generation_config) == (
        "vllm", {"temperature": 0.5, "max_new_tokens": 7})
    assert (engine_args(_parse()).generation_config, engine_args(_parse()).override_generation_config) == (
        "auto", None)


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_override_generation_config_must_be_a_json_object(value, capsys):
    with pytest.raises(SystemExit):
        _parse("--override-generation-config", value)
    assert "--override-generation-config" in capsys.readouterr().err
