"""The Redis engine's key-values: ``kv:<key>`` with a TTL; a bounded collection's index and sizes beside them."""

from __future__ import annotations

from nodeagent.broker.redis.connection import PREFIX, RedisConnection, _retried


class RedisKeyValues(RedisConnection):
    """The ``KeyValues`` store on Redis."""

    # -- small values with an expiry: kv:<key> ------------------------------------------------------------------
    @_retried
    def kv_put(self, key: str, value: str, ttl_s: float, bound: tuple[int, int] | None = None) -> None:
        """(Retried: a second write of the same value repeats harmlessly.) A bounded collection keeps an index of
        its keys by expiry and their sizes (``kvindex:<collection>``, ``kvsize:<collection>``), trimmed as it is
        written (``lua/kv_keep.lua``)."""
        ttl = max(1, int(ttl_s))
        if bound is None:
            self.r.set(f"{PREFIX}kv:{key}", value, ex=ttl)
            return
        collection = key.split(":", 1)[0]
        self._scripts["kv_keep"](keys=[f"{PREFIX}kv:{key}", f"{PREFIX}kvindex:{collection}",
                                       f"{PREFIX}kvsize:{collection}", f"{PREFIX}kvbytes:{collection}"],
                                 args=[value, ttl, bound[0], bound[1], key, f"{PREFIX}kv:"])

    @_retried
    def kv_get(self, key: str) -> str | None:
        return self.r.get(f"{PREFIX}kv:{key}")

    @_retried
    def kv_delete(self, key: str) -> None:
        """(A value of a bounded collection leaves its index and its bytes with it: ``lua/kv_drop.lua``.)"""
        collection = key.split(":", 1)[0]
        self._scripts["kv_drop"](keys=[f"{PREFIX}kv:{key}", f"{PREFIX}kvindex:{collection}",
                                       f"{PREFIX}kvsize:{collection}", f"{PREFIX}kvbytes:{collection}"], args=[key])

    def purge_kv(self, older_than_s: float) -> None:
        """Nothing: a value expires on its own (written with its TTL)."""
