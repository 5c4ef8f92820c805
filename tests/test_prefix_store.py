"""Warm prefixes on disk (``backends/prefix_store.py``): a recurring prompt prefix's KV state kept once computed and
read back into a slot after a restart, giving the same answer token for token as the prefix kept in memory; a state
of another model file, build or KV types never read; a corrupt or cut-short file refused and replaced; the disk
bound held, least recently used out first; two processes sharing the directory never reading half a file."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from nodeagent.backends.prefix_store import FORMAT, MIN_STORED_TOKENS, PrefixStore, StateKey, model_sha256
from nodeagent.config import resolve
from nodeagent.modelfile import inspect_file
from nodeagent.node import Node
from nodeagent.planner.kv import kv_bytes_per_token

KEY = StateKey("a" * 64, "llama.cpp (llama-cpp-python 0.0.0)", "f16/f16")
TOKENS = list(range(1, 201))


def store_of(tmp_path: Path, key: StateKey = KEY, max_bytes: int = 1 << 30) -> PrefixStore:
    return PrefixStore(tmp_path / "prefixes", key, max_bytes)


def test_a_stored_prefix_is_found_by_the_tokens_it_shares_and_read_back_as_written(tmp_path):
    store = store_of(tmp_path)
    state = os.urandom(50_000)
    store.write(TOKENS, state)
    found, n = store.best(TOKENS[:150] + [999, 998])  # shares 150 of its 200 tokens
    assert n == 150 and found.tokens == tuple(TOKENS) and store.read(found) == state
    assert store.best(TOKENS[:MIN_STORED_TOKENS - 1] + [999]) is None  # too short a share to be worth a read
    assert store.best([7, *TOKENS]) is None
    assert store.covers(TOKENS[:120]) and not store.covers(TOKENS + [5])
    assert store.usage()["prefixes"] == 1 and store.usage()["state_bytes"] == 50_000


def test_a_prefix_is_stored_once_it_recurs_and_a_conversations_growing_turns_never_are(tmp_path):
    """Stored when a third task keeps the same prefix (a few of its input's tokens shared by chance or not), once;
    a conversation, whose every turn keeps a longer prefix than the last, is never written turn after turn."""
    store = store_of(tmp_path)
    instructions = list(range(1000, 1200))
    assert not store.wants(instructions + [5])  # kept by a second task: not yet
    assert store.wants(instructions + [5, 6])  # by a third: stored
    store.write(instructions + [5, 6], b"state")
    assert not store.wants(instructions + [7]) and not store.wants(instructions)  # held already
    turns = list(range(1, 100))
    for turn in range(12):
        turns += list(range(2000 + 40 * turn, 2040 + 40 * turn))
        assert not store.wants(turns)
    assert not store.wants(list(range(40)) + [1]) and not store.wants(list(range(40)) + [2])  # too short


def test_a_state_of_another_model_build_or_kv_types_is_never_read(tmp_path):
    """Each key has a directory of its own, so another key's states are not found; a file copied in under the
    wrong key is refused by its header and removed."""
    store = store_of(tmp_path)
    path = store.write(TOKENS, b"x" * 1000)
    for other in (StateKey("b" * 64, KEY.backend, KEY.kv_types), StateKey(KEY.model_sha256, "llama.cpp (other)",
                                                                           KEY.kv_types),
                  StateKey(KEY.model_sha256, KEY.backend, "q8_0/q8_0")):
        foreign = store_of(tmp_path, other)
        assert foreign.dir != store.dir and foreign.best(TOKENS) is None
        copied = foreign.dir / path.name
        copied.write_bytes(path.read_bytes())
        assert foreign.best(TOKENS) is None and not copied.exists() and foreign.tally.refused == 1
    assert store.best(TOKENS) is not None  # its own still there


@pytest.mark.parametrize("damage", ["flipped", "cut short", "no header"])
def test_a_corrupt_or_cut_short_file_is_refused_removed_and_stored_again(tmp_path, damage):
    store = store_of(tmp_path)
    state = os.urandom(20_000)
    path = store.write(TOKENS, state)
    raw = bytearray(path.read_bytes())
    if damage == "flipped":
        raw[-100] ^= 0xFF
    elif damage == "cut short":
        raw = raw[:-5000]
    else:
        raw = raw[raw.index(b"\n") + 1:]
    path.write_bytes(bytes(raw))
    reader = store_of(tmp_path)  # (another process would read the header afresh)
    found = reader.best(TOKENS)
    assert (found is None if damage == "no header" else reader.read(found[0]) is None)
    assert not path.exists() and reader.tally.refused == 1
    reader.write(TOKENS, state)  # stored again when it recurs
    assert reader.read(reader.best(TOKENS)[0]) == state


def test_the_disk_bound_holds_and_the_least_recently_used_go_first(tmp_path):
    store = store_of(tmp_path, max_bytes=3_200_000)
    prefixes = [[k, *TOKENS] for k in range(5)]
    for i, tokens in enumerate(prefixes[:3]):
        path = store.write(tokens, bytes([i]) * 1_000_000)
        os.utime(path, (100 * (i + 1), 100 * (i + 1)))  # used in turn, the first longest ago...
    first = store.best(prefixes[0])[0]
    assert first.tokens[0] == 0 and store.read(first) is not None  # ...until it is read again: now the newest
    store.write(prefixes[3], b"\x03" * 1_000_000)
    store.write(prefixes[4], b"\x04" * 1_000_000)
    sizes = sum(p.stat().st_size for p in store.dir.iterdir())
    assert sizes <= 3_200_000
    held = {s.tokens[0] for s in store._scan()}
    assert 0 in held and {3, 4} <= held and len(held) == 3  # the ones used least recently (1, 2) went


def _writer(directory: str, rounds: int) -> None:
    store = PrefixStore(Path(directory), KEY, 1 << 30)
    for r in range(rounds):
        store.write(TOKENS, bytes([r % 251]) * 400_000)  # the same prefix over and over: the same file name


def test_two_processes_sharing_the_directory_never_read_half_a_file(tmp_path):
    """One process rewrites a prefix's file again and again while another reads it: every read is a whole state
    or nothing, never a refusal (a half-written file would fail its sha256 and be refused)."""
    store = store_of(tmp_path)
    store.write(TOKENS, b"\x00" * 400_000)
    proc = multiprocessing.get_context("spawn").Process(target=_writer, args=(str(store.root), 60))
    proc.start()
    reads = 0
    while proc.is_alive() or reads < 20:
        found = store.best(TOKENS)
        if found is not None and (data := store.read(found[0])) is not None:
            assert len(data) == 400_000 and len(set(data)) == 1
            reads += 1
        if not proc.is_alive() and reads >= 20:
            break
    proc.join(60)
    assert proc.exitcode == 0 and store.tally.refused == 0 and reads >= 20


def test_a_models_sha256_is_read_once_and_remembered_by_its_size_and_time(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\x00" * 1000)
    first = model_sha256(model, tmp_path)
    assert len(first) == 64 and (tmp_path / "models.json").exists()
    (tmp_path / "models.json").write_text((tmp_path / "models.json").read_text().replace(first, "remembered"))
    assert model_sha256(model, tmp_path) == "remembered"
    model.write_bytes(b"GGUF" + b"\x01" * 1000)  # a new file under the same name: read again
    assert model_sha256(model, tmp_path) not in ("remembered", first)


INSTRUCTIONS = ("You read support tickets for a hardware shop and fill in the form. " * 12).strip()
SCHEMA = {"type": "object", "properties": {"product": {"type": "string", "maxLength": 40},
                                           "urgent": {"type": "boolean"}},
          "required": ["product", "urgent"], "additionalProperties": False}
TICKETS = ["My Pi 5 will not boot since this morning, please help fast.",
           "The keyboard I bought last week has a sticky space bar.",
           "Order 5512: the SD card arrived cracked, I need a new one today."]


def node_of(path: Path, tmp_path: Path, **env: str) -> Node:
    return Node(str(path), config=resolve(env={"NODEAGENT_PREFIX_DIR": str(tmp_path / "prefixes"), **env}))


def extracted(node: Node, ticket: str):
    result = node.extract(ticket, SCHEMA, instructions=INSTRUCTIONS)
    assert result.status == "ok", result.error
    return result


def store_of_node(node: Node) -> PrefixStore:
    store = node.prefix_store(wait_s=30)
    assert store is not None
    return store


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_a_restored_prefix_answers_as_the_prefix_kept_in_memory_token_for_token(which, request, tmp_path):
    """A node reads two tickets under the same instructions (the second keeps the first's prefix: it recurs, so
    its state is stored) and a third with the prefix kept in memory. A new node on the same directory (a restart)
    reads the third with the prefix restored from disk: the same output and the same tokens, at temperature 0.
    A node whose KV types differ reads nothing stored (another key) and answers all the same."""
    path = request.getfixturevalue(f"{which}_path")
    with node_of(path, tmp_path) as first:
        extracted(first, TICKETS[0])
        store = store_of_node(first)
        extracted(first, TICKETS[1])
        warm = extracted(first, TICKETS[2])
        store.flush()
        held = store.usage()
        assert held["prefixes"] == 1 and held["written"] == 1 and held["restored"] == 0, held
        # its size is what the plan prices: the KV types' K and V rows of every attention layer a token, and
        # llama.cpp's few bytes a cell (its position and sequence)
        s = first.plan.settings
        per_token = kv_bytes_per_token(inspect_file(path), s.type_k, s.type_v)
        [stored] = store._scan()
        assert 0 <= held["state_bytes"] - len(stored.tokens) * per_token <= len(stored.tokens) * 16 + 4096, held
        assert any(r.startswith("warm prefixes:") for r in first.plan.reasons)
    with node_of(path, tmp_path) as second:
        second.load()
        store = store_of_node(second)
        restored = extracted(second, TICKETS[2])
        tally = store.tally
        assert tally.restored == 1 and tally.restored_tokens >= MIN_STORED_TOKENS and tally.refused == 0
        assert restored.output == warm.output and restored.tokens == warm.tokens
        assert store.usage()["written"] == 0  # nothing stored twice
        from nodeagent.server.metrics import Metrics

        scraped = Metrics(second).render()  # /metrics: the same figures, by the model's name
        assert f'nodeagent_prefix_restores_total{{model="{path}"}} 1.0' in scraped
        assert f'nodeagent_prefixes{{model="{path}"}} 1.0' in scraped and "nodeagent_prefix_saved_seconds{" in scraped
    with node_of(path, tmp_path, NODEAGENT_TYPE_K="q8_0", NODEAGENT_TYPE_V="q8_0") as other:
        other.load()
        store = store_of_node(other)
        assert extracted(other, TICKETS[2]).status == "ok"
        assert store.tally.restored == 0 and store.key.kv_types == "q8_0/q8_0"


def test_a_stored_file_says_its_format_key_and_tokens(tmp_path):
    store = store_of(tmp_path)
    path = store.write(TOKENS, b"abc")
    import json

    header = json.loads(path.read_bytes().split(b"\n", 1)[0])
    assert header["format"] == FORMAT and header["key"] == KEY.as_dict() and header["tokens"] == TOKENS


@pytest.mark.real_model
def test_status_and_the_page_show_a_restarted_workers_warm_prefixes_and_the_prefill_they_saved(
        smollm2_path, isolated_env, tmp_path):
    """A worker (the CLI, a process) reads three tickets under the same instructions and stops: the prefix recurred,
    so it is on disk. A second worker (a restart) reads a fourth with the prefix restored. `nodeagent status` then
    shows the node's warm prefix, its restore, the prefill rate it measured and the prefill seconds saved, and the
    page's row says it in words."""
    from conftest import QUIET_GUARD, cli

    from nodeagent.broker.open import open_broker
    from nodeagent.client import Client
    from nodeagent.fleet.status import NodeStatus
    from nodeagent.tasks.contracts import ExtractTask
    from nodeagent.ui.views import node_models

    url = f"sqlite://{tmp_path / 'queue.db'}"
    env = {**QUIET_GUARD, **isolated_env, "NODEAGENT_PREFIX_DIR": str(tmp_path / "prefixes"), "NODEAGENT_SLOTS": "1"}
    client = Client(open_broker(url, tmp_path))

    def run(tickets: list[str]) -> None:
        ids = [client.submit(ExtractTask(input=t, schema=SCHEMA, instructions=INSTRUCTIONS)) for t in tickets]
        cli(["worker", "--model", str(smollm2_path), "--broker", url, "--burst"], env)
        assert all(client.broker.result(i).status == "ok" for i in ids)

    run(TICKETS)
    assert len(list((tmp_path / "prefixes").rglob("*.kv"))) == 1
    run(["A fourth ticket: the HDMI cable of my Pi 4 is frayed, not urgent."])
    shown = json.loads(cli(["status", "--broker", url, "--json"], env).stdout)
    [node] = shown["nodes"]
    [(model, warm)] = node["prefixes"].items()
    assert model == str(smollm2_path) and warm["prefixes"] == 1 and warm["written"] == 0, warm
    assert warm["restored"] == 1 and warm["restored_tokens"] >= MIN_STORED_TOKENS, warm
    # the seconds saved are the restored tokens at the prefill rate this worker measured, less the restore's time
    assert warm["prefill_tokens_per_s"] > 0 and warm["saved_s"] > 0, warm
    assert warm["saved_s"] == pytest.approx(warm["restored_tokens"] / warm["prefill_tokens_per_s"]
                                            - warm["restore_s"], abs=0.05)
    assert warm["top"][0]["restores"] == 1 and warm["top"][0]["tokens"] == warm["restored_tokens"]
    table = cli(["status", "--broker", url], env).stdout
    assert "Warm prefixes" in table and f"{warm['saved_s']:.1f} s" in table
    [row] = node_models(NodeStatus.model_validate(node))
    assert row.prefixes.startswith("1 warm prefix (") and "1 restored" in row.prefixes
    assert f"{warm['saved_s']:.1f} s of prefill saved" in row.prefixes
