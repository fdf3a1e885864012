"""One way to open a Redis (or Valkey, or Cluster) client from a URL, shared by the KV-block
index and the shared in-flight counts, so both fail and reconnect alike."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def redis_from_url(
    url: str, *, cluster: bool, connect_timeout_s: float, timeout_s: float | None
) -> Redis | RedisCluster:
    """A client for `url` (`redis://`, `rediss://`, credentials in the URL). One immediate
    retry heals a connection Redis closed (a restart); longer outages are the caller's
    business (its budget, backoff or circuit breaker), not the client's."""
    common: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 1),
    }
    if cluster:
        return RedisCluster.from_url(url, **common)
    return Redis.from_url(url, health_check_interval=0, **common)
