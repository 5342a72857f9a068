"""Units without the model: spec parsing, the byte-bounded cache (10,000 schemas), matcher rollback, bitmask op."""

from __future__ import annotations

import os

import pytest
import torch

from dsinfer import ops
from dsinfer.ops.bitmask import apply_token_bitmask_ref, unpack_bitmask
from dsinfer.structured.cache import ByteBoundedLRU
from dsinfer.structured.spec import parse_structured_outputs


def test_spec_key_is_canonical_and_json_object_is_json_kind():
    a = parse_structured_outputs({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    b = parse_structured_outputs({"json": '{"properties": {"a": {"type": "integer"}}, "type": "object"}'})
    assert a.key == b.key
    assert parse_structured_outputs({"json_object": True}).kind == "json"


@pytest.mark.parametrize("raw, message", [
    ({}, "exactly one"), ({"regex": ""}, "non-empty string"), ({"choice": ["a", 3]}, "non-empty list"),
    ({"json": 3}, "JSON schema object"), ({"json_object": "yes"}, "must be true"), ({"foo": 1}, "unknown"),
])
def test_bad_specs_say_what_is_wrong(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_structured_outputs(raw)


def test_lru_evicts_to_stay_within_bytes():
    cache = ByteBoundedLRU(100, size_of=len)
    for i in range(50):
        cache.put(f"k{i}", "x" * 30)
        assert cache.bytes_used <= 100
    assert len(cache) == 3 and cache.get("k49") is not None and cache.get("k0") is None
    cache.put("huge", "x" * 1000)  # larger than the bound: not kept
    assert cache.get("huge") is None and cache.bytes_used <= 100


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from dsinfer.structured.manager import StructuredOutputManager
    from dsinfer.tokenizer import Tokenizer
    from tests.protocol.tiny_tokenizer import write_tiny_tokenizer

    tok = Tokenizer.from_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    eos = tok.token_to_id("<|im_end|>")
    return tok, StructuredOutputManager(tok, tok.vocab_size, [eos], cache_bytes=256 << 10, compile_threads=2)


def test_ten_thousand_schemas_stay_within_the_cache_bound(manager):
    _, mgr = manager
    peak = 0
    futures = []
    for i in range(10_000):
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer", "maximum": i}},
                  "required": [f"field_{i}"]}
        futures.append(mgr.prepare({"json": schema})[1])
        if len(futures) >= 64:
            for f in futures:
                f.result()
            futures.clear()
            peak = max(peak, mgr.cache.bytes_used)
    for f in futures:
        f.result()
    peak = max(peak, mgr.cache.bytes_used)
    assert peak <= mgr.cache.limit_bytes
    assert mgr.cache.evictions > 0 and len(mgr.cache) > 0


def test_matcher_sync_rolls_back_and_checks_drafts(manager):
    tok, mgr = manager
    spec, future = mgr.prepare({"regex": "ab(c|d)e"})
    future.result()
    grammar = mgr.request_grammar(object(), spec, future)
    ids = tok.encode("abce", add_special_tokens=False)
    grammar.sync(ids[:2])
    assert grammar.accepted == ids[:2]
    grammar.sync(ids[:1])  # withdrawn tokens (rejected drafts) roll the matcher back
    assert grammar.accepted == ids[:1]
    assert grammar.check_drafts(ids[1:]) == len(ids) - 1
    wrong = tok.encode("abx", add_special_tokens=False)
    assert grammar.check_drafts(wrong[1:]) < len(wrong) - 1
    assert grammar.accepted == ids[:1]  # checking drafts leaves the matcher unchanged
    mask = torch.zeros(len(ids) + 1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    assert grammar.fill_draft_bitmasks(mask, 0, ids[1:]) == len(ids)
    allowed = unpack_bitmask(mask, tok.vocab_size)
    assert all(allowed[i, t] for i, t in enumerate(ids[1:]))
    grammar.sync(ids)  # complete: the mask allows only the stop tokens, and only a stop token terminates it
    grammar.fill_bitmask(mask, 0)
    assert set(unpack_bitmask(mask[:1], tok.vocab_size)[0].nonzero().flatten().tolist()) == mgr.stop_token_ids
    assert not grammar.is_terminated
    grammar.sync(ids + [min(mgr.stop_token_ids)])
    assert grammar.is_terminated


def test_bitmask_op_masks_exactly_the_cleared_bits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    out = ops.apply_token_bitmask(logits, bitmask)
    for r in range(3):
        for t in range(70):
            bit = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert (out[r, t] == logits[r, t]) if bit else out[r, t] == float("-inf")


def test_bitmask_triton_matches_torch(monkeypatch, kernel_options):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel_options(use_triton="always")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 2100, generator=gen).to(device)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 66), generator=gen, dtype=torch.int64).to(torch.int32)
    out = ops.apply_token_bitmask(logits, bitmask.to(device))
    assert torch.equal(out.cpu(), apply_token_bitmask_ref(logits.cpu(), bitmask))


def test_the_engine_refuses_schema_patterns_it_cannot_enforce():
    """Offline too (no server's check before it): a lookahead or an untyped pattern is a ValueError, not ignored."""
    pytest.importorskip("xgrammar")
    from dsinfer.structured import backend

    lookahead = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string",
                                                                                   "pattern": "(?=x)y"}}}}
    with pytest.raises(ValueError, match=r"schema.properties.a.items.pattern '\(\?=x\)y' cannot be enforced"):
        backend.build_grammar(parse_structured_outputs({"json": lookahead}))
    with pytest.raises(ValueError, match=r"schema.anyOf\[1\].pattern needs \"type\": \"string\""):
        backend.build_grammar(parse_structured_outputs({"json": {"anyOf": [{"type": "null"}, {"pattern": "a"}]}}))
    data = {"type": "string", "pattern": "^a+$", "default": {"pattern": "("}, "enum": ["a", "aa"]}
    backend.build_grammar(parse_structured_outputs({"json": data}))  # data keywords are not schemas


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS is read from /proc")
def test_a_thousand_distinct_schemas_past_the_bound_leave_rss_flat():
    """Issue 45 (CVE-2025-32381's kind: memory that grows with distinct grammars): with the bundled model's 49k
    vocabulary a compiled schema is ~1 MB, so 1,000 kept would be ~1 GB; past the cache's 4 MB bound the
    process's RSS stays within 10% of what it was after warm-up."""
    pytest.importorskip("xgrammar")
    from dsinfer.models.loader.gguf import cached_gguf_dir, default_model_path
    from dsinfer.structured.manager import StructuredOutputManager
    from dsinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(cached_gguf_dir(default_model_path()))
    mgr = StructuredOutputManager(tok, tok.vocab_size, [tok.token_to_id("<|im_end|>")], cache_bytes=4 << 20,
                                  compile_threads=2)

    def compile_schemas(first: int, count: int) -> None:
        for i in range(first, first + count):
            schema = {"type": "object", "properties": {f"f{i}": {"type": "integer", "maximum": i}},
                      "required": [f"f{i}"]}
            mgr.prepare({"json": schema})[1].result()

    compile_schemas(0, 200)  # warm-up: well past the bound, the allocator at its working size
    warm = _rss_mib()
    compile_schemas(200, 1000)
    after = _rss_mib()
    assert mgr.cache.evictions >= 1000 and mgr.cache.bytes_used <= mgr.cache.limit_bytes
    assert after <= 1.10 * warm, f"RSS grew from {warm:.0f} MiB to {after:.0f} MiB over 1,000 distinct schemas"
