"""Rerank (rerank.v1 and /v1/rerank) by both routes, against llama-cpp-python computing the same on the same model:
a generator's yes/no answer (SmolLM2 and Gemma 3: its logits after the prompt) and a cross-encoder's rank pooling (a
reranker written from all-MiniLM-L6-v2's weights with a classification head added, ``ggufgen.as_reranker``: no
reranker's weights ship on the package index). Through `serve` and through the gateway with a worker killed while
it holds the task; the refused fields, each beside good requests."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest
from conftest import cli
from ggufgen import as_reranker
from test_gateway import on_redis
from test_server import Served, json_error

from nodeagent.config import resolve
from nodeagent.node import Node
from nodeagent.tasks.contracts import RerankOutput, RerankTask
from nodeagent.tasks.prompts import rerank_messages

pytestmark = pytest.mark.real_model
QUERY = "How do cats keep themselves clean?"
DOCUMENTS = ["Cats spend hours licking their fur to keep it clean.", "The central bank raised interest rates again.",
             "A striker scored twice in the cup final.", "Cats groom each other and wash their faces with their paws.",
             "Ein Hund läuft im Park."]


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory, minilm_path):
    return as_reranker(minilm_path, tmp_path_factory.mktemp("reranker") / "minilm-reranker.gguf")


def env_of(tmp_path) -> dict:
    return {"NODEAGENT_HOME": str(tmp_path / "home"), "NODEAGENT_CONFIG": str(tmp_path / "c.toml")}


def sigmoid(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-x)))


def yes_no_reference(path, head: list[int], prompts: list[list[int]]) -> list[float]:
    """llama-cpp-python's own: for each prompt, the head evaluated afresh, then the prompt's rest in a batch of its
    own (as the node splits it), and P(yes) of the pair "yes" / "no" from the last logits."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=2048, logits_all=True, flash_attn=True, verbose=False)  # (as the node's plan)
    yes, no = (llm.tokenize(w, add_bos=False, special=False)[0] for w in (b"yes", b"no"))
    out = []
    for tokens in prompts:
        assert tokens[:len(head)] == head
        llm.reset()
        llm._ctx.kv_cache_clear()  # afresh: no cell of the previous prompt left
        llm.eval(head)
        llm.eval(tokens[len(head):])
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        out.append(sigmoid(logits[yes] - logits[no]))
    return out


def rank_reference(path, query: str, documents: list[str], template: str | None = None) -> list[float]:
    """llama-cpp-python's own rank pooling: the pairs ([CLS] query [SEP] document [SEP], as BERT's tokenizer builds
    a pair; or ``template`` filled, its special tokens read, as llama-server frames a pair where the GGUF has a
    rerank template) decoded together in one batch, a sequence each, as its ``Llama.embed`` packs inputs, in a
    context made with pooling rank and the node's plan; each pooled score through a logistic (one output), or the
    first of a softmax of its outputs (several)."""
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, n_ctx=512, n_batch=512,
                n_ubatch=512, n_seq_max=256, flash_attn=True, verbose=False)  # (as the node's plan)
    n_out = llama_cpp.llama_model_n_cls_out(llm._model.model)
    q = llm.tokenize(query.encode())
    llm._batch.reset()
    llm._ctx.kv_cache_clear()
    for i, d in enumerate(documents):
        if template is None:
            tokens = q + llm.tokenize(d.encode())[1:]
            assert tokens[0] == 101 and tokens[len(q) - 1] == 102 and tokens[-1] == 102  # [CLS] q [SEP] d [SEP]
        else:
            filled = template.split("{query}")[0] + query + template.split("{query}")[1].replace("{document}", d)
            tokens = llm.tokenize(filled.encode(), add_bos=False, special=True)
        llm._batch.add_sequence(tokens, i, True)
    llm._ctx.decode(llm._batch)
    out = [np.array(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, i)[:n_out], dtype=np.float64)
           for i in range(len(documents))]
    return [sigmoid(o[0]) if n_out == 1 else float(np.exp(o[0]) / np.exp(o).sum()) for o in out]


