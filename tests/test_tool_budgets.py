"""Tool calls under the ``max_tokens`` people set (10-120), through each client library in its default mode, on
SmolLM2 and on Gemma 3: every answer is a call (or text) and never the format's own syntax; a budget too small
for any call is a 400 that names the minimum; the envelope the grammar forces (``{"tool_calls": [{"name": ...``)
is not charged to ``max_tokens``, so ``usage.completion_tokens`` stays within it; a call is made once unless the request asks for parallel calls;
``n`` past the node's one slot is served in turn.

The servers plan one slot each (what a 2-core machine plans for SmolLM2), so ``n`` here always exceeds the slots,
and run under NODEAGENT_DETERMINISTIC (every prompt read afresh), so that a streamed answer can be compared with
the same request answered whole: with cells of an earlier request reused, Gemma 3's near-even choices may go the
other way. instructor runs from its own environment, as in ``test_client_libraries.py``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel, Field
from test_client_libraries import instructor_person
from test_server import Served, json_error

from nodeagent.tasks.schema import validate_output

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[1]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TEXT = "Alice Martin is 34 years old and lives in Lyon."
ENVELOPE = ('{"tool_calls"', '{"response"', "<tool_call>", '"arguments":')


class Person(BaseModel):
    """A person named in the text."""

    name: str = Field(description="The person's full name", max_length=40)
    age: int = Field(description="Age in years", ge=0, le=130)


def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
        city: the city's name
    """
    return f"21 degrees in {city}"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def door(request, tmp_path_factory):
    path = request.getfixturevalue(f"{request.param}_path")
    home = tmp_path_factory.mktemp(f"budget-{request.param}")
    server = Served(str(path), {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml"),
                                "NODEAGENT_DETERMINISTIC": "1"}, "--ctx", "4096", "--slots", "1")
    server.model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(door):
    import openai

    return openai.OpenAI(base_url=door.url + "/v1", api_key="unused", max_retries=0)


def no_envelope(text: str | None) -> None:
    assert not any(mark in (text or "") for mark in ENVELOPE), text


def valid_call(call, schema=WEATHER["function"]["parameters"]) -> dict:
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and validate_output(schema, args) is None, args
    return args


# -- the openai package ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [10, 20, 30, 60])
def test_required_at_a_small_budget_is_a_call(client, door, max_tokens):
    raw = client.chat.completions.with_raw_response.create(model=door.model, messages=ASK, tools=[WEATHER],
                                                           tool_choice="required", max_tokens=max_tokens,
                                                           temperature=0)
    r = raw.parse()
    m, finish = r.choices[0].message, r.choices[0].finish_reason
    assert m.content is None and len(m.tool_calls) == 1  # one call: parallel calls were not asked for
    valid_call(m.tool_calls[0])
    assert 0 < r.usage.completion_tokens <= max_tokens
    if finish == "length":  # closed early to fit: the notes say where
        assert "closed early at tool_calls[0]" in raw.headers["x-nodeagent-notes"]
    else:
        assert finish == "tool_calls"


