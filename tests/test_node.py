"""The node core: one road from settings to a Result, shared by every door; its public Python API; the fake
backend the worker and server tests will drive; and the corrections to how settings reach the planner."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli

from nodeagent.backends.fake import FakeBackend, FakeSession, FakeSpec
from nodeagent.config import resolve
from nodeagent.errors import SettingError, UsageError
from nodeagent.node import Node
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask
from nodeagent.tasks.schema import validate_output

ROOT = Path(__file__).resolve().parent.parent
HARDWARE = Path(__file__).parent / "fixtures" / "hardware"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130}}}


def node(model="fake", **kw) -> Node:
    return Node(model, config=resolve(env={}), **kw)


# -- the documented example (docs/python-api.md), run as written ----------------------------------------------
def readme_example() -> str:
    text = (ROOT / "docs" / "python-api.md").read_text()
    start = text.index("<!-- python-api-example -->")
    block = text[start:].split("```python\n", 1)[1].split("```", 1)[0]
    return block


@pytest.mark.real_model
def test_readme_python_example_runs(isolated_env):
    proc = subprocess.run([sys.executable, "-c", readme_example()], capture_output=True, text=True,
                          env={**os.environ, **isolated_env}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].isdigit()  # the planned context
    assert lines[1] in ("positive", "negative")
    assert json.loads(lines[2].replace("'", '"')).keys() <= {"name", "age"}


# -- the fake backend: the same protocol, made-up logits ------------------------------------------------------
def test_fake_backend_runs_the_real_task_runner_deterministically():
    a, b = node(), node()
    tasks = [ClassifyTask(id=f"t{i}", input=f"text number {i}", labels=["alpha", "beta", "gamma"])
             for i in range(50)]
    first = [a.run(t) for t in tasks]
    second = [b.run(t) for t in tasks]
    assert [r.output.label for r in first] == [r.output.label for r in second]
    assert len({r.output.label for r in first}) > 1  # inputs steer the made-up logits
    assert all(r.status == "ok" and r.backend == "fake" for r in first)
    r = a.run(ExtractTask(input="Alice is 34.", schema=PERSON))
    assert r.status == "ok" and validate_output(PERSON, r.output) is None, r


def test_fake_backend_serves_many_tasks_without_a_model():
    with node("fake:ctx=2048") as n:
        assert n.plan.backend == "fake" and n.plan.settings.n_ctx == 2048
        results = [n.classify(f"item {i}", ["yes", "no"]) for i in range(2000)]
    assert sum(r.status == "ok" for r in results) == 2000


def test_fake_backend_injects_failures_and_latency():
    n = node("fake:fail=[boom],latency_ms=20")
    bad = n.classify("this one goes [boom]", ["a", "b"])
    good = n.classify("this one is fine", ["a", "b"])
    assert bad.status == "error" and bad.error.code == "backend_error" and bad.error.retryable
    assert good.status == "ok" and good.timings.prompt_s >= 0.02
    with pytest.raises(UsageError, match="unknown fake model option"):
        FakeSpec.parse("fake:speed=9")


def test_fake_backend_crash_ends_the_process():
    code = "from nodeagent import Node\nNode('fake:crash=[die]').classify('now [die]', ['a', 'b'])\nprint('alive')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 70 and "alive" not in proc.stdout


# -- the chat-template sandbox's limits: every failure is a template_error result --------------------------------
HOSTILE_TEMPLATES = {
    "string blow-up": "{{ 'ab' * 5000000 }}",
    "power": "{{ 10 ** 20 }}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "endless output": "{% for i in range(99999) %}{{ 'x' * 200 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "a Python error": "{{ messages[0]['content'] | int + 'x' }}",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TEMPLATES))
def test_hostile_chat_template_is_a_template_error_result(case):
    n = node()
    session: FakeSession = n.runner().session
    session.chat_template = HOSTILE_TEMPLATES[case]
    r = n.classify("hello", ["a", "b"])
    assert r.status == "error" and r.error.code == "template_error" and not r.error.retryable, r


# -- settings take one road ---------------------------------------------------------------------------------
def test_flag_variable_and_config_key_plan_alike(tmp_path, smollm2_path):
    by_kw = node(str(smollm2_path), ctx_tokens=1024).plan
    by_env = Node(str(smollm2_path), config=resolve(env={"NODEAGENT_CTX": "1024"})).plan
    assert by_kw.settings == by_env.settings and by_kw.settings.n_ctx == 1024  # exactly, not "at least"


def test_plan_for_a_profile_uses_its_threads_slots_and_overhead(header_7b, isolated_env):
    pi = json.loads(cli(["plan", str(header_7b), "--profile", "rpi5-8gb", "--json"], isolated_env).stdout)
    mac = json.loads(cli(["plan", str(header_7b), "--profile", "apple-m2-pro-16gb", "--json"], isolated_env).stdout)
    assert (pi["settings"]["n_threads"], pi["settings"]["slots"]) == (4, 1)
    assert (mac["settings"]["n_threads"], mac["settings"]["slots"]) == (6, 2)
    assert pi["memory"]["overhead_bytes"] == 64 << 20 and mac["memory"]["overhead_bytes"] == 128 << 20
    assert pi["reasons"][0].startswith("planned for a freshly booted rpi5-8gb")


def test_global_and_local_profile_print_the_same_plan(header_7b, isolated_env):
    for profile in ("rpi5-8gb", "apple-m2-pro-16gb"):
        local = cli(["plan", str(header_7b), "--profile", profile, "--json"], isolated_env).stdout
        glob = cli(["--profile", profile, "plan", str(header_7b), "--json"], isolated_env).stdout
        env = cli(["plan", str(header_7b), "--json"], {**isolated_env, "NODEAGENT_PROFILE": profile}).stdout
        assert json.loads(local) == json.loads(glob) == json.loads(env)


def test_fixed_batch_is_honoured(smollm2_path, isolated_env):
    p = json.loads(cli(["plan", str(smollm2_path), "--batch", "128", "--json"], isolated_env).stdout)
    assert p["settings"]["n_batch"] == 128 and p["settings"]["n_ubatch"] <= 128
    proc = cli(["plan", str(smollm2_path), "--batch", "128", "--ubatch", "256"], isolated_env, check=False)
    assert proc.returncode == 2 and "--ubatch 256 is larger than --batch 128" in proc.stderr


def test_min_ctx_is_never_undercut(smollm2_path, isolated_env):
    proc = cli(["plan", str(smollm2_path), "--min-ctx", "16384"], isolated_env, check=False)
    assert proc.returncode == 2 and "--min-ctx 16384 is larger than the 8192 tokens" in proc.stderr
    p = json.loads(cli(["plan", str(smollm2_path), "--min-ctx", "3000", "--json"], isolated_env).stdout)
    assert p["settings"]["n_ctx"] >= 3000


def test_min_ctx_that_does_not_fit_is_not_shortened(header_7b, isolated_env):
    p = json.loads(cli(["plan", str(header_7b), "--profile", "rpi4-4gb", "--min-ctx", "8192", "--json"],
                       isolated_env).stdout)
    assert not p["fits"] and p["settings"]["n_ctx"] >= 8192


def test_gpu_layers_without_offload_is_refused(smollm2_path, isolated_env):
    proc = cli(["plan", str(smollm2_path), "--profile", "rpi5-8gb", "--gpu-layers", "10"], isolated_env, check=False)
    assert proc.returncode == 2 and "no GPU offload" in proc.stderr and "Traceback" not in proc.stderr
    p = json.loads(cli(["plan", str(smollm2_path), "--profile", "rpi5-8gb", "--gpu-layers", "0", "--json"],
                       isolated_env).stdout)
    assert p["memory"]["gpu_bytes"] == 0


def test_profile_max_context_needs_an_override(header_7b, isolated_env):
    proc = cli(["plan", str(header_7b), "--profile", "rpi5-8gb", "--ctx", "32768"], isolated_env, check=False)
    assert proc.returncode == 2 and "maximum of 16384" in proc.stderr and "--allow-ctx-over-profile" in proc.stderr
    p = json.loads(cli(["plan", str(header_7b), "--profile", "apple-m2-pro-16gb", "--ctx", "65536",
                        "--allow-ctx-over-profile", "--json"], isolated_env).stdout)
    s = p["settings"]  # the context is each slot's: n_ctx holds the cells of all of them
    assert s["n_ctx"] == 65536 * s["slots"] and any("allowed by --allow-ctx-over-profile" in r for r in p["reasons"])


def test_a_plan_for_another_device_is_not_loaded_here(smollm2_path):
    n = node(str(smollm2_path), profile="rpi5-8gb", hardware_fixture=str(HARDWARE / "linux-x86-container.json"))
    assert not n.device.here
    with pytest.raises(UsageError, match="not this machine"):
        n.load()


def test_unknown_node_setting_is_refused():
    with pytest.raises(UsageError, match="unknown setting ctx"):
        Node("fake", config=resolve(env={}), ctx=3)
    with pytest.raises(SettingError, match="--ubatch 64 is larger than --batch 32"):
        node(str(ROOT / "tests" / "fixtures" / "none.gguf"), batch=32, ubatch=64).plan if False else \
            node("fake").plan and _plan_gguf_with(batch=32, ubatch=64)


def _plan_gguf_with(**settings):
    from conftest import _models_dir

    return node(str(_models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"), **settings).plan


# -- bounded input ------------------------------------------------------------------------------------------
def test_empty_input_is_a_clear_error(isolated_env):
    with pytest.raises(UsageError, match="input is empty"):
        node().classify("   ", ["a", "b"])
    proc = cli(["run", "classify", "--model", "fake", "--labels", "a,b", "--text", ""], isolated_env, check=False)
    assert proc.returncode == 2 and "empty" in proc.stderr and "Traceback" not in proc.stderr


def test_input_from_a_file_or_stdin_is_bounded(isolated_env, tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 5000)
    env = {**isolated_env, "NODEAGENT_MAX_INPUT_BYTES": "4096"}
    proc = cli(["run", "classify", "--model", "fake", "--labels", "a,b", "--file", str(big)], env, check=False)
    assert proc.returncode == 2 and "larger than 4096 bytes" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "nodeagent", "run", "classify", "--model", "fake", "--labels",
                           "a,b"], input=b"y" * 5000, capture_output=True, env={**os.environ, **env})
    assert proc.returncode == 2 and b"stdin is larger than 4096 bytes" in proc.stderr
    ok = cli(["run", "classify", "--model", "fake:ctx=8192", "--labels", "a,b", "--file", str(big), "--json"],
             isolated_env)
    assert json.loads(ok.stdout)["status"] == "ok"
    r = Node("fake", config=resolve(env={"NODEAGENT_MAX_INPUT_BYTES": "10"})).classify("more than ten bytes",
                                                                                      ["a", "b"])
    assert r.status == "error" and r.error.code == "input_too_large" and not r.error.retryable


def test_debug_setting_goes_through_the_resolver(isolated_env, tmp_path):
    (tmp_path / "config.toml").write_text("debug = true\n")
    proc = cli(["profiles", "--bogus"], isolated_env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    proc = cli(["plan", str(tmp_path / "missing.gguf")], isolated_env, check=False)
    assert proc.returncode == 4 and "Traceback" in proc.stderr  # debug = true, from the config file


# -- the layering the architecture asks for -------------------------------------------------------------------
def _imports(folder: str) -> dict[str, set[str]]:
    out = {}
    for path in (ROOT / "nodeagent" / folder).rglob("*.py"):
        names: set[str] = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module:
                names.add(n.module)
            elif isinstance(n, ast.Import):
                names.update(a.name for a in n.names)
        out[str(path.relative_to(ROOT))] = names
    return out


def test_arrows_point_down_the_data_path():
    for folder in ("planner", "tasks", "backends"):
        for path, names in _imports(folder).items():
            assert not any(n.startswith("nodeagent.cli") for n in names), path
    for path, names in _imports("planner").items():
        assert not any(n.startswith(("nodeagent.backends", "nodeagent.output")) for n in names), path
        assert "nodeagent.errors" not in names or "UsageError" not in (ROOT / path).read_text(), path


def test_mlx_and_gguf_load_through_the_same_protocol(smollm2_path, tmp_path):
    from mlxgen import make_tiny_mlx_model

    from nodeagent.backends import base

    seen = []
    original = base.backend_for

    def spy(name):
        backend = original(name)
        load = backend.load
        backend.load = lambda plan: seen.append((name, plan.model)) or load(plan)
        return backend

    tiny = make_tiny_mlx_model(tmp_path / "tiny")
    base_mod = sys.modules["nodeagent.node"]
    old = base_mod.backend_for
    base_mod.backend_for = spy
    try:
        for model in (str(tiny), str(smollm2_path)):
            with node(model, ctx_tokens=512) as n:
                assert n.classify("great!", ["positive", "negative"]).status == "ok"
    finally:
        base_mod.backend_for = old
    assert seen == [("mlx", str(tiny)), ("llamacpp", str(smollm2_path))]


def test_fake_backend_is_registered():
    from nodeagent.backends.base import backend_for

    assert isinstance(backend_for("fake"), FakeBackend)


def test_readme_generated_figures_are_current():
    """The README's headline plan and benchmark figures come from the code and the result files."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_results.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_one_shot_run_sizes_its_context_for_the_task(smollm2_path):
    """A long input that the profile's 4096 tokens cannot hold: `nodeagent run` plans for its prompt and the
    answer's budget (from the vocabulary alone), and says so; a worker keeps its planned context."""
    from nodeagent.config import default_of
    from nodeagent.node import output_budget_tokens, prompt_tokens

    schema = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 400}},
              "required": ["summary"]}
    task = ExtractTask(input="The committee met on Tuesday and agreed. " * 700, schema=schema)
    n = node(str(smollm2_path), task="extract")
    need = prompt_tokens(n.plan, task) + output_budget_tokens(task, default_of("max_string_chars"))
    assert need > n.plan.settings.n_ctx == 4096
    sized = n.sized_for(task)
    assert sized.plan.fits and sized.plan.settings.n_ctx >= need
    assert sized.plan.reasons[0].startswith(f"context sized for this task: {need} tokens")
    short = ExtractTask(input="Alice is 34.", schema=schema)
    assert n.sized_for(short) is None  # the planned context holds it
    assert node(str(smollm2_path), task="extract", ctx_tokens=2048).sized_for(task) is None  # fixed: honoured
