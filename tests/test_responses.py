"""``/v1/responses`` on `serve` (SmolLM2 and Gemma 3, with a SQLite broker so responses are stored), as the
clients orchestrators use speak it in their default modes: the openai package (create, a required function tool,
stream, parse, a second turn answering the call, previous_response_id), the OpenAI Agents SDK (an Agent with an
output_type, one with a function tool), pydantic-ai's OpenAIResponsesModel and LangChain's
``ChatOpenAI(use_responses_api=True)``, each at max output tokens of 30, 60 and 120 and with none. The field
table's rows against openai's own ``ResponseCreateParams``, each refused field's 400, the stream's events and
their order, and what a server without a broker says. The gateway's door is tested in test_gateway.py with the
same checks (``openai_checks`` and the rest, imported from here)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from test_server import Served, json_error
from test_tool_budgets import TEXT, Person, get_weather

from nodeagent.tasks.openai.fields import RESPONSES
from nodeagent.tasks.schema import validate_output

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "description": "the city's name"}}},
           "strict": True}
ASK = "What is the weather in Paris?"
BUDGETS = [30, 60, 120, None]


def budget(max_tokens: int | None) -> dict:
    return {} if max_tokens is None else {"max_output_tokens": max_tokens}


def a_call(item) -> dict:
    args = json.loads(item.arguments)
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id and args
    assert validate_output(WEATHER["parameters"], args) is None, args
    return args


def no_envelope(text: str | None) -> None:
    assert not any(m in (text or "") for m in ('{"tool_calls"', '{"response"', "<tool_call>")), text


# -- the checks each door passes (serve here, the gateway in test_gateway.py) ---------------------------------------
def openai_checks(url: str, model: str, max_tokens: int | None, stored: bool) -> None:
    """The openai package as its docs show it: a text answer, a required call and its second turn, a stream, a
    parse into a Pydantic model, and (``stored``) previous_response_id, GET and DELETE."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model=model, input="Say hello to Ana.", temperature=0, **budget(max_tokens))
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= (max_tokens or 10**6) and r.usage.input_tokens > 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    no_envelope(r.output_text)

    called = client.responses.create(model=model, input=ASK, tools=[WEATHER], tool_choice="required",
                                     temperature=0, **budget(max_tokens))
    calls = [i for i in called.output if i.type == "function_call"]
    assert len(calls) == 1 and not called.output_text
    a_call(calls[0])
    assert called.usage.output_tokens <= (max_tokens or 10**6)
    second = client.responses.create(model=model, tools=[WEATHER], temperature=0, **budget(max_tokens), input=[
        {"role": "user", "content": ASK}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 degrees and sunny"}])
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage.input_tokens > called.usage.input_tokens  # the call and its output were read

    kinds, text = [], ""
    with client.responses.stream(model=model, input="Say hello to Ana.", temperature=0,
                                 **budget(max_tokens)) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert text == r.output_text  # the same answer as the whole one (temperature 0, read afresh)
    if kinds[-1] == "response.completed":
        assert stream.get_final_response().output_text == text

    parsed = client.responses.parse(model=model, input=f"Extract the person. Text: {TEXT}", text_format=Person,
                                    temperature=0, **budget(max_tokens))
    if parsed.status == "completed":
        assert isinstance(parsed.output_parsed, Person)
    else:  # cut at the budget: the object was closed early, still valid
        assert parsed.incomplete_details.reason == "max_output_tokens"
        assert validate_output(Person.model_json_schema(), json.loads(parsed.output_text)) is None

    if stored:
        assert r.store and client.responses.retrieve(r.id).output_text == r.output_text
        follow = client.responses.create(model=model, previous_response_id=called.id, tools=[WEATHER],
                                         temperature=0, **budget(max_tokens), input=[
                                             {"type": "function_call_output", "call_id": calls[0].call_id,
                                              "output": "21 degrees and sunny"}])
        assert follow.previous_response_id == called.id
        assert follow.usage.input_tokens >= second.usage.input_tokens - 2  # the stored turn was read back
        client.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError, match="not found"):
            client.responses.create(model=model, input="Again.", previous_response_id=r.id)


def agents_checks(url: str, model: str, max_tokens: int | None) -> None:
    """The OpenAI Agents SDK's default model class (OpenAIResponsesModel): an output_type, and a function tool it
    calls and answers from."""
    asyncio.run(_agents(url, model, max_tokens))


async def _agents(url: str, model: str, max_tokens: int | None) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    llm = OpenAIResponsesModel(model=model, openai_client=client)
    run = RunConfig(tracing_disabled=True)
    extractor = Agent(name="extractor", instructions="Extract the person.", model=llm, output_type=Person,
                      model_settings=ModelSettings(temperature=0, max_tokens=max_tokens))
    result = await Runner.run(extractor, TEXT, run_config=run)
    assert isinstance(result.final_output, Person) and 0 <= result.final_output.age <= 130

    caller = Agent(name="weather", instructions="Answer with the weather tool.", model=llm,
                   tools=[function_tool(get_weather)], tool_use_behavior="stop_on_first_tool",
                   model_settings=ModelSettings(temperature=0, max_tokens=max_tokens, tool_choice="required"))
    result = await Runner.run(caller, ASK, run_config=run, max_turns=2)
    assert result.final_output.startswith("21 degrees in ")  # the tool ran on the model's call, its output final
    await client.close()


def pydantic_ai_checks(url: str, model: str, max_tokens: int | None) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    llm = OpenAIResponsesModel(model, provider=OpenAIProvider(base_url=url + "/v1", api_key="unused"))
    settings = {"temperature": 0.0, **({} if max_tokens is None else {"max_tokens": max_tokens})}
    agent = Agent(llm, output_type=Person, model_settings=settings, retries=2)
    result = agent.run_sync(f"Extract the person. Text: {TEXT}")
    assert isinstance(result.output, Person) and 0 <= result.output.age <= 130


def langchain_checks(url: str, model: str, max_tokens: int | None) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", temperature=0, max_retries=0,
                      use_responses_api=True, **({} if max_tokens is None else {"max_tokens": max_tokens}))
    person = chat.with_structured_output(Person).invoke(f"Extract the person. Text: {TEXT}")
    assert isinstance(person, Person) and person.name.strip()
    ai = chat.invoke("Say hello to Ana.")
    assert ai.text and ai.response_metadata.get("status") in ("completed", "incomplete")
    no_envelope(ai.text)