# a pair's score while its forward batch holds other requests' pairs (flash attention sums over a batch of another
# shape): within this of the score alone (up to 2e-4 seen here), where one task alone is within 1e-4
SHARED = 1e-3


def scores_of(output: RerankOutput) -> list[float]:
    """The scores in the documents' order."""
    by_index = {r.index: r.relevance_score for r in output.results}
    return [by_index[i] for i in range(len(by_index))]


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_a_generators_scores_equal_llama_cpp_pythons_own_yes_no_logits(which, request):
    path = request.getfixturevalue(f"{which}_path")
    task = RerankTask(query=QUERY, documents=DOCUMENTS)
    with Node(str(path), config=resolve(env={})) as node:
        node.extract("Ann is 3.", {"type": "object", "properties": {"age": {"type": "integer"}}})  # (cells before)
        result = node.rerank(QUERY, DOCUMENTS)
        assert result.status == "ok", result.error
        head, prompts = node.runner().rerank_prompts(task, [])
        top = node.rerank(QUERY, DOCUMENTS, top_n=2)
        alone = [node.rerank(QUERY, [d]).output.results[0].relevance_score for d in reversed(DOCUMENTS)][::-1] \
            if which == "smollm2" else scores_of(result.output)  # (the head's reading is the model's: one is enough)
    if which == "smollm2":  # the prompt as llama-cpp-python renders the model's own template
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        llm = Llama(str(path), n_ctx=256, verbose=False, vocab_only=True)
        render = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token="<|im_end|>",
                                     bos_token="<|im_start|>")
        assert prompts == [llm.tokenize(render(messages=rerank_messages(task, d)).prompt.encode(), add_bos=False,
                                        special=True) for d in DOCUMENTS]
    ref = yes_no_reference(path, head, prompts)
    ours = scores_of(result.output)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= 1e-4, (ours, ref)
    assert alone == ours  # a document's score is its own: not the documents' order, nor what the slot read before
    assert [r.relevance_score for r in result.output.results] == sorted(ours, reverse=True)
    assert top.output.results == result.output.results[:2]
    assert result.tokens.prompt == sum(map(len, prompts)) and "P(yes)" in " ".join(result.notes)


def test_a_rerankers_scores_equal_llama_cpp_pythons_own_rank_pooling(reranker_path):
    """The pairs of several tasks share forward batches, and each score is its pair's alone; an embedding task on
    a reranker, and an instruction (a generator's), are said."""
    ref = rank_reference(reranker_path, QUERY, DOCUMENTS)
    assert max(ref) - min(ref) > 0.05  # the head's scores tell the documents apart
    with Node(str(reranker_path), config=resolve(env={})) as node:
        assert node.kind == "rerank" and node.plan.settings.pooling == "rank"
        alone = node.rerank(QUERY, DOCUMENTS)
        assert max(abs(a - b) for a, b in zip(scores_of(alone.output), ref)) <= 1e-4
        assert alone.tokens.prompt == sum(map(len, node.runner().session.pairs(QUERY, DOCUMENTS)))
        results = [None] * 4

        def one(i: int) -> None:
            results[i] = node.rerank(QUERY, DOCUMENTS[i % 2:] if i % 2 else DOCUMENTS)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, result in enumerate(results):
            assert result.status == "ok", result.error
            assert max(abs(a - b) for a, b in zip(scores_of(result.output), ref[i % 2:] if i % 2 else ref)) <= SHARED
        said = node.rerank(QUERY, DOCUMENTS[:2], instruction="Find passages about animals", top_n=1)
        assert len(said.output.results) == 1 and any(n.startswith("instruction:") for n in said.notes), said.notes
        embed = node.embed(["x"])
        assert embed.status == "error" and embed.error.code == "wrong_model_kind"
        assert "is a reranker" in embed.error.message
        long = node.rerank(QUERY, ["word " * 600])
        assert long.error.code == "input_too_long" and "document 0" in long.error.message