def test_a_budget_no_call_fits_is_a_400_that_names_the_minimum(door):
    r = httpx.post(door.url + "/v1/chat/completions", json={"model": door.model, "messages": ASK, "tools": [WEATHER],
                                                            "tool_choice": "required", "max_tokens": 1}, timeout=60)
    err = json_error(r, 400)
    assert err["code"] == "max_tokens_too_small" and err["param"] == "max_tokens"
    need = int(err["message"].split("needs ")[1].split(" tokens")[0])
    # the name's choice and the arguments' few chosen tokens: the envelope's ~20 forced tokens are not counted
    assert f"at least {need}" in err["message"] and 1 < need <= 5
    ok = httpx.post(door.url + "/v1/chat/completions", json={"model": door.model, "messages": ASK, "tools": [WEATHER],
                                                             "tool_choice": "required", "max_tokens": need},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"]  # the minimum holds a call


def test_auto_answering_in_text_is_the_text_unwrapped(client, door):
    r = client.chat.completions.create(model=door.model, messages=[{"role": "user", "content": "Describe Paris."}],
                                       tools=[WEATHER], tool_choice="auto", max_tokens=30, temperature=0)
    m = r.choices[0].message
    no_envelope(m.content)
    if m.tool_calls:
        valid_call(m.tool_calls[0])
    else:
        assert isinstance(m.content, str) and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_at_a_small_budget_no_delta_carries_the_format(client, door, choice):
    pieces, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(model=door.model, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                                max_tokens=30, temperature=0, stream=True):
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    for piece in pieces:
        no_envelope(piece)
    plain = client.chat.completions.create(model=door.model, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                           max_tokens=30, temperature=0)
    m = plain.choices[0].message
    assert finish == plain.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    assert ("".join(pieces) or None) == (m.content or None)
    if choice == "required":
        assert len(calls) == 1


def test_parallel_calls_when_asked_for_never_repeat_one(client, door):
    r = client.chat.completions.create(model=door.model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=True, max_tokens=120, temperature=0)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert calls and all(calls[i] not in calls[:i] for i in range(len(calls)))
    for c in r.choices[0].message.tool_calls:
        valid_call(c)


# -- n past the slots --------------------------------------------------------------------------------------------
def test_n_past_the_slots_is_served_in_turn_and_refused_past_the_limit(client, door):
    r = client.chat.completions.create(model=door.model, messages=[{"role": "user", "content": "Say a word."}], n=4,
                                       max_tokens=6, temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and all(c.message.content for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1  # each choice its own draw
    tools = client.chat.completions.create(model=door.model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           n=2, max_tokens=60, temperature=0)
    assert [len(c.message.tool_calls) for c in tools.choices] == [1, 1]
    too_many = httpx.post(door.url + "/v1/chat/completions", json={
        "model": door.model, "messages": ASK, "n": 17}, timeout=60)
    err = json_error(too_many, 400)
    assert err["param"] == "n" and "16" in err["message"] and "NODEAGENT_MAX_N" in err["message"]


# -- the client libraries in their default modes ----------------------------------------------------------------
def test_pydantic_ai_default_output_at_60_tokens(door):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    llm = OpenAIChatModel(door.model, provider=OpenAIProvider(base_url=door.url + "/v1", api_key="unused"))
    agent = Agent(llm, output_type=Person, model_settings={"temperature": 0.0, "max_tokens": 60})
    result = agent.run_sync(f"Extract the person. Text: {TEXT}")
    assert isinstance(result.output, Person) and 0 <= result.output.age <= 130
    for message in result.all_messages():
        for part in getattr(message, "parts", []):
            no_envelope(getattr(part, "content", None) if isinstance(getattr(part, "content", None), str) else None)


def test_langchain_bind_tools_at_40_tokens(door):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=door.model, base_url=door.url + "/v1", api_key="unused", temperature=0, max_retries=0,
                      max_tokens=40)
    weather = tool(get_weather)
    ai = chat.bind_tools([weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather"
    assert isinstance(ai.tool_calls[0]["args"]["city"], str) and weather.invoke(ai.tool_calls[0]["args"])
    no_envelope(ai.content)
    ai = chat.bind_tools([weather]).invoke("What is the weather in Paris?")  # the default: auto
    no_envelope(ai.content)
    assert ai.tool_calls or ai.content


@pytest.mark.parametrize("max_tokens", [10, 20, 40])
def test_litellm_tools_at_small_budgets(door, max_tokens):
    import litellm

    base = {"model": f"openai/{door.model}", "api_base": door.url + "/v1", "api_key": "unused", "temperature": 0}
    r = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens, **base)
    m = r.choices[0].message
    assert len(m.tool_calls) == 1 and r.choices[0].finish_reason in ("tool_calls", "length")
    valid_call(m.tool_calls[0])
    assert r.usage.completion_tokens <= max_tokens
    no_envelope(m.content)
    if max_tokens == 10:
        with pytest.raises(litellm.BadRequestError, match="max_tokens"):  # the 400, as LiteLLM raises it
            litellm.completion(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=1, **base)


def test_instructor_tools_at_60_tokens(door):
    out = instructor_person(door.url, door.model, "TOOLS", retries=0, max_tokens=60)
    assert "person" in out, out
    person = Person.model_validate(out["person"])
    assert person.name.strip()
