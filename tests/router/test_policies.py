"""The router's policies, breaker and prefill buckets on fake replicas (no process, no network)."""

from __future__ import annotations

import random

from dsinfer.kvcache.block_pool import NONE_HASH, hash_block
from dsinfer.kvcache.hashing import block_hash_chain
from dsinfer.router.policy import LoadAware, PowerOfTwo, PrefillBuckets, PrefixAware, RequestInfo, RoundRobin
from dsinfer.router.replica import Breaker, Replica
from dsinfer.router.settings import RouterSettings


def _replica(url: str, running: int = 0, kv: int = 0, seqs: int = 16, capacity: int = 10_000,
             store: str | None = None) -> Replica:
    r = Replica(url, state="healthy")
    r.observe({"num_running": running, "num_kv_tokens": kv, "max_num_seqs": seqs, "kv_capacity_tokens": capacity,
               "block_size": 16, "kv_store_dir": store})
    return r


def _info(ids: list[int]) -> RequestInfo:
    return RequestInfo(len(ids), {16: block_hash_chain(ids, 16)})


def test_block_hash_chain_is_the_engines_chain():
    ids = list(range(40))
    first = hash_block(NONE_HASH, ids[:16])
    assert block_hash_chain(ids, 16) == [first, hash_block(first, ids[16:32])]  # the partial last block: none


def test_round_robin_takes_each_in_turn():
    rs = [_replica("http://a"), _replica("http://b"), _replica("http://c")]
    policy = RoundRobin()
    assert [policy.choose(rs, RequestInfo(10))[0].url for _ in range(4)] == ["http://a", "http://b", "http://c",
                                                                             "http://a"]


def test_load_aware_balances_requests_and_kv_on_two_axes():
    # few requests but much KV, against many requests with little KV (DeepInfer's decode balancing)
    few_long = _replica("http://few-long", running=2, kv=5_000)
    many_short = _replica("http://many-short", running=10, kv=1_000)
    policy = LoadAware()
    short, reason = policy.choose([few_long, many_short], RequestInfo(100))
    assert (short.url, reason) == ("http://few-long", "load")  # max(3/16, 5100/10k) < max(11/16, 1100/10k)
    long_one, _ = policy.choose([few_long, many_short], RequestInfo(2_500))
    assert long_one.url == "http://many-short"  # max(3/16, 7500/10k) > max(11/16, 3500/10k)


def test_load_aware_counts_the_routers_own_requests_between_polls():
    a, b = _replica("http://a"), _replica("http://b")
    policy = LoadAware()
    picks = []
    for _ in range(6):
        r, _ = policy.choose([a, b], RequestInfo(50))
        r.begin(50)
        picks.append(r.url)
    assert picks.count("http://a") == picks.count("http://b") == 3
    assert a.num_requests == 3 and a.num_kv_tokens == 150
    a.observe({"num_running": 0, "num_kv_tokens": 0, "max_num_seqs": 16, "kv_capacity_tokens": 10_000})
    assert a.num_requests == 3  # the router's in-flight count stays the floor until they end
    for _ in range(3):
        a.end()
    assert a.num_requests == 0


def test_load_aware_ties_rotate_so_misses_spread():
    rs = [_replica(f"http://{n}") for n in "abcd"]
    policy = LoadAware()
    assert {policy.choose(rs, RequestInfo(10))[0].url for _ in range(4)} == {r.url for r in rs}


def test_power_of_two_takes_the_less_loaded_of_its_pair():
    idle, busy = _replica("http://idle"), _replica("http://busy", running=12)
    policy = PowerOfTwo(random.Random(0))
    assert all(policy.choose([idle, busy], RequestInfo(10)) == (idle, "power_of_two") for _ in range(5))


def test_prefix_aware_prefers_the_replica_holding_the_prefix():
    settings = RouterSettings(min_prefix_tokens=32)
    holder, other = _replica("http://holder", running=2), _replica("http://other")
    prompt = list(range(100))
    holder.remember(_info(prompt).hashes(16))
    policy = PrefixAware(settings)
    picked, reason = policy.choose([holder, other], _info(prompt[:80] + [7] * 30))
    assert (picked.url, reason) == ("http://holder", "prefix_hit")  # 80 tokens = 5 blocks in common
    picked, reason = policy.choose([holder, other], _info([9] * 100))
    assert (picked.url, reason) == ("http://other", "prefix_miss")  # a miss goes by load


