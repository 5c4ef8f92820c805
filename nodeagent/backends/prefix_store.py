"""Warm prefixes on disk: a prompt prefix's KV state, kept once computed and read back into any slot after a
restart, a swap or an eviction, instead of being read again from its tokens.

A prefix is stored when it recurs (a slot keeps it from its last task, or borrows it from another slot, for the
second time: the instructions and schema of an extraction, the labels and examples of a classification, a chat's
system prompt; not each turn of one conversation, whose prefix grows every turn).
Its state is what llama.cpp writes for one sequence (``llama_state_seq_get_data``): the cells' positions and each
layer's K and V rows. It is valid only for the same model file, backend build and KV types, so those make the
``StateKey``, and each key has a directory of its own: a state written under another key is never found, and
one copied in under a wrong key is refused by its header.

A file per prefix: a header line of JSON (the format, the key, the tokens, the state's size and sha256), then the
state. It is written to a temporary name, flushed to disk and renamed into place, so a reader in another process
sharing the directory never sees half a file; a file whose header or sha256 does not check out (cut short,
corrupted) is refused and removed, and the prefix is read from its tokens (and stored again when it recurs).
The directory is bounded in bytes: past the bound, the least recently used files go (a read counts as a use).
Writing happens on a thread of its own, so the task whose prefix is kept does not wait for the disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.backends.session import common_prefix
from nodeagent.store.files import sha256_file

log = logging.getLogger(__name__)

FORMAT = "nodeagent-prefix/1"
SUFFIX = ".kv"
MIN_STORED_TOKENS = 64  # a shorter prefix is read again faster than its file is found, read and checked
# a prefix is stored once it has been kept for this many tasks after the one that read it (counted by its length
# rounded down to BUCKET_TOKENS, so a few input tokens that two tasks happen to share do not make it another):
# the instructions of a stream of tasks recur at the same length; a conversation's turns each extend the last and
# are never written turn after turn
STORE_AFTER_REUSES = 2
MAX_PENDING_BYTES = 256 * 1024 * 1024  # states copied out and waiting for the disk, at most
BUCKET_TOKENS = 32
RESTORE_MARGIN_TOKENS = 16  # a stored prefix is read back only where it holds this many more tokens than the slot
MIN_RATE_TOKENS = 16  # a prompt read from fewer tokens than this says little of the model's prefill rate
RATE_WEIGHT = 0.2  # the weight of the latest prompt read in the prefill rate (a moving average)
TOP_SHOWN = 5  # the prefixes a node's usage lists, the most restored first


@dataclass(frozen=True)
class StateKey:
    """What a stored state is valid for: the model file (its sha256), the backend and its build, the KV types."""

    model_sha256: str
    backend: str
    kv_types: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.model_sha256}\n{self.backend}\n{self.kv_types}".encode()).hexdigest()[:24]

    def as_dict(self) -> dict[str, str]:
        return {"model_sha256": self.model_sha256, "backend": self.backend, "kv_types": self.kv_types}


class PrefixTally:
    """What a model's prefixes did, across its loads (a Node holds one and gives it to each store it opens): their
    restores and the time they took, writes, refusals, and the model's prefill rate here (a moving average of the
    prompts its slots read from their tokens), which prices the restores: the prefill seconds they saved."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.restored = self.restored_tokens = self.written = self.refused = 0
        self.restore_s = 0.0
        self.prefill_s_per_token: float | None = None
        self.uses: dict[str, int] = {}  # a stored prefix's file name -> its restores

    def prefilled(self, n_tokens: int, seconds: float) -> None:
        """A prompt of ``n_tokens`` read from its tokens in ``seconds`` (a slot's, beside whatever else the batch
        held: what a restore in its place saves)."""
        if n_tokens < MIN_RATE_TOKENS or seconds <= 0:
            return
        rate = seconds / n_tokens
        with self._lock:
            old = self.prefill_s_per_token
            self.prefill_s_per_token = rate if old is None else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * rate

    def restore(self, name: str, n_tokens: int, seconds: float) -> None:
        with self._lock:
            self.restored += 1
            self.restored_tokens += n_tokens
            self.restore_s += seconds
            self.uses[name] = self.uses.get(name, 0) + 1

    def restores(self) -> dict[str, int]:
        with self._lock:
            return dict(self.uses)

    def count(self, what: str) -> None:
        """One more ``written`` or ``refused``."""
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def as_dict(self) -> dict[str, Any]:
        """The counts, the prefill rate (tokens/s; None until a prompt was read here) and the seconds saved: the
        tokens restored at that rate, less the time the restores took (None until the rate is known)."""
        with self._lock:
            rate = self.prefill_s_per_token
            return {"restored": self.restored, "restored_tokens": self.restored_tokens,
                    "restore_s": round(self.restore_s, 3), "written": self.written, "refused": self.refused,
                    "prefill_tokens_per_s": None if rate is None else round(1 / rate, 1),
                    "saved_s": None if rate is None else round(self.restored_tokens * rate - self.restore_s, 2)}


