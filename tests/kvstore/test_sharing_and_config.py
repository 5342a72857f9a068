"""Two engine processes sharing one directory; start-up errors of a bad kv_store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsinfer import LLM
from dsinfer.entrypoints.cli import main
from tests.kvstore.conftest import GRAIN, assert_no_leak, make_prompts, run, token_ids

ROOT = Path(__file__).resolve().parents[2]
_ENGINE_A = f"""
import json, sys
from dsinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_store={{"dir": sys.argv[2], "grain": {GRAIN}}})
prompts = json.loads(sys.argv[3])
out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
llm.engine.shutdown()  # writes every queued save before it returns
print(json.dumps([list(o.outputs[0].token_ids) for o in out]))
"""


def test_engine_b_hits_the_prefix_engine_a_computed(tiny_llama_dir, cold, tmp_path):
    prompts = make_prompts(40, n=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSINFER_CPU_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _ENGINE_A, str(tiny_llama_dir), str(tmp_path), json.dumps(prompts)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    a_tokens = json.loads(done.stdout.strip().splitlines()[-1])
    b = LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path), "grain": GRAIN})
    out = run(b, prompts)
    assert token_ids(out) == a_tokens == cold("llama", prompts)
    assert [o.num_cached_tokens for o in out] == [96, 96]
    assert b.engine.kv_store_stats()["hit_tokens_dir"] >= 96
    assert_no_leak(b)


@pytest.mark.parametrize(("kv_store", "message"), [
    ({"dir": "/nonexistent/kv"}, "kv_store.dir='/nonexistent/kv' is not an existing directory"),
    ({"host_gb": -1}, "kv_store.host_gb must be a number >= 0, got -1"),
    ({"host_gb": 1, "grain": 40}, r"kv_store.grain must be a positive multiple of the KV block size \(16\), got 40"),
    ({"host_gb": 1, "dir_gb": 10}, "kv_store.dir_gb is set but kv_store.dir is not"),
    ({"host_gb": 1, "ttl_s": {"chat": -5}}, r"kv_store.ttl_s\['chat'\] must be a number > 0"),
    ({"host_gb": 1, "hots_gb": 1}, r"kv_store: unknown key\(s\) \['hots_gb'\]"),
    ({"host_gb": 1, "load_threads": 0}, r"kv_store.load_threads must be an integer in \[1, 64\], got 0"),
])
def test_bad_kv_store_is_a_start_up_error_naming_the_field(tiny_llama_dir, kv_store, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), kv_store=kv_store)


def test_unwritable_dir_is_refused(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="is not writable by this process"):
        LLM(str(tiny_llama_dir), kv_store={"dir": str(tmp_path)})


def test_serve_refuses_a_bad_kv_store_with_exit_2(tiny_llama_dir, capsys):
    assert main(["serve", str(tiny_llama_dir), "--kv-store", '{"dir": "/nonexistent/kv"}']) == 2
    assert "error: --kv-store {\"dir\": \"/nonexistent/kv\"}: kv_store.dir=" in capsys.readouterr().err
    assert main(["serve", str(tiny_llama_dir), "--kv-store", '{"host_gb": -2}']) == 2
    assert "kv_store.host_gb must be a number >= 0" in capsys.readouterr().err
