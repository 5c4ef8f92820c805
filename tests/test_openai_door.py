"""The OpenAI door as orchestrators use it: a real server on SmolLM2 driven by the official ``openai`` package
(tools in each tool_choice, streamed tool calls through its stream helpers, ``parse`` with tools, logprobs,
``/v1/completions`` with echo, n=3), the field table (every refused field a 400 that names it), and the
log-probabilities checked against llama.cpp's own log-softmax of the same logits.

The other client libraries (LangChain, instructor, pydantic-ai, LiteLLM) are in ``test_client_libraries.py``."""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest
from conftest import cli
from test_server import Served, json_error

from nodeagent.tasks.openai.fields import CHAT, COMPLETIONS
from nodeagent.tasks.schema import validate_output

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
EMAIL = {"type": "function", "function": {
    "name": "send_email", "description": "Send an email",
    "parameters": {"type": "object", "required": ["to", "subject"],
                   "properties": {"to": {"type": "string", "format": "email"},
                                  "subject": {"type": "string", "maxLength": 60},
                                  "urgent": {"type": "boolean"}}}}}
TOOLS = [WEATHER, EMAIL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
DOOR_FLAGS = ("--ctx", "8192", "--slots", "4")
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def door(tmp_path_factory, smollm2_path):
    home = tmp_path_factory.mktemp("door")
    server = Served(str(smollm2_path), {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml")},
                    *DOOR_FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(door):
    import openai

    return openai.OpenAI(base_url=door.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def valid_calls(message) -> list[tuple[str, dict]]:
    """Each call's name and arguments, every one checked against its function's schema."""
    out = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        assert call.id and call.type == "function"
        assert validate_output(SCHEMAS[call.function.name], args) is None, (call.function.name, args)
        out.append((call.function.name, args))
    return out


@pytest.mark.real_model
def test_tool_choice_required_named_and_one_call(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert valid_calls(choice.message)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "send_email"}})
    calls = valid_calls(r.choices[0].message)
    assert [name for name, _ in calls] == ["send_email"]
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0.8, seed=3)
    assert len(valid_calls(r.choices[0].message)) == 1


@pytest.mark.real_model
def test_tool_choice_auto_and_none(client, model):
    for seed in range(3):
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="auto",
                                           temperature=0.9, seed=seed, max_tokens=200)
        m = r.choices[0].message
        if m.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls" and valid_calls(m)
        else:
            assert isinstance(m.content, str) and r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.real_model
def test_history_with_calls_and_results_is_accepted(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=60, temperature=0)
    assert r.choices[0].message.content or valid_calls(r.choices[0].message)
    alone = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens  # the call and its result are in the prompt


@pytest.mark.real_model
def test_streamed_tool_calls_through_the_stream_helpers(client, model):
    with client.chat.completions.stream(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                        temperature=0) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    assert final.choices[0].finish_reason == "tool_calls" and valid_calls(final.choices[0].message)
    plain = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0)
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]


@pytest.mark.real_model
def test_parse_with_a_pydantic_tool(client, model):
    import openai
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=40)
        unit: str

    r = client.chat.completions.parse(model=model, messages=ASK, tools=[openai.pydantic_function_tool(Weather)],
                                      tool_choice="required", temperature=0)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Weather) and parsed.city


@pytest.mark.real_model
def test_chat_logprobs_sorted_and_bounded(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert sum(math.exp(v) for v in tops) <= 1 + 1e-6
        assert e.logprob <= 0 and math.isclose(e.logprob, tops[0], abs_tol=1e-6)  # greedy took the likeliest
        assert bytes(e.bytes).decode("utf-8", "replace") or e.token
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in entries) == r.choices[0].message.content
    raw = httpx.post(str(client.base_url) + "chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4,
        "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"}}, timeout=60)
    assert raw.headers["x-nodeagent-logprobs"] == "grammar-masked"  # said which distribution they are from


