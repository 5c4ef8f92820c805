"""The MLX backend on a tiny model made here (random weights, a tokenizer built with `tokenizers`).

Runs on Linux with mlx[cpu]; on Apple Silicon the same code runs on Metal.
Constrained decoding must give schema-valid output even from random weights.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# The test extra installs MLX on Linux (mlx[cpu]) and on Apple Silicon: there a missing MLX is a failure, never
# a silent skip. Only a platform MLX does not support at all skips, and says so.
if sys.platform == "linux" or (sys.platform == "darwin" and platform.machine() == "arm64"):
    import mlx.core as mx  # noqa: F401
else:  # pragma: no cover
    pytest.skip(f"MLX does not run on {sys.platform}/{platform.machine()}", allow_module_level=True)

from mlxgen import make_tiny_mlx_model  # noqa: E402

from nodeagent.backends.mlx import MlxBackend  # noqa: E402
from nodeagent.config import resolve  # noqa: E402
from nodeagent.errors import BackendError, NotFoundError, SettingError  # noqa: E402
from nodeagent.modelfile.mlx import read_model_info  # noqa: E402
from nodeagent.node import Node  # noqa: E402
from nodeagent.planner import Requirements  # noqa: E402
from nodeagent.planner.mlx import kv_bytes, plan_mlx  # noqa: E402
from nodeagent.profiles import get_profile  # noqa: E402
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask  # noqa: E402
from nodeagent.tasks.decoding.decoder import DecodeSpec  # noqa: E402
from nodeagent.tasks.runner import TaskRunner  # noqa: E402
from nodeagent.tasks.schema import validate_output  # noqa: E402


def load(path, n_ctx, kv="f16"):
    """The tiny model through the node core: planned with these settings, loaded by MlxBackend.load(plan)."""
    node = Node(str(path), config=resolve(env={}), ctx_tokens=n_ctx, type_k=kv, type_v=kv)
    assert node.plan.backend == "mlx"
    return MlxBackend().load(node.plan)

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 120}}},
    {"type": "object", "additionalProperties": False, "required": ["order", "items"],
     "properties": {"order": {"type": "object", "required": ["status"], "additionalProperties": False,
                              "properties": {"status": {"enum": ["open", "shipped"]}}},
                    "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "required": ["qty"],
                                                                        "additionalProperties": False,
                                                                        "properties": {"qty": {"type": "integer",
                                                                                               "minimum": 1,
                                                                                               "maximum": 9}}}},
                    "score": {"type": "number", "minimum": 0, "maximum": 1}}},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_mlx_model(tmp_path_factory.mktemp("mlx") / "tiny")


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
def test_constrained_output_is_schema_valid_from_random_weights(tiny, kv):
    with load(tiny, 2048, kv) as model:
        runner = TaskRunner(model.session(), model="tiny", backend="mlx")
        for schema in SCHEMAS:
            for text in ("Alice is 34.", "?", "Zoë «quoted» \"text\" 王芳"):
                r = runner.run(ExtractTask(input=text, schema=schema))
                assert r.status == "ok", r.error
                assert validate_output(schema, r.output) is None
                assert r.backend == "mlx"


def test_forced_tokens_go_to_mlx_in_one_call(tiny):
    """fast_forward on MLX: the grammar's forced tokens are evaluated with the sampled token in one call."""
    with load(tiny, 2048) as model:
        session = model.session()
        calls: list[int] = []
        inner = session.eval
        session.eval = lambda tokens: (calls.append(len(tokens)), inner(tokens))[1]
        steps = {}
        for fast in (False, True):
            calls.clear()
            r = TaskRunner(session, model="tiny", backend="mlx", decoding=DecodeSpec(fast_forward=fast)).run(
                ExtractTask(input="Alice is 34.", schema=SCHEMAS[1]))
            assert r.status == "ok" and validate_output(SCHEMAS[1], r.output) is None, r.error
            steps[fast] = calls[1:]  # after the prompt's
        assert all(n == 1 for n in steps[False]) and max(steps[True]) > 3
        assert len(steps[True]) < 0.8 * len(steps[False])


def test_label_scoring(tiny):
    with load(tiny, 1024) as model:
        runner = TaskRunner(model.session(), backend="mlx")
        task = ClassifyTask(input="great!", labels=["positive", "pos", "negative"])
        a, b = runner.run(task), runner.run(task)  # the second reuses the cached prompt
        p = a.output.probabilities
        assert abs(sum(p.values()) - 1) < 1e-9 and p["positive"] != p["pos"]
        assert a.output.probabilities == pytest.approx(b.output.probabilities, abs=1e-4)


def test_model_without_template_gets_the_fallback_its_vocabulary_names(tiny):
    with load(tiny, 1024) as model:
        session = model.session()
        assert session.has_token("<|im_start|>") and not session.has_token("<start_of_turn>")
        session.chat_template = None
        r = TaskRunner(session, backend="mlx").run(ClassifyTask(input="great!", labels=["positive", "negative"]))
    assert r.status == "ok"
    assert r.notes == ["fallback chat template (ChatML): the model has none; "
                       "its vocabulary has <|im_start|> and <|im_end|>"]


def test_kv_prediction_matches_mlx_cache(tiny):
    info = read_model_info(tiny)
    for kv in ("f16", "q8_0", "q4_0"):
        with load(tiny, 1024, kv) as model:
            s = model.session()
            s.eval(list(range(3, 259)))  # 256 tokens
            from mlx.utils import tree_flatten

            actual = sum(x.nbytes for c in s.cache for _, x in tree_flatten(c.state) if hasattr(x, "nbytes"))
            # mlx-lm grows its cache in steps of 256 tokens: 256 tokens fill exactly one step
            assert actual == kv_bytes(info, 256, kv), kv


