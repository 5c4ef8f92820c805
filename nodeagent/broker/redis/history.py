"""The Redis engine's history: a hash per minute (``hist:<minute>``), numbers by field, kept ``keep_s`` (a TTL)."""

from __future__ import annotations

from nodeagent.broker.redis.connection import PREFIX, RedisConnection, _retried


class RedisHistory(RedisConnection):
    """The ``HistoryStore`` store on Redis."""

    def history_add(self, minute: int, counts: dict[str, float], keep_s: float) -> None:
        key = f"{PREFIX}hist:{minute}"
        pipe = self.r.pipeline()
        for field, n in counts.items():
            pipe.hincrbyfloat(key, field, n)
        pipe.expire(key, int(keep_s) + 120)
        pipe.execute()

    @_retried
    def history_set(self, minute: int, values: dict[str, float], keep_s: float) -> None:
        if not values:
            return
        key = f"{PREFIX}hist:{minute}"
        pipe = self.r.pipeline()
        pipe.hset(key, mapping=values)
        pipe.expire(key, int(keep_s) + 120)
        pipe.execute()

    @_retried
    def history(self, first_minute: int, kinds: tuple[str, ...] | None = None) -> dict[int, dict[str, float]]:
        last = int(self.now() // 60)
        minutes = list(range(first_minute, last + 1))
        pipe = self.r.pipeline(transaction=False)
        for m in minutes:
            pipe.hgetall(f"{PREFIX}hist:{m}")
        out = {}
        for m, row in zip(minutes, pipe.execute()):
            kept = {k: float(v) for k, v in row.items() if not kinds or k[:1] in kinds}
            if kept:
                out[m] = kept
        return out

    def purge_history(self, older_than_s: float) -> None:
        """Nothing: a minute expires on its own (written with its TTL)."""