@pytest.mark.real_model
def test_completions_echo_scores_a_text_and_n_is_honoured(client, model):
    text = "The capital of France is Paris."
    r = client.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=1, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and all(c.text for c in r.choices)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say a word."}], n=3,
                                       max_tokens=6, temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content is not None for c in r.choices) and r.usage.completion_tokens >= 3
    streamed = list(client.completions.create(model=model, prompt="One, two,", max_tokens=5, temperature=0,
                                              stream=True))
    plain = client.completions.create(model=model, prompt="One, two,", max_tokens=5, temperature=0)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text


@pytest.mark.real_model
def test_logprobs_equal_llama_cpps_log_softmax(client, model, smollm2_path):
    """Greedy decoding without a grammar: each token's log-probability is llama.cpp's log-softmax of the logits
    of the same tokens, computed here through llama-cpp-python alone."""
    import ctypes

    import llama_cpp
    import numpy as np

    from nodeagent.backends.llamacpp import open_llama
    from nodeagent.planner.types import Settings

    prompt = "The three primary colours are"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    got = r.choices[0].logprobs.token_logprobs
    plan = json.loads(cli(["plan", str(smollm2_path), *DOOR_FLAGS, "--json"], {}).stdout)
    llm = open_llama(Settings(**plan["settings"]))  # the server's own settings: the same logits
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        generated = []
        for _ in range(len(got)):
            llm.reset()
            llm.eval(tokens + generated)
            row = llama_cpp.llama_get_logits(llm.ctx)  # the last token's logits (the batch's only output row)
            logits = np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)),
                                           shape=(llm.n_vocab(),)).astype(np.float64)
            logsm = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            generated.append(int(np.argmax(logsm)))
            want = float(logsm[generated[-1]])
            assert abs(got[len(generated) - 1] - want) < 1e-4, (got, want)
        assert llm.detokenize(generated).decode("utf-8", "replace") == r.choices[0].text
    finally:
        llm.close()


