"""The replicas: health checks (ejection and re-admission), failures reported by requests, and run-time changes.

Health: ``GET /load`` every ``health_interval_s`` on every replica (ejected ones included, so that they come
back). ``eject_after`` failures in a row (no answer within ``health_timeout_s``, a non-200) eject a replica; a
refused connection or a ``status`` of draining / dead ejects it at once; ``readmit_after`` good answers in a row
bring it back (its remembered prefixes forgotten: it may have restarted). A request that cannot connect ejects its
replica at once too; other request failures (5xx, timeouts, a broken answer) go to the circuit breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from dsinfer.router.metrics import RouterMetrics
from dsinfer.router.replica import Breaker, Replica
from dsinfer.router.settings import ROLES, RouterSettings

logger = logging.getLogger("dsinfer.router")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
    return url


class ReplicaPool:
    def __init__(self, settings: RouterSettings, client: httpx.AsyncClient):
        self.settings = settings
        self.client = client
        self.replicas: dict[str, Replica] = {}
        self.metrics = RouterMetrics(lambda: list(self.replicas.values()))
        self._task: asyncio.Task | None = None

    # ----------------------------------------------------------------- membership
    def add(self, url: str, role: str = "mixed") -> Replica:
        """A new replica (ejected until its first health check passes); ValueError for a bad URL, role or a URL
        already in the pool."""
        url = normalize_url(url)
        if role not in ROLES:
            raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")
        if url in self.replicas:
            raise ValueError(f"replica {url} is already in the pool (as {self.replicas[url].role})")
        s = self.settings
        replica = Replica(url, role, Breaker(s.breaker_failures, s.breaker_cooldown_s), s.prefix_lru_blocks)
        self.replicas[url] = replica
        return replica

    def remove(self, url: str) -> Replica:
        """Out of the pool: no new request goes to it; the ones it serves finish. KeyError for an unknown URL."""
        replica = self.replicas.pop(normalize_url(url))
        replica.state = "removed"
        return replica

    def available(self, roles: tuple[str, ...]) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas.values() if r.role in roles and r.available(now)]

    def block_sizes(self) -> set[int]:
        return {r.block_size for r in self.replicas.values() if r.block_size}

    # ----------------------------------------------------------------- health
    def start(self) -> None:
        self._task = asyncio.ensure_future(self._health_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in list(self.replicas.values())))

    async def _health_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.settings.health_interval_s)

    async def check(self, replica: Replica) -> None:
        try:
            r = await self.client.get(f"{replica.url}/load", timeout=self.settings.health_timeout_s)
        except httpx.ConnectError:
            return self._health_failed(replica, "connect", at_once=True)
        except httpx.HTTPError:
            return self._health_failed(replica, "health_timeout")
        if r.status_code != 200:
            return self._health_failed(replica, f"health_{r.status_code}")
        load = r.json()
        if load.get("status") != "ok":
            return self._health_failed(replica, str(load.get("status")), at_once=True)
        replica.observe(load)
        replica.fail_streak, replica.ok_streak = 0, replica.ok_streak + 1
        if replica.state == "ejected" and (replica.ok_streak >= self.settings.readmit_after
                                           or replica.num_routed == 0):
            logger.info("replica %s (%s) admitted", replica.url, replica.role)
            replica.forget_prefixes()
            replica.state = "healthy"

    def _health_failed(self, replica: Replica, cause: str, at_once: bool = False) -> None:
        replica.ok_streak, replica.fail_streak = 0, replica.fail_streak + 1
        if at_once or replica.fail_streak >= self.settings.eject_after:
            self.eject(replica, cause)

    def eject(self, replica: Replica, cause: str) -> None:
        if replica.state != "healthy":
            return
        logger.warning("replica %s ejected (%s)", replica.url, cause)
        replica.state = "ejected"
        replica.ok_streak = 0
        self.metrics.ejections.labels(replica.url, cause).inc()

    # ----------------------------------------------------------------- request outcomes
    def request_failed(self, replica: Replica, cause: str) -> None:
        """A request to ``replica`` failed: a refused connection ejects it, anything else counts on its breaker."""
        if cause == "connect":
            self.eject(replica, "connect")
        if replica.breaker.on_failure(time.monotonic()):
            logger.warning("replica %s: circuit breaker open for %.1fs (%s)", replica.url,
                           self.settings.breaker_cooldown_s, cause)
            self.metrics.breaker_opens.labels(replica.url).inc()

    @staticmethod
    def request_succeeded(replica: Replica) -> None:
        replica.breaker.on_success()