# -- serve: SmolLM2 and Gemma 3, responses stored in its SQLite broker ----------------------------------------------
# Without max_output_tokens an answer may take the server's limit (NODEAGENT_MAX_TOKENS), set here to 256: Gemma 3
# 270M can talk for thousands of tokens, which would only make the suite slower.
@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def door(request, tmp_path_factory):
    path = request.getfixturevalue(f"{request.param}_path")
    home = tmp_path_factory.mktemp(f"responses-{request.param}")
    server = Served(str(path), {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml"),
                                "NODEAGENT_DETERMINISTIC": "1", "NODEAGENT_MAX_TOKENS": "256"},
                    "--ctx", "4096", "--slots", "1", "--broker", f"sqlite:///{home / 'queue.db'}", "--types", "chat")
    server.model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    yield server
    server.stop()


@pytest.mark.real_model
@pytest.mark.parametrize("max_tokens", BUDGETS)
def test_the_openai_package(door, max_tokens):
    openai_checks(door.url, door.model, max_tokens, stored=True)


@pytest.mark.real_model
@pytest.mark.parametrize("max_tokens", BUDGETS)
def test_the_agents_sdk(door, max_tokens):
    agents_checks(door.url, door.model, max_tokens)


@pytest.mark.real_model
@pytest.mark.parametrize("max_tokens", BUDGETS)
def test_pydantic_ai_responses_model(door, max_tokens):
    pydantic_ai_checks(door.url, door.model, max_tokens)


@pytest.mark.real_model
@pytest.mark.parametrize("max_tokens", BUDGETS)
def test_langchain_responses_mode(door, max_tokens):
    langchain_checks(door.url, door.model, max_tokens)