def test_prefix_aware_does_not_pile_onto_an_overloaded_holder():
    settings = RouterSettings(min_prefix_tokens=32, balance_abs=4, balance_rel=1.5)
    holder, other = _replica("http://holder", running=9), _replica("http://other", running=2)
    prompt = list(range(100))
    holder.remember(_info(prompt).hashes(16))
    picked, reason = PrefixAware(settings).choose([holder, other], _info(prompt))
    assert (picked.url, reason) == ("http://other", "prefix_overloaded")


def test_prefix_aware_routes_on_load_alone_over_one_shared_store():
    holder = _replica("http://holder", running=3, store="/mnt/kv")
    other = _replica("http://other", store="/mnt/kv")
    prompt = list(range(100))
    holder.remember(_info(prompt).hashes(16))
    picked, reason = PrefixAware(RouterSettings()).choose([holder, other], _info(prompt))
    assert (picked.url, reason) == ("http://other", "shared_store")


def test_replica_forgets_the_oldest_prefixes_beyond_its_kv_capacity():
    r = _replica("http://a", capacity=64)  # 4 blocks of 16
    first, second = _info(list(range(64))), _info(list(range(1000, 1064)))
    r.remember(first.hashes(16))
    r.remember(second.hashes(16))
    assert r.cached_blocks(second.hashes(16)) == 4 and r.cached_blocks(first.hashes(16)) == 0


def test_breaker_opens_then_lets_one_trial_through():
    b = Breaker(failures_to_open=2, cooldown_s=5.0)
    assert not b.on_failure(0.0) and b.allows(0.0)
    assert b.on_failure(0.0) and not b.allows(1.0)
    assert b.allows(5.0)
    b.on_begin(5.0)
    assert not b.allows(5.1)  # one trial at a time
    b.on_failure(5.2)
    assert not b.allows(9.0) and b.allows(10.2)
    b.on_begin(10.2)
    b.on_success()
    assert b.allows(10.3) and not b.is_open


def test_prefill_buckets_follow_demand():
    buckets = PrefillBuckets(bounds=(1000, 4000, 16000), rebalance_s=100.0)
    assert [buckets.bucket(n) for n in (1, 999, 1000, 3999, 4000, 20000)] == [0, 0, 1, 1, 2, 3]
    rs = [_replica(f"http://p{i}") for i in range(4)]
    for _ in range(3):
        buckets.demand[0] += 3000
    buckets.demand[1] += 3000
    buckets.rebalance([r.url for r in rs], now=0.0)
    assert sorted(buckets.assignment.values()) == [0, 0, 0, 1]  # demand 3:1
    long_home = next(url for url, b in buckets.assignment.items() if b == 1)
    assert buckets.choose(rs, RequestInfo(2000), now=1.0) == (next(r for r in rs if r.url == long_home),
                                                              "prefill_bucket_1")
    picked, reason = buckets.choose(rs, RequestInfo(50_000), now=1.0)
    assert reason == "prefill_spill"  # no replica for the longest bucket yet: the least loaded of all
    short = [buckets.choose(rs, RequestInfo(100), now=1.0)[0].url for _ in range(3)]
    assert set(short) <= {url for url, b in buckets.assignment.items() if b == 0}


def test_prefill_buckets_give_every_bucket_with_demand_a_replica_first():
    buckets = PrefillBuckets(bounds=(1000,), rebalance_s=100.0)
    buckets.demand = [100_000.0, 10.0]
    assert buckets.counts(2) == [1, 1] and buckets.counts(3) == [2, 1] and buckets.counts(1) == [1, 0]


def test_the_router_imports_neither_torch_nor_the_engine():
    import subprocess
    import sys

    code = ("import sys, dsinfer.router.app, dsinfer.router.cli, dsinfer.router.prompt; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('dsinfer.engine.llm_engine', "
            "'dsinfer.entrypoints.async_engine', 'dsinfer.runner'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