def test_plan_mlx_for_apple_and_here(tiny):
    info = read_model_info(tiny)
    assert info.weights_bytes == os.path.getsize(tiny / "model.safetensors") - 8 - \
        int.from_bytes((tiny / "model.safetensors").read_bytes()[:8], "little")
    m2 = get_profile("apple-m2-pro-16gb")
    p = plan_mlx(info, m2.nominal_hardware(), m2, Requirements(task="extract"), overhead_bytes=50 << 20)
    assert p.fits and p.settings.n_gpu_layers == -1 and p.memory.weights_gpu_bytes == info.weights_bytes
    big = info.model_copy(update={"n_layers": 28, "n_kv_heads": 4, "head_dim": 128, "weights_bytes": 4_300_000_000,
                                  "dtype_bytes": 2,
                                  "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944})
    m1 = get_profile("apple-m1-8gb")
    p = plan_mlx(big, m1.nominal_hardware(), m1, Requirements(min_ctx_tokens=16384), overhead_bytes=50 << 20)
    # smaller prefill chunks before a quantized cache: at 16k, f16 fits with 256-token chunks
    assert p.fits and p.settings.type_k == "f16" and p.settings.n_batch < 512
    with pytest.raises(SettingError, match="maximum of 16384"):  # the profile's max_ctx_tokens holds for MLX too
        plan_mlx(big, m1.nominal_hardware(), m1, Requirements(min_ctx_tokens=32768), overhead_bytes=50 << 20)
    p = plan_mlx(big, m1.nominal_hardware(), m1, Requirements(min_ctx_tokens=32768, allow_ctx_over_profile=True),
                 overhead_bytes=50 << 20)
    assert p.fits and p.settings.type_k in ("q8_0", "q4_0")  # 1.75 GiB of f16 KV does not fit the working set
    assert any("allowed by --allow-ctx-over-profile" in r for r in p.reasons)


def test_bad_model_dir(tmp_path):
    with pytest.raises(NotFoundError, match="not an mlx-lm model directory"):
        read_model_info(tmp_path)


def test_quantized_cache_needs_group_divisible_head(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 48, "num_attention_heads": 3,
           "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    plan = Node(str(tmp_path), config=resolve(env={}), ctx_tokens=512, type_k="f16", type_v="f16").plan
    settings = plan.settings.model_copy(update={"type_k": "q8_0", "type_v": "q8_0"})
    with pytest.raises(BackendError, match="divisible by 32"):
        MlxBackend().load(plan.model_copy(update={"settings": settings}))


def test_cli_run_on_mlx(tiny, isolated_env):
    proc = subprocess.run([sys.executable, "-m", "nodeagent", "run", "classify", "--model", str(tiny), "--labels",
                           "spam,ham", "--text", "free money", "--ctx", "512", "--json"], capture_output=True,
                          text=True, env={**os.environ, **isolated_env})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["backend"] == "mlx" and set(out["output"]["probabilities"]) == {"spam", "ham"}


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_a_restored_prefix_answers_as_the_prefix_kept_in_memory_on_mlx(tiny, kv, tmp_path):
    """Warm prefixes on MLX (mlx-lm's prompt-cache files): a node reads two tickets under the same instructions
    (the prefix recurs: stored) and a third with the prefix kept in memory; a new node on the same directory (a
    restart) reads the third with the prefix read back from disk: the same output and the same tokens, at
    temperature 0. A node of another KV type reads nothing stored (another key)."""
    instructions = ("You read support tickets for a hardware shop and fill in the form. " * 8).strip()
    tickets = ["My Pi 5 will not boot since this morning.", "The keyboard has a sticky space bar.",
               "Order 5512: the SD card arrived cracked."]

    def node_of(kv_type: str) -> Node:
        return Node(str(tiny), config=resolve(env={"NODEAGENT_PREFIX_DIR": str(tmp_path / "prefixes")}),
                    ctx_tokens=1024, type_k=kv_type, type_v=kv_type)

    def extracted(node: Node, ticket: str):
        result = node.extract(ticket, SCHEMAS[0], instructions=instructions)
        assert result.status == "ok", result.error
        return result

    with node_of(kv) as first:
        first.load()
        store = first.prefix_store(wait_s=30)
        assert store is not None and store.key.backend.startswith("mlx-lm ")
        extracted(first, tickets[0])
        extracted(first, tickets[1])
        warm = extracted(first, tickets[2])
        store.flush()
        held = store.usage()
        assert held["prefixes"] == 1 and held["written"] == 1 and held["restored"] == 0, held
        assert next((tmp_path / "prefixes").rglob("*.kv")).read_bytes().split(b"\n", 1)[1][8:9] == b"{"  # safetensors
    with node_of(kv) as second:
        second.load()
        store = second.prefix_store(wait_s=30)
        restored = extracted(second, tickets[2])
        usage = second.prefix_usage()
        assert usage["restored"] == 1 and usage["refused"] == 0 and usage["written"] == 0, usage
        assert restored.output == warm.output and restored.tokens == warm.tokens
    other_kv = "q4_0" if kv == "q8_0" else "q8_0"
    with node_of(other_kv) as other:
        other.load()
        store = other.prefix_store(wait_s=30)
        assert extracted(other, tickets[2]).status == "ok"
        assert store.tally.restored == 0 and store.key.kv_types == f"{other_kv}/{other_kv}"
