"""A stream continued on another node goes on from exactly the characters its client has, on every tokenizer, or
refuses: a vocabulary whose own tokenizing does not give the sent text back (SentencePiece with a space prefix:
Llama 2, Mistral 7B v0.x, Phi-3) still continues exactly. Small llama models with random weights on llama.cpp's
real vocabulary files (``nodeagent models fetch-test`` takes them from llama-cpp-python's source distribution)."""

from __future__ import annotations

import os

import pytest
from ggufgen import write_with_vocab

from nodeagent.backends.session import exact_tokens
from nodeagent.config import resolve
from nodeagent.node import Node
from nodeagent.store.pkgindex import vocab_path
from nodeagent.tasks.contracts import ChatTask
from nodeagent.tasks.events import Progress, Resume

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module", params=["ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf"])
def node(request, tmp_path_factory):
    config = resolve(env=dict(os.environ))
    model = write_with_vocab(tmp_path_factory.mktemp("vocab") / "model.gguf",
                             vocab_path(request.param, config["test_models_dir"]))
    with Node(str(model), config=resolve(env={}), ctx_tokens=1024) as n:
        yield n


def answer(node, resume: Resume | None = None) -> tuple[str, list[dict], str]:
    """A streamed chat answer (greedy), as a worker runs it: its events, and its content."""
    events: list[dict] = []
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 24,
            "temperature": 0}
    result = node.run(ChatTask(request=body), progress=Progress(events.append, resume))
    assert result.status == "ok", result.error
    content = result.output["choices"][0]["message"]["content"]
    sent = "".join(e["value"] for e in events if e["kind"] == "piece")
    return content, events, sent


def test_the_vocabularies_do_not_give_a_continuations_text_back(node):
    """Why this needs care: the vocabulary's own tokenizing adds a space before a continuation's first word."""
    with node.slot() as runner:
        check(runner.session)


def check(s) -> None:
    assert s.detokenize(s.tokenize_continuation("Hello world")) != "Hello world"
    for text in ("Hello world", " Hello world", "  two spaces", "\nnew line", "naïve café", "x"):
        tokens = exact_tokens(s, text)
        assert tokens is not None and s.detokenize(tokens) == text, text


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_a_resumed_stream_continues_from_exactly_what_was_sent(node, cut):
    whole, events, sent = answer(node)
    pieces = [e["value"] for e in events if e["kind"] == "piece"]
    assert sent == whole and len(pieces) > cut, pieces
    already = "".join(pieces[:cut])  # what the first attempt's client had when its node was lost
    content, resumed_events, more = answer(node, Resume(already))
    [prepared] = [e for e in resumed_events if e["kind"] == "prepared"]
    assert prepared.get("resumed") == len(already) and "unresumable" not in prepared
    assert content.startswith(already) and already + more == content  # one stream: nothing lost, nothing twice
    assert more, "the next attempt sent nothing more: the client would get a truncated answer"
