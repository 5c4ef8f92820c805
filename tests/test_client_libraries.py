"""The OpenAI door through the client libraries orchestrators already use, each in its default mode and the
modes an extraction pipeline picks: LangChain (``bind_tools``; ``with_structured_output`` by json_schema,
function_calling and json_mode), instructor (TOOLS, JSON_SCHEMA, JSON, MD_JSON), pydantic-ai (an Agent with a
pydantic ``output_type`` in its default tool output mode, and with ``NativeOutput``) and LiteLLM (tools and
``response_format``), against a real server on SmolLM2.

instructor pins an older jiter than the openai release the rest of the suite uses, so it runs from its own
environment (``.venv-instructor``, which ``scripts/test`` builds) in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, Field
from test_server import Served

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[1]
TEXT = "Alice Martin is 34 years old and lives in Lyon."


class Person(BaseModel):
    """A person named in the text."""

    name: str = Field(description="The person's full name", max_length=40)
    age: int = Field(description="Age in years", ge=0, le=130)


def get_weather(city: str, unit: str = "celsius") -> str:
    """The current weather in a city.

    Args:
        city: the city's name
        unit: celsius or fahrenheit
    """
    return f"21 degrees {unit} in {city}"


@pytest.fixture(scope="module")
def door(tmp_path_factory, smollm2_path):
    home = tmp_path_factory.mktemp("libs")
    server = Served(str(smollm2_path), {"NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml")},
                    "--ctx", "8192", "--slots", "2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(door):
    import httpx

    return httpx.get(door.url + "/v1/models").json()["data"][0]["id"]


def person_ok(p: Person) -> None:
    assert isinstance(p, Person) and p.name.strip() and 0 <= p.age <= 130


# -- LangChain ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat(door, model):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=door.url + "/v1", api_key="unused", temperature=0, max_retries=0)


def test_langchain_bind_tools(chat):
    from langchain_core.tools import tool

    weather = tool(get_weather)
    ai = chat.bind_tools([weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert len(ai.tool_calls) >= 1
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"]
    assert set(call["args"]) <= {"city", "unit"}
    assert weather.invoke(call["args"])  # the arguments are the function's own
    ai = chat.bind_tools([weather]).invoke("What is the weather in Paris?")  # the default: auto
    assert ai.tool_calls or ai.content
    for c in ai.tool_calls:
        assert c["name"] == "get_weather" and "city" in c["args"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(chat, method):
    structured = chat.with_structured_output(Person, method=method)
    prompt = f"Extract the person as JSON with the keys name and age. Text: {TEXT}"
    person_ok(structured.invoke(prompt))


def test_langchain_default_structured_output(chat):
    person_ok(chat.with_structured_output(Person).invoke(f"Extract the person. Text: {TEXT}"))


# -- instructor (its own environment) ----------------------------------------------------------------------------
INSTRUCTOR = ROOT / ".venv-instructor" / "bin" / "python"


def instructor_person(url: str, model: str, mode: str, retries: int = 1, **create: object) -> dict:
    """instructor, from its own environment, extracting the Person of TEXT through the door at ``url`` in ``mode``
    (``create``: more arguments of its create call): ``{"person": ...}``, ``{"api_error": ...}`` or
    ``{"content_error": ...}`` (instructor's verdict on the model's content)."""
    assert INSTRUCTOR.exists(), "scripts/test builds .venv-instructor (instructor's own environment)"
    extra = "".join(f", {k}={v!r}" for k, v in create.items())
    script = textwrap.dedent(f"""
        import json, instructor, openai
        from pydantic import BaseModel, Field
        class Person(BaseModel):
            name: str = Field(description="The person's full name", max_length=40)
            age: int = Field(description="Age in years", ge=0, le=130)
        client = instructor.from_openai(openai.OpenAI(base_url={url + '/v1'!r}, api_key="unused",
                                                      max_retries=0), mode=instructor.Mode.{mode})
        try:
            p = client.chat.completions.create(model={model!r}, response_model=Person, temperature=0,
                max_retries={retries}{extra},
                messages=[{{"role": "user", "content": "Extract the person. Text: {TEXT}"}}])
            print(json.dumps({{"person": p.model_dump()}}))
        except openai.APIError as exc:
            print(json.dumps({{"api_error": str(exc)}}))
        except Exception as exc:  # instructor's verdict on the model's content
            print(json.dumps({{"content_error": type(exc).__name__}}))
    """)
    proc = subprocess.run([str(INSTRUCTOR), "-c", script], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "JSON", "MD_JSON"])
def test_instructor_modes(door, model, mode):
    """TOOLS (instructor's default), JSON_SCHEMA and JSON reach the decoder as a tool call or a response format,
    so the answer is the model's, valid. MD_JSON sends neither (a system prompt asks for a markdown code block):
    nothing reaches the server to enforce, so whether SmolLM2 writes the block is the model's; the door must
    serve every request of it (no API error), and a failure must be instructor's verdict on the content."""
    out = instructor_person(door.url, model, mode)
    assert "api_error" not in out, out
    if mode == "MD_JSON" and "content_error" in out:
        assert out["content_error"] in ("InstructorRetryException", "IncompleteOutputException", "ValidationError")
        return
    person_ok(Person.model_validate(out["person"]))


# -- pydantic-ai --------------------------------------------------------------------------------------------------
def _agent(door, model, output_type):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    llm = OpenAIChatModel(model, provider=OpenAIProvider(base_url=door.url + "/v1", api_key="unused"))
    return Agent(llm, output_type=output_type, model_settings={"temperature": 0.0})


def test_pydantic_ai_default_tool_output(door, model):
    result = _agent(door, model, Person).run_sync(f"Extract the person. Text: {TEXT}")
    person_ok(result.output)
    calls = [p for m in result.all_messages() for p in getattr(m, "parts", []) if p.part_kind == "tool-call"]
    assert calls, "the default output mode answers through a tool call"


def test_pydantic_ai_native_output(door, model):
    from pydantic_ai import NativeOutput

    person_ok(_agent(door, model, NativeOutput(Person)).run_sync(f"Extract the person. Text: {TEXT}").output)


# -- LiteLLM ------------------------------------------------------------------------------------------------------
def test_litellm_tools_and_response_format(door, model):
    import litellm

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
    base = {"model": f"openai/{model}", "api_base": door.url + "/v1", "api_key": "unused", "temperature": 0}
    r = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[weather],
                           tool_choice="required", **base)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert r.choices[0].finish_reason == "tool_calls"
    r = litellm.completion(messages=[{"role": "user", "content": f"Extract the person. Text: {TEXT}"}],
                           response_format=Person, **base)
    person_ok(Person.model_validate_json(r.choices[0].message.content))