def test_a_rerank_template_frames_each_pair_and_a_head_of_two_labels_gives_the_first_ones_probability(
        minilm_path, tmp_path):
    """A reranker whose GGUF has a rerank template (as Qwen3-Reranker's has) reads each pair as the template frames
    it, special tokens parsed and nothing added, as llama-server does; a query that holds "{document}" stays the
    query's text. A head of two labels (yes, no) scores the first label's probability. Both equal llama-cpp-python's
    own on the same tokens to 1e-4."""
    template = "[CLS] query: {query} [SEP] passage: {document} [SEP]"
    path = as_reranker(minilm_path, tmp_path / "templated.gguf", seed=3, labels=["yes", "no"], template=template)
    query = "what is {document} about cats?"
    ref = rank_reference(path, query, DOCUMENTS, template)
    assert max(ref) - min(ref) > 0.01 and all(0 < r < 1 for r in ref)
    with Node(str(path), config=resolve(env={})) as node:
        session = node.runner().session
        pairs = session.pairs(query, DOCUMENTS[:1])
        assert pairs[0][0] == 101 and pairs[0].count(101) == 1 and pairs[0][-1] == 102  # [CLS] read as the token
        text = session.llama.detokenize(pairs[0]).decode().replace(" ", "")  # (WordPiece spaces its tokens)
        assert text.count("{document}") == 1  # the query's own text, the template's placeholder filled once
        result = node.rerank(query, DOCUMENTS)
        assert result.status == "ok", result.error
        assert max(abs(a - b) for a, b in zip(scores_of(result.output), ref)) <= 1e-4
        assert any("probability of its first label" in n for n in result.notes), result.notes


