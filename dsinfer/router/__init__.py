"""``dsinfer router``: one HTTP front over N ``dsinfer serve`` replicas (data parallelism), and prefill/decode
disaggregation through the shared KV store. A separate process that speaks HTTP (httpx) to the replicas; it never
imports the engine or torch: it computes prompts' block hashes with the tokenizer, the chat template and
``kvcache.hashing``, as the engine does.

- ``settings``: the router's frozen settings (built from the command line);
- ``replica``: one replica's state (health, circuit breaker, load from ``/load`` plus the router's own counts,
  the prefix blocks the router sent it);
- ``policy``: choosing a replica: round-robin, power of two choices, load-aware (requests x KV tokens, as
  DeepInfer balances decode), prefix-aware (longest cached prefix under a load threshold), prefill length buckets;
- ``prompt``: a request body's prompt token ids and block hashes;
- ``pool``: the replicas, their health checks (ejection, re-admission) and the admin changes;
- ``proxy``: forwarding with retries before the first byte and a clean in-band error after it;
- ``disagg``: prefill then decode through the shared store;
- ``metrics``: the router's Prometheus metrics;
- ``app`` / ``cli`` / ``launch``: the FastAPI front, the command, replicas started by the router.
"""
