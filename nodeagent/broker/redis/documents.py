"""The Redis engine's documents: a hash per document (``doc:<kind>:<id>``: data, version, body), listed newest
first by the sorted set ``docs:<kind>``; ``doc_expire`` sets its expiry."""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from nodeagent.broker.redis.connection import PREFIX, RedisConnection, _retried


class RedisDocuments(RedisConnection):
    """The ``Documents`` store on Redis."""

    # -- documents (the Batch API's files and batches): doc:<kind>:<id> (data, version, body), listed newest
    # first by the sorted set docs:<kind> --------------------------------------------------------------------
    def doc_put(self, kind: str, doc_id: str, data: dict[str, Any], body: str | bytes | BinaryIO | None = None,
                version: int | None = None) -> bool:
        if body is not None and not isinstance(body, (str, bytes)):  # a file: read once (a hash holds it whole)
            body.seek(0)
            body = body.read()
        key = f"{PREFIX}doc:{kind}:{doc_id}"
        text = json.dumps(data)

        def once(retried: bool) -> bool:
            written = self.link.confirmed(self._scripts["doc_put"], [key, f"{PREFIX}docs:{kind}", f"{PREFIX}docseq"],
                                          [doc_id, text, "" if version is None else version, body or "",
                                           "1" if body is not None and version is None else ""])
            if written or not retried:
                return bool(written)
            # a retry that finds its own first try's write there
            now = self.r.hmget(key, ["data", "version"])
            return now[0] == text and now[1] == str((version or 0) + 1)

        return self.link.call("doc_put", once)

    @_retried
    def doc_get(self, kind: str, doc_id: str) -> tuple[dict[str, Any], int] | None:
        data, version = self.r.hmget(f"{PREFIX}doc:{kind}:{doc_id}", ["data", "version"])
        return None if data is None else (json.loads(data), int(version))

    @_retried
    def doc_body(self, kind: str, doc_id: str) -> str | None:
        return self.r.hget(f"{PREFIX}doc:{kind}:{doc_id}", "body")

    @_retried
    def doc_list(self, kind: str, after: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        index = f"{PREFIX}docs:{kind}"
        top = "+inf"
        if after:
            score = self.r.zscore(index, after)
            if score is None:
                return []
            top = f"({score}"
        ids = self.r.zrevrangebyscore(index, top, "-inf", start=0, num=limit)
        texts = [self.r.hget(f"{PREFIX}doc:{kind}:{i}", "data") for i in ids]
        gone = [i for i, t in zip(ids, texts) if t is None]
        if gone:  # expired: the index forgets them as it meets them
            self.r.zrem(index, *gone)
        return [json.loads(t) for t in texts if t is not None]

    @_retried
    def doc_expire(self, kind: str, doc_id: str, at: float) -> None:
        self.r.expireat(f"{PREFIX}doc:{kind}:{doc_id}", max(1, int(at)))
        self._trim_index(kind)

    def _trim_index(self, kind: str, most: int = 10) -> None:
        """The oldest entries of a kind's index whose documents expired, dropped (a few at each expiry set: the
        index stays as long as what is kept)."""
        index = f"{PREFIX}docs:{kind}"
        for i in self.r.zrange(index, 0, most - 1):
            if self.r.exists(f"{PREFIX}doc:{kind}:{i}"):
                break
            self.r.zrem(index, i)

    def doc_delete(self, kind: str, doc_id: str) -> bool:
        def once(retried: bool) -> bool:
            pipe = self.r.pipeline()
            pipe.delete(f"{PREFIX}doc:{kind}:{doc_id}")
            pipe.zrem(f"{PREFIX}docs:{kind}", doc_id)
            got = pipe.execute()
            self.link.settle()  # on the replicas asked for (a fence, then WAIT)
            return bool(got[0]) or retried  # a retry: its first try removed it

        return self.link.call("doc_delete", once)

    def purge_documents(self, older_than_s: float) -> None:
        """Nothing: a document expires on its own (``doc_expire``), and its kind's index forgets it as it meets it."""
