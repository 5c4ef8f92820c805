"""A streamed answer is the whole answer: stop texts of several tokens on real models at temperature 0, streamed
and answered whole, give the same text (the stream holds back a tail that could begin a stop until the next tokens
rule it out: tasks/openai/engine.py's held_for_stops)."""

from __future__ import annotations

import pytest

from nodeagent.config import resolve
from nodeagent.node import Node
from nodeagent.tasks.decoding.sampling import Sampling
from nodeagent.tasks.events import Piece
from nodeagent.tasks.openai.engine import cut_at_stops, held_for_stops
from nodeagent.tasks.openai.spec import CompletionSpec

ASKS = ["Tell a short story about a cat who walked in the park.", "Describe a sunny day in the city, and a dog."]
# (stops, ask, kind): each one where a stream that did not hold the stop's start back sent more than the whole answer
CASES = {"smollm2_path": [(("in the", ", and"), 1, "chat"), (("was a", "and the"), 0, "chat"),
                          (("in the", ", and"), 0, "text")],
         "gemma3_path": [(("in the", ", and"), 0, "chat"), (("in the", ", and"), 1, "chat"),
                         (("in the", ", and"), 1, "text")]}


def test_the_tail_that_could_begin_a_stop_is_held():
    assert held_for_stops("...walked in", ("in the",)) == "...walked "
    assert held_for_stops("...walked in the park", ("in the",)) == "...walked "
    assert held_for_stops("...walked into", ("in the",)) == "...walked into"
    assert held_for_stops("a, b, an", (", and", "x")) == "a, b"
    assert held_for_stops("no stop here", ()) == "no stop here"
    assert cut_at_stops("one, and two in the end", ("in the", ", and")) == "one"


@pytest.mark.real_model
@pytest.mark.parametrize("which", sorted(CASES))
def test_streamed_equals_whole_under_stops_of_several_tokens(which, request):
    path = request.getfixturevalue(which)
    with Node(str(path), config=resolve(env={}), ctx_tokens=1024) as node:
        for stops, ask, kind in CASES[which]:
            fields = {"messages": ({"role": "user", "content": ASKS[ask]},)} if kind == "chat" else \
                {"prompts": (ASKS[ask],)}
            spec = CompletionSpec(kind, 48, Sampling(temperature=0.0, stop=stops), **fields)
            pieces: list[str] = []
            streamed = node.completion(spec, lambda e: pieces.append(e.value) if isinstance(e, Piece)
                                       and e.what == "content" else None)
            whole = node.completion(spec)
            choice = whole.body["choices"][0]
            text = choice["message"]["content"] if kind == "chat" else choice["text"]
            assert "".join(pieces) == (text or ""), (stops, ask, kind, pieces, text)
            assert streamed.body["choices"][0] == choice
