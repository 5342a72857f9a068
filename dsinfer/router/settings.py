"""The router's settings: one frozen dataclass built from the command line (``cli.settings_from_args``)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("round_robin", "power_of_two", "load_aware", "prefix_aware")
ROLES = ("mixed", "prefill", "decode")
# DeepInfer's prefill length buckets (prompt tokens): <16k, 16-64k, 64-256k, >=256k
PREFILL_BUCKETS = (16_384, 65_536, 262_144)


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "prefix_aware"  # how a mixed or decode replica is chosen: one of POLICIES
    # health checks: GET /load every health_interval_s; a replica is ejected after eject_after failures in a row
    # (at once on a refused connection or a /load saying draining or dead) and re-admitted after readmit_after
    # successes in a row
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    eject_after: int = 2
    readmit_after: int = 2
    # circuit breaker: breaker_failures failed requests in a row (5xx, timeouts, broken connections) open it for
    # breaker_cooldown_s; then one trial request (half open) closes it again or reopens it
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    # retries before the first byte reaches the client: connection errors and 503s, on another replica when one
    # is left, after a backoff of retry_backoff_s x 2^attempt (with jitter), at most max_retries times
    max_retries: int = 3
    retry_backoff_s: float = 0.05
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # the most a replica may stay silent (before its answer, or between events)
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight requests may finish
    # prefix-aware: the replica with the longest cached prefix wins unless its load is over the least loaded
    # replica's by balance_abs (in requests) and balance_rel times; a hit shorter than min_prefix_tokens is a miss
    balance_abs: float = 4.0
    balance_rel: float = 1.5
    min_prefix_tokens: int = 64
    prefix_lru_blocks: int = 1 << 20  # blocks remembered per replica when it does not say its KV capacity
    # the tokenizer and chat template the replicas serve (for prompt lengths and block hashes)
    model: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    chat_format: str = "auto"
    admin_key: str | None = None  # bearer key of /admin/*; None: the admin routes answer on loopback only
    bucket_rebalance_s: float = 10.0  # how often prefill replicas are re-allocated to length buckets

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s", "read_timeout_s",
                     "breaker_cooldown_s", "bucket_rebalance_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("eject_after", "readmit_after", "breaker_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0 or self.retry_backoff_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("max_retries, retry_backoff_s and drain_timeout_s must be >= 0")
        if self.balance_rel < 1 or self.balance_abs < 0:
            raise ValueError(f"balance_rel must be >= 1 and balance_abs >= 0, got {self.balance_rel}, "
                             f"{self.balance_abs}")