def refused_beside_good(base: str, model: str, ref: list[float]) -> None:
    """Each refused request a 400 in one line naming its field, while good ones run beside it with their scores."""
    bad = [({"query": QUERY, "documents": DOCUMENTS, "rank_fields": ["title"]}, "rank_fields"),
           ({"query": QUERY, "documents": DOCUMENTS, "max_tokens_per_doc": 64}, "max_tokens_per_doc"),
           ({"query": QUERY, "documents": DOCUMENTS, "max_chunks_per_doc": 2}, "max_chunks_per_doc"),
           ({"query": QUERY, "documents": []}, "documents"),
           ({"query": QUERY, "documents": ["fine", "  "]}, "documents"),
           ({"query": "", "documents": DOCUMENTS}, "query"),
           ({"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
           ({"query": QUERY, "documents": DOCUMENTS, "top_n": 10**30}, "top_n"),
           ({"query": QUERY, "documents": [{"text": "a", "title": "b"}]}, "documents"),
           ({"query": QUERY, "documents": ["x"] * 1001}, "documents"),
           ({"query": QUERY, "documents": [7]}, "documents"),
           ({"query": QUERY, "documents": DOCUMENTS, "texts": DOCUMENTS}, "texts")]
    good: list[httpx.Response] = []

    def ask() -> None:
        good.append(httpx.post(base + "/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCUMENTS},
                               timeout=120))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for body, param in bad:
        r = httpx.post(base + "/v1/rerank", json={"model": model, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = json_error(r, 400)
        assert err["param"] == param and "\n" not in err["message"], (body, err)
    for t in threads:
        t.join(120)
    for r in good:
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert max(abs(got[i] - ref[i]) for i in range(len(ref))) <= SHARED


def test_v1_rerank_on_serve_by_both_routes(reranker_path, smollm2_path, minilm_path, tmp_path):
    """One `serve` holding a reranker, a generator and an embedding model: a request naming no model goes to the
    reranker; a generator named reranks by its answer; the embedding model is the wrong kind; llama-server's,
    Jina's and Cohere's shapes (documents as objects, top_n, return_documents)."""
    server = Served(str(reranker_path), env_of(tmp_path), "--model", str(smollm2_path), "--model", str(minilm_path))
    try:
        ref = rank_reference(reranker_path, QUERY, DOCUMENTS)
        plain = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=120)
        body = plain.json()
        assert plain.status_code == 200 and body["model"] == reranker_path.stem, body
        assert [r["index"] for r in body["results"]] == sorted(range(5), key=lambda i: -ref[i])
        assert all("document" not in r for r in body["results"]) and body["usage"]["prompt_tokens"] > 0
        objects = httpx.post(server.url + "/v1/rerank", json={
            "model": reranker_path.stem, "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2,
            "return_documents": True}, timeout=120).json()
        assert [r["document"]["text"] for r in objects["results"]] == [DOCUMENTS[r["index"]]
                                                                       for r in body["results"][:2]]
        refused_beside_good(server.url, reranker_path.stem, ref)
        generator = httpx.post(server.url + "/v1/rerank", json={"model": smollm2_path.stem, "query": QUERY,
                                                                "documents": DOCUMENTS, "top_n": 3}, timeout=120)
        assert generator.status_code == 200 and generator.json()["model"] == smollm2_path.stem, generator.text
        assert len(generator.json()["results"]) == 3
        wrong = httpx.post(server.url + "/v1/rerank", json={"model": minilm_path.stem, "query": QUERY,
                                                            "documents": DOCUMENTS}, timeout=60)
        assert json_error(wrong, 400)["code"] == "wrong_model_kind" and "a reranker" in wrong.json()["error"]["message"]
        nobody = httpx.post(server.url + "/v1/rerank", json={"model": "nope", "query": QUERY, "documents": ["x"]},
                            timeout=60)
        assert json_error(nobody, 404)["code"] == "model_not_found"
        assert httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS},
                          timeout=120).json()["results"] == body["results"]  # the model is well after all of it
    finally:
        server.stop()


def test_the_gateway_reranks_and_a_task_survives_its_worker_killed(reranker_path, tmp_path):
    """Two workers of the reranker behind a gateway on a real Redis: /v1/rerank's scores as llama-cpp-python's, the
    refusals; then a rerank task of many documents whose worker is killed with SIGKILL while it holds it runs again
    on the other, with the same scores."""
    with on_redis(tmp_path, {name: ["--model", str(reranker_path), "--lease", "3"] for name in ("r1", "r2")},
                  env={"NODEAGENT_LEASE_S": "3"}) as fleet:
        ref = rank_reference(reranker_path, QUERY, DOCUMENTS)
        refused_beside_good(fleet.base, reranker_path.stem, ref)
        from nodeagent.fleet.client import Client

        client = Client(fleet.broker)
        many = [f"{DOCUMENTS[i % len(DOCUMENTS)]} (passage {i})" for i in range(1000)]
        task_id = client.submit(RerankTask(query=QUERY, documents=many, top_n=10))
        fleet.kill_holder(task_id)
        result = client.wait(task_id, timeout=180)
        assert result.status == "ok" and result.attempts == 2, result.error
        assert len(result.output.results) == 10
        top = [r.index for r in result.output.results]
        assert max(abs(a - b) for a, b in zip([r.relevance_score for r in result.output.results],
                                              rank_reference(reranker_path, QUERY, [many[i] for i in top]))) <= SHARED


def test_the_cli_plans_and_runs_a_reranker(reranker_path, tmp_path):
    """`plan` reads a reranker's GGUF as one (pooling rank, no KV cache); `run rerank` scores the text's lines (its
    --json the Result); a bad value is one line and exit 2."""
    env = env_of(tmp_path)
    plan = json.loads(cli(["plan", str(reranker_path), "--json"], env).stdout)
    assert plan["settings"]["pooling"] == "rank" and plan["memory"]["kv_bytes"] == 0
    done = cli(["run", "rerank", "--model", str(reranker_path), "--query", QUERY, "--top-n", "2", "--json",
                "--text", "\n".join(DOCUMENTS)], env)
    result = json.loads(done.stdout)
    ref = rank_reference(reranker_path, QUERY, DOCUMENTS)
    assert [r["index"] for r in result["output"]["results"]] == sorted(range(len(ref)), key=lambda i: -ref[i])[:2]
    bad = cli(["run", "rerank", "--model", str(reranker_path), "--query", " ", "--text", "x"], env, check=False)
    assert bad.returncode == 2 and "query" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    bench = cli(["bench", str(reranker_path), "--quick"], env, check=False)  # (it measures generators, embedders)
    assert bench.returncode == 2 and "is a reranker" in bench.stderr and "Traceback" not in bench.stderr, bench.stderr
