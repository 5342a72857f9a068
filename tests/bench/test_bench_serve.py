"""``dsinfer bench serve`` against a live dsinfer server on the bundled model: the result JSON's figures and raw
per-request times, and its client-side TTFT against the server's own /metrics histogram."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from dsinfer.entrypoints.cli import main
from tests.server.live_server import API_KEY, start_server, stop_server

NUM_PROMPTS = 4
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("bench_server"))
    yield server
    stop_server(server)


def _ttft_histogram(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's TTFT histogram."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = float(re.search(r"^dsinfer_time_to_first_token_seconds_sum (\S+)$", text, re.M).group(1))
    count = float(re.search(r"^dsinfer_time_to_first_token_seconds_count (\S+)$", text, re.M).group(1))
    return total, count


def _bench(live, tmp_path, *extra: str, input_len: int = 32) -> dict:
    rc = main(["bench", "serve", "--base-url", live.url, "--api-key", API_KEY, "--num-prompts", str(NUM_PROMPTS),
               "--random-input-len", str(input_len), "--random-output-len", str(OUTPUT_LEN),
               "--random-vocab-size", "49152", "--result-dir", str(tmp_path), "--result-filename", "run.json",
               "--disable-tqdm", *extra])
    assert rc == 0
    return json.loads((tmp_path / "run.json").read_text())


def test_serve_result_has_figures_and_every_raw_time(live, tmp_path):
    result = _bench(live, tmp_path, "--max-concurrency", "2", "--goodput", "ttft:60000", "tpot:1")
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["input_lens"] == [32] * NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert all(len(itl) == OUTPUT_LEN - 1 for itl in result["itls"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_ttft_ms"] == pytest.approx(1000 * sum(result["ttfts"]) / NUM_PROMPTS)
    assert all(t < e for t, e in zip(result["ttfts"], result["e2els"]))
    # a TPOT under 1 ms is out of reach on CPU: no request is good
    assert result["request_goodput"] == 0.0
    assert result["output_throughput"] == pytest.approx(NUM_PROMPTS * OUTPUT_LEN / result["duration"])


def test_serve_ttft_agrees_with_server_histogram(live, tmp_path):
    """The mean TTFT the client saw over one request at a time against the mean of the same requests in the
    server's histogram (the /metrics delta over the run): the client adds only the HTTP round trip (10-35 ms on
    a loaded 2-core machine), so the prompts are long enough for a TTFT of some hundreds of ms, and a request before
    the run takes the server's first-request costs out of it."""
    model = httpx.get(f"{live.v1}/models", headers=live.headers(), timeout=30).json()["data"][0]["id"]
    assert live.post("/v1/completions", json={"model": model, "prompt": [100, 200], "max_tokens": 2}).status_code == 200
    sum_before, count_before = _ttft_histogram(live.url)
    result = _bench(live, tmp_path, "--max-concurrency", "1", input_len=128)
    sum_after, count_after = _ttft_histogram(live.url)
    assert count_after - count_before == NUM_PROMPTS
    server_mean_ms = 1000 * (sum_after - sum_before) / NUM_PROMPTS
    assert result["mean_ttft_ms"] == pytest.approx(server_mean_ms, rel=0.10)
    assert result["mean_ttft_ms"] >= server_mean_ms  # the client's clock starts before the server's


def test_serve_sends_jsonl_conversations_to_the_chat_endpoint(live, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "output_len": 5}) + "\n")
    result = _bench(live, tmp_path, "--dataset-name", "jsonl", "--dataset-path", str(data), "--num-prompts", "2")
    assert result["completed"] == 2 and result["output_lens"] == [5, 5]
    assert all(n > 5 for n in result["input_lens"])  # the server's count of the templated conversation
    assert all(text for text in result["generated_texts"])


def test_sweep_writes_a_json_per_concurrency_and_the_pareto_png(live, tmp_path):
    """One prompt per user (``--prompts-per-concurrency``): a point's prompts grow with its concurrency."""
    pytest.importorskip("matplotlib")
    assert main(["bench", "sweep", "--base-url", live.url, "--api-key", API_KEY, "--prompts-per-concurrency", "1",
                 "--random-input-len", "16", "--random-output-len", "4", "--random-vocab-size", "49152",
                 "--concurrencies", "1,2", "--label", "cpu run", "--result-dir", str(tmp_path),
                 "--disable-tqdm"]) == 0
    results = [json.loads((tmp_path / f"cpu_run-infqps-c{c}.json").read_text()) for c in (1, 2)]
    assert [(r["max_concurrency"], r["completed"], r["seed"]) for r in results] == [(1, 1, 0), (2, 2, 1)]
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_prompts_per_concurrency_needs_a_concurrency_grid(capsys):
    rc = main(["bench", "sweep", "--request-rates", "1,2", "--prompts-per-concurrency", "2"])
    assert rc == 2
    assert "--prompts-per-concurrency takes a positive number and needs --concurrencies" in capsys.readouterr().err


def test_serve_rejects_a_bad_goodput_name(live, tmp_path, capsys):
    rc = main(["bench", "serve", "--base-url", live.url, "--api-key", API_KEY, "--goodput", "latency:5"])
    assert rc == 2
    assert "--goodput takes NAME:MILLISECONDS" in capsys.readouterr().err