@dataclass(frozen=True)
class Stored:
    """One prefix on disk: its file, its tokens, the state's bytes."""

    path: Path
    tokens: tuple[int, ...]
    state_bytes: int


class Opener:
    """A model's PrefixStore, opened on a thread of its own (its key needs the model's sha256, which a large file
    takes a while to give the first time) and kept only while the model is open: a store opened after the model
    closed is closed at once. Until it is open, nothing is stored or read."""

    def __init__(self) -> None:
        self.store: PrefixStore | None = None
        self._lock = threading.Lock()
        self._closed = False

    def open(self, directory: Path, max_bytes: int, key: Any, tally: "PrefixTally | None") -> None:
        """``key``: a callable giving the StateKey (run on the thread)."""
        def run() -> None:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                store: PrefixStore | None = PrefixStore(directory, key(), max_bytes, tally)
            except OSError as exc:
                log.warning("prompt prefixes are not kept on disk: %s", exc)
                return
            with self._lock:
                if not self._closed:
                    self.store, store = store, None
            if store is not None:  # the model was closed meanwhile
                store.close()

        threading.Thread(target=run, name="prefix-store", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self.store = self.store, None
        if store is not None:
            store.close()  # (what was handed to its writer is written first)


def files_sha256(paths: list[Path], directory: Path) -> str:
    """One sha256 for a model of several files (an mlx-lm directory's weights and config): of each file's
    (``model_sha256``, remembered in ``directory``) by its name."""
    parts = "\n".join(f"{p.name}:{model_sha256(p, directory)}" for p in sorted(paths, key=lambda p: p.name))
    return hashlib.sha256(parts.encode()).hexdigest()


def model_sha256(path: Path, directory: Path) -> str:
    """The model file's sha256 (what a stored state is keyed by), remembered in ``directory``'s models.json (the
    cache directory) by the file's path, size and modification time: a large model is read for it once, not at
    every load."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    known_file = directory / "models.json"
    try:
        known = json.loads(known_file.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(ident), str):
        return known[ident]
    digest = sha256_file(path)
    try:
        known = {k: v for k, v in known.items() if not k.startswith(f"{path.resolve()}|")}
        tmp = directory / f".models.json.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps({**known, ident: digest}, indent=1))
        os.replace(tmp, known_file)
    except OSError as exc:
        log.warning("the sha256 of %s could not be remembered: %s", path.name, exc)
    return digest


class PrefixStore:
    """The prefixes of one StateKey in ``directory`` (shared with every other key's, and with other processes),
    the directory held under ``max_bytes`` in all."""

    def __init__(self, directory: Path, key: StateKey, max_bytes: int, tally: PrefixTally | None = None) -> None:
        self.root, self.key, self.max_bytes = Path(directory), key, int(max_bytes)
        self.tally = tally or PrefixTally()
        self.dir = self.root / key.digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self._known: dict[str, Stored] = {}  # file name -> what its header said
        self._lock = threading.Lock()
        self._pending: set[tuple[int, ...]] = set()  # handed to the writer, not yet on disk
        self._pending_bytes = 0
        self._seen: dict[int, int] = {}  # a kept prefix's mark -> the tasks that kept it (oldest first)
        self._writes: queue.Queue[tuple[tuple[int, ...], Any] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-writer", daemon=True)
        self._writer.start()

    # -- finding and reading -------------------------------------------------------------------------------
    def best(self, tokens: list[int]) -> tuple[Stored, int] | None:
        """The stored prefix sharing the most leading tokens with ``tokens`` (at least MIN_STORED_TOKENS), and how
        many it shares; None when none does."""
        found, n = None, MIN_STORED_TOKENS - 1
        for stored in self._scan():
            if stored.tokens[:1] == tuple(tokens[:1]) and (k := common_prefix(stored.tokens, tokens)) > n:
                found, n = stored, k
        return (found, n) if found is not None else None

    def worth(self, tokens: list[int], held: int) -> tuple[Stored, int] | None:
        """The stored prefix to read back in place of reading ``tokens`` (``best``), where it shares more of them
        than the ``held`` a slot holds already, by RESTORE_MARGIN_TOKENS; else None."""
        found = self.best(tokens)
        return found if found is not None and found[1] > held + RESTORE_MARGIN_TOKENS else None

    def storing(self, prefix: list[int]) -> bool:
        """Whether a slot that kept ``prefix`` from its last task should store it (``wants``, for a prefix long
        enough to be worth a file)."""
        return len(prefix) >= MIN_STORED_TOKENS and self.wants(prefix)

    def wants(self, tokens: list[int]) -> bool:
        """Count a task that kept ``tokens`` (the prefix it shared with the task before); whether to store them:
        that prefix has recurred often enough (STORE_AFTER_REUSES, counted by its length rounded down to
        BUCKET_TOKENS) and no stored prefix holds it already (to that length)."""
        bucket = len(tokens) // BUCKET_TOKENS * BUCKET_TOKENS
        if bucket < MIN_STORED_TOKENS:
            return False
        mark = hash(tuple(tokens[:bucket]))
        with self._lock:
            self._seen[mark] = self._seen.pop(mark, 0) + 1
            while len(self._seen) > 4096:
                self._seen.pop(next(iter(self._seen)))
            if self._seen[mark] < STORE_AFTER_REUSES:
                return False
        return not self.covers(tokens[:bucket])

    def covers(self, tokens: list[int]) -> bool:
        """Whether a stored prefix (or one on its way to the disk) already holds all of ``tokens``: storing them
        again would add nothing."""
        with self._lock:
            pending = list(self._pending)
        return any(len(held) >= len(tokens) and common_prefix(held, tokens) == len(tokens)
                   for held in [*pending, *(s.tokens for s in self._scan())])

    def read(self, stored: Stored) -> bytes | None:
        """The state of ``stored``, checked against its header; None (the file removed) when it does not check out
        or has gone meanwhile."""
        try:
            with open(stored.path, "rb") as fh:
                header = self._header(fh.readline())
                data = fh.read()
        except OSError:
            return None
        if (header is None or tuple(header["tokens"]) != stored.tokens or len(data) != header["state_bytes"]
                or hashlib.sha256(data).hexdigest() != header["state_sha256"]):
            self._refuse(stored.path, "its state does not match its header (cut short or corrupted)")
            return None
        now = time.time()
        try:
            os.utime(stored.path, (now, now))  # a use, for the least-recently-used bound
        except OSError:
            pass
        return data

    def _header(self, line: bytes) -> dict | None:
        try:
            header = json.loads(line)
        except ValueError:
            return None
        if (not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != self.key.as_dict()
                or not isinstance(header.get("tokens"), list) or not isinstance(header.get("state_bytes"), int)):
            return None
        return header

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("a stored prefix %s is refused: %s; it is read from its tokens instead", path.name, why)
        self.tally.count("refused")
        with self._lock:
            self._known.pop(path.name, None)
        try:
            path.unlink()
        except OSError:
            pass

    def _scan(self) -> list[Stored]:
        """The key's stored prefixes: headers read once per file, files gone (evicted by any process) dropped."""
        try:
            names = {e.name for e in os.scandir(self.dir) if e.name.endswith(SUFFIX)}
        except OSError:
            return []
        with self._lock:
            for gone in set(self._known) - names:
                del self._known[gone]
            new = names - set(self._known)
        for name in new:
            path = self.dir / name
            try:
                with open(path, "rb") as fh:
                    header = self._header(fh.readline())
            except OSError:
                continue
            if header is None:
                self._refuse(path, "its header is not one this key wrote (another model, build or KV types, or "
                                   "not a prefix file)")
                continue
            with self._lock:
                self._known[name] = Stored(path, tuple(header["tokens"]), header["state_bytes"])
        with self._lock:
            return list(self._known.values())

    # -- writing ---------------------------------------------------------------------------------------------
    def write_later(self, tokens: list[int], state: bytes) -> bool:
        """Store ``state`` (the state of a sequence holding exactly ``tokens``) on the writer thread; False (not
        stored) while the states waiting for a slow disk already hold MAX_PENDING_BYTES of memory."""
        with self._lock:
            if self._pending_bytes + len(state) > MAX_PENDING_BYTES:
                log.info("a prefix of %d tokens is not stored: the disk is still writing the ones before it",
                         len(tokens))
                return False
            self._pending.add(tuple(tokens))
            self._pending_bytes += len(state)
        self._writes.put((tuple(tokens), state))
        return True

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until what was handed to ``write_later`` is on disk."""
        done = threading.Event()
        self._writes.put(((), done))
        done.wait(timeout_s)

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(30)

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            tokens, state = item
            if isinstance(state, threading.Event):  # a flush: everything before it is written
                state.set()
                continue
            try:
                self.write(list(tokens), state)
            except OSError as exc:
                log.warning("a prefix of %d tokens could not be stored: %s", len(tokens), exc)
            finally:
                with self._lock:
                    self._pending.discard(tokens)
                    self._pending_bytes -= len(state)

    def write(self, tokens: list[int], state: bytes) -> Path:
        """Store it now: to a temporary name, flushed, renamed into place; then the directory held to its bound."""
        name = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32] + SUFFIX
        path = self.dir / name
        header = {"format": FORMAT, "key": self.key.as_dict(), "tokens": tokens, "state_bytes": len(state),
                  "state_sha256": hashlib.sha256(state).hexdigest(), "written_at": time.time()}
        tmp = self.dir / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
            fh.write(state)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        with self._lock:
            self._known[name] = Stored(path, tuple(tokens), len(state))
        self.tally.count("written")
        self.evict()
        return path

    def evict(self) -> None:
        """Remove the least recently used files (of every key) until the directory is within ``max_bytes``."""
        files = []
        for sub in self.root.iterdir() if self.root.is_dir() else []:
            if not sub.is_dir():
                continue
            for e in os.scandir(sub):
                if e.name.endswith(SUFFIX):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    files.append((st.st_mtime, st.st_size, Path(e.path)))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            with self._lock:
                self._known.pop(path.name, None)

    def usage(self) -> dict[str, Any]:
        """What the store holds (prefixes and bytes of this key; the most restored of them, each by the first
        characters of its file's name, its tokens, bytes and restores) and what its tally says it did."""
        held = self._scan()
        uses = self.tally.restores()
        top = sorted(held, key=lambda s: (-uses.get(s.path.name, 0), -len(s.tokens)))[:TOP_SHOWN]
        return {"prefixes": len(held), "state_bytes": sum(s.state_bytes for s in held), **self.tally.as_dict(),
                "top": [{"id": s.path.name[:12], "tokens": len(s.tokens), "state_bytes": s.state_bytes,
                         "restores": uses.get(s.path.name, 0)} for s in top]}


class WarmPrefixes:
    """A token session's prefill through its model's prefix store: the longest prefix of the prompt it holds, or
    can borrow from another slot (``_borrow``), or read back from the disk (``_restore``), kept; a prefix kept that
    way recurs, so it is stored (``_store``); the rest read from its tokens, its time counted in the store's tally
    (the prefill rate that prices a restore). A session gives ``_tokens`` (what its cache holds), ``truncate``,
    ``eval``, ``state(tokens)`` (a copy of its cache's state while it holds exactly ``tokens``), ``_prefixes()``
    (the store, or None) and ``_load_state(data, n_tokens, tokens)`` (a state read back into its cache, cut to
    ``n_tokens``: False where the backend refuses it)."""

    _tokens: list[int]
    truncate: Any
    eval: Any
    state: Any
    _prefixes: Any
    _load_state: Any

    def prefill(self, tokens: list[int]) -> Any:
        rest = tokens[self._reuse(tokens):]
        started = time.perf_counter()
        logits = self.eval(rest)
        store = self._prefixes()
        if store is not None:  # the model's prefill rate here: what a restore saves
            store.tally.prefilled(len(rest), time.perf_counter() - started)
        return logits

    def _reuse(self, tokens: list[int]) -> int:
        """Cut the cache to the longest prefix of ``tokens`` it holds (or can borrow or read back), less the last
        token, which is evaluated again for its logits: the tokens kept. Stored if it recurs and is not already."""
        restored = not self._borrow(tokens) and self._restore(tokens)
        keep = min(common_prefix(self._tokens, tokens), len(tokens) - 1)
        self.truncate(keep)
        if not restored:
            self._store(tokens[:keep])
        return keep

    def _borrow(self, tokens: list[int]) -> bool:
        """Start from another slot's cache where it holds more of ``tokens`` (a backend with shared cells)."""
        return False

    def _restore(self, tokens: list[int]) -> bool:
        """Read the stored prefix sharing the most tokens with ``tokens`` into the cache, where it holds more of
        them than the cache does (``PrefixStore.worth``); whether it did. A state the backend refuses leaves the
        cache empty, and the prompt is read from its tokens."""
        store = self._prefixes()
        found = store.worth(tokens, common_prefix(self._tokens, tokens)) if store is not None else None
        if found is None:
            return False
        stored, n = found
        started = time.perf_counter()
        data = store.read(stored)
        if data is None:
            return False
        if not self._load_state(data, n, tokens):
            log.warning("the backend refused the stored state of a prefix of %d tokens; it is read from its tokens",
                        len(stored.tokens))
            store.tally.count("refused")
            return False
        store.tally.restore(stored.path.name, n, time.perf_counter() - started)
        return True

    def _store(self, prefix: list[int]) -> None:
        """Hand the state of the cache, which holds exactly ``prefix``, to the store's writer (a copy now; the disk
        is written on the store's thread)."""
        store = self._prefixes()
        if store is None or not store.storing(prefix):
            return
        state = self.state(prefix)
        if state:
            store.write_later(prefix, state)