def test_every_refused_and_unknown_field_is_a_400_that_names_it(tmp_path):
    """Driven by the field table, so a new OpenAI field cannot slip in as silently ignored."""
    server = Served("fake", {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c.toml")})
    values = {"audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"],
              "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
              "moderation": True, "functions": [{"name": "f"}], "function_call": "auto", "suffix": " end"}
    try:
        for route, table, base in (("/v1/chat/completions", CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
                                   ("/v1/completions", COMPLETIONS, {"prompt": "hi"})):
            refused = list(table.refused)
            assert refused
            for name in refused:
                err = json_error(httpx.post(server.url + route, json={**base, name: values[name]}, timeout=30), 400)
                assert err["param"] == name and name in err["message"], (route, name, err)
                for harmless in table.harmless.get(name, ()):  # the one value that changes nothing is accepted
                    ok = httpx.post(server.url + route, json={**base, name: harmless, "max_tokens": 4}, timeout=30)
                    assert ok.status_code == 200, ok.text
            err = json_error(httpx.post(server.url + route, json={**base, "no_such_field": 1}, timeout=30), 400)
            assert err["param"] == "no_such_field" and err["code"] == "unknown_parameter"
            for name in sorted(table.ignored):
                ok = httpx.post(server.url + route, json={**base, name: "x" if name != "metadata" else {"a": "b"},
                                                          "max_tokens": 4}, timeout=30)
                assert ok.status_code == 200, (name, ok.text)
        err = json_error(httpx.post(server.url + "/v1/chat/completions", json={
            "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, timeout=30), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        err = json_error(httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=30), 400)
        assert err["code"] == "wrong_model_kind" and "needs an embedding model" in err["message"]
        openapi = httpx.get(server.url + "/openapi.json", timeout=30).json()
        assert "HTTPValidationError" not in json.dumps(openapi)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, smollm2_qwen_template):
    """A server whose model's template takes tools and writes <tool_call> (Qwen 2.5's, on SmolLM2's weights)."""
    import openai

    home = tmp_path_factory.mktemp("hermes-door")
    server = Served(str(smollm2_qwen_template), {"NODEAGENT_HOME": str(home),
                                                 "NODEAGENT_CONFIG": str(home / "c.toml")}, "--ctx", "4096")
    yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.stop()


@pytest.mark.real_model
def test_hermes_template_gets_the_tools_and_writes_enforced_calls(hermes):
    server, client = hermes
    model = client.models.list().data[0].id
    raw = client.chat.completions.with_raw_response.create(model=model, messages=ASK, tools=TOOLS,
                                                           tool_choice="required", temperature=0)
    notes = raw.headers.get("x-nodeagent-notes", "")
    assert "system prompt" not in notes  # the template took the tools: no built-in instruction
    r = raw.parse()
    assert r.choices[0].finish_reason == "tool_calls" and valid_calls(r.choices[0].message)
    # the call and its result render through the template (the prompt grows by both)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}]
    again = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=40,
                                           temperature=0)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens
    m = again.choices[0].message
    assert m.content or valid_calls(m)
    import openai

    for seed in range(2):  # auto: text, or a call that is enforced once it starts; streamed the same way
        with client.chat.completions.stream(model=model, messages=ASK, tools=TOOLS, tool_choice="auto",
                                            temperature=0.8, seed=seed, max_tokens=200) as stream:
            try:
                list(stream)
                final = stream.get_final_completion()
            except openai.LengthFinishReasonError as exc:  # text to the limit: the helper refuses to parse it
                final = exc.completion
        m = final.choices[0].message
        if m.tool_calls:
            assert final.choices[0].finish_reason == "tool_calls" and valid_calls(m)
            assert "<tool_call>" not in (m.content or "")
        else:
            assert isinstance(m.content, str)


@pytest.mark.real_model
def test_response_format_takes_what_extraction_takes_and_says_what_was_relaxed(client, model):
    """One schema path: uniqueItems (every pydantic set) and a lookaround pattern, which the decoder cannot
    hold, are left to the final validation; the notes header and system_fingerprint say so."""
    schema = {"type": "object", "required": ["colours"], "properties": {"colours": {
        "type": "array", "uniqueItems": True, "maxItems": 3,
        "items": {"type": "string", "maxLength": 20, "pattern": "^(?!x)"}}}}
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "List three colours as JSON."}], max_tokens=80,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    notes = json.loads(raw.headers["x-nodeagent-notes"])
    assert any("uniqueItems" in n for n in notes) and any("pattern" in n for n in notes)
    r = raw.parse()
    assert r.system_fingerprint == "nodeagent-relaxed"
    assert validate_output(schema, json.loads(r.choices[0].message.content)) is None


@pytest.mark.real_model
def test_foreign_token_ids_fail_alone_with_a_400(client, model, door):
    """A prompt's ids and logit_bias keys past the vocabulary (SmolLM2's 49152), at 2**32 and negative, sent at
    once beside good requests: each bad one a 400 naming its field and the id, every good one answered, and the
    model answers afterwards (the one check of a client's ids: tasks/runner.py's token_ids)."""
    import openai

    ask = [{"role": "user", "content": "Say hi."}]
    bad = [lambda: client.completions.create(model=model, prompt=[1, 49152], max_tokens=2),
           lambda: client.completions.create(model=model, prompt=[2**32 + 5], max_tokens=2),
           lambda: client.chat.completions.create(model=model, messages=ask, max_tokens=2, logit_bias={"49152": 5}),
           lambda: client.chat.completions.create(model=model, messages=ask, max_tokens=2,
                                                  logit_bias={str(2**32 + 7): 5})]
    good = [lambda: client.chat.completions.create(model=model, messages=ask, max_tokens=3, temperature=0),
            lambda: client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2, temperature=0)]
    out: list = [None] * (len(bad) + len(good))

    def one(i: int, fn) -> None:
        try:
            out[i] = fn()
        except openai.APIStatusError as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i, fn)) for i, fn in enumerate(bad + good)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, (token, field) in zip(out, [(49152, "prompt"), (2**32 + 5, "prompt"), (49152, "logit_bias"),
                                         (2**32 + 7, "logit_bias")]):
        assert isinstance(got, openai.BadRequestError), got
        assert f"{field}: token {token} is not in the model's vocabulary (0-49151)" in got.message, got.message
    assert all(not isinstance(x, Exception) and x.choices for x in out[len(bad):]), out[len(bad):]
    again = client.chat.completions.create(model=model, messages=ask, max_tokens=3, temperature=0)
    assert again.choices[0].message.content