@pytest.mark.real_model
@pytest.mark.parametrize("max_tokens", [10, 20])
def test_a_required_call_at_10_and_20_tokens(door, max_tokens):
    import openai

    client = openai.OpenAI(base_url=door.url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model=door.model, input=ASK, tools=[WEATHER], tool_choice="required",
                                max_output_tokens=max_tokens, temperature=0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and not r.output_text and r.usage.output_tokens <= max_tokens
    a_call(calls[0])
    # a tool whose shortest call still needs two chosen tokens (the city's closing quote, the unit's choice)
    two = {**WEATHER, "parameters": {**WEATHER["parameters"], "required": ["city", "unit"], "properties": {
        **WEATHER["parameters"]["properties"], "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}
    too_small = httpx.post(door.url + "/v1/responses", json={"model": door.model, "input": ASK, "tools": [two],
                                                             "tool_choice": "required", "max_output_tokens": 1},
                           timeout=60)
    err = json_error(too_small, 400)
    assert err["code"] == "max_tokens_too_small" and err["param"] == "max_output_tokens"
    assert "max_output_tokens 1 cannot hold a tool call" in err["message"]


@pytest.mark.real_model
def test_the_stream_s_events_in_order_with_sequence_numbers(door):
    events = []
    with httpx.stream("POST", door.url + "/v1/responses", timeout=120, json={
            "model": door.model, "input": ASK, "tools": [WEATHER], "tool_choice": "required", "stream": True,
            "max_output_tokens": 60}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                body = json.loads(line[6:])
                assert body["type"] == kind
                events.append(body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"], kinds
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0] == events[-2]["item"]
    assert events[4]["arguments"] == done["output"][0]["arguments"] and events[4]["name"] == "get_weather"


@pytest.mark.real_model
def test_a_text_format_schema_is_enforced_and_harmless_values_pass(door):
    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 20}}}
    r = httpx.post(door.url + "/v1/responses", timeout=120, json={
        "model": door.model, "input": f"Where does Alice live? {TEXT}", "instructions": "Answer in JSON.",
        "text": {"format": {"type": "json_schema", "name": "where", "schema": schema, "strict": True}},
        "background": False, "include": [], "truncation": "disabled", "reasoning": {"effort": None},
        "metadata": {"run": "1"}, "store": False, "seed": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["store"] is False and out["instructions"] == "Answer in JSON."
    assert validate_output(schema, json.loads(out["output"][0]["content"][0]["text"])) is None
    assert httpx.get(door.url + f"/v1/responses/{out['id']}", timeout=30).status_code == 404  # store: false


# -- the field table ------------------------------------------------------------------------------------------------
def test_the_field_table_has_a_row_for_every_field_openai_sends():
    from openai.types.responses.response_create_params import ResponseCreateParamsBase

    fields = set(ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert fields <= RESPONSES.names(), sorted(fields - RESPONSES.names())


def test_each_refused_field_is_a_400_that_names_it(fake_env):
    server = Served("fake", fake_env)
    try:
        refused = {"background": True, "include": ["reasoning.encrypted_content"], "truncation": "auto",
                   "reasoning": {"effort": "high"}, "top_logprobs": 3, "conversation": "conv_1",
                   "prompt": {"id": "pmpt_1"}, "context_management": [{"type": "compaction"}],
                   "moderation": {"model": "omni"}, "image": {"size": "1024x1024"}, "access_programs": ["x"],
                   "background_options": {"x": 1}}
        assert set(RESPONSES.refused) == set(refused)
        for name, value in refused.items():
            err = json_error(httpx.post(server.url + "/v1/responses", json={"input": "hi", name: value}, timeout=30),
                             400)
            assert err["param"] == name and name in err["message"], err
        bad = {"frobnicate": 1}
        err = json_error(httpx.post(server.url + "/v1/responses", json={"input": "hi", **bad}, timeout=30), 400)
        assert err["code"] == "unknown_parameter" and err["param"] == "frobnicate"
        for item, param in (({"type": "web_search"}, "tools[0].type"),):
            err = json_error(httpx.post(server.url + "/v1/responses", json={"input": "hi", "tools": [item]},
                                        timeout=30), 400)
            assert err["param"] == param
        err = json_error(httpx.post(server.url + "/v1/responses", json={"input": [{"type": "reasoning"}]},
                                    timeout=30), 400)
        assert err["param"] == "input[0].type"
        err = json_error(httpx.post(server.url + "/v1/responses", json={"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}]}, timeout=30), 400)
        assert err["param"] == "input[0].content[0].type"
        err = json_error(httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 10**7},
                                    timeout=30), 400)
        assert err["param"] == "max_output_tokens" and "max_output_tokens" in err["message"]
        for name, values in RESPONSES.harmless.items():
            for value in values:
                r = httpx.post(server.url + "/v1/responses", json={"input": "hi", name: value,
                                                                   "max_output_tokens": 4}, timeout=30)
                assert r.status_code == 200, (name, value, r.text)
        # no broker: nothing is kept, and a continuation says why it cannot be one
        r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 4, "store": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["store"] is False and "no broker" in r.headers["x-nodeagent-notes"]
        err = json_error(httpx.post(server.url + "/v1/responses", json={"input": "hi", "previous_response_id":
                                                                        r.json()["id"]}, timeout=30), 400)
        assert err["param"] == "previous_response_id" and "no broker" in err["message"]
        assert json_error(httpx.get(server.url + "/v1/responses/resp_1", timeout=30), 404)["code"] == "not_found"
    finally:
        server.stop()


@pytest.fixture
def fake_env(tmp_path):
    return {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c.toml")}
