"""Real models through llama-cpp-python: the plan's components against what llama.cpp allocates."""

from __future__ import annotations

import logging

import pytest

from nodeagent.config import resolve
from nodeagent.node import Node

MIB = 1 << 20
# llama.cpp prints its buffer sizes in MiB with two decimals: its own figures are only this exact
LOG_RESOLUTION_BYTES = 0.01 * MIB
pytestmark = pytest.mark.real_model
SETTING = {"use_mmap": "mmap", "n_ubatch": "ubatch"}  # planner requirement -> the node's setting


def _load(path, task=None, **fixed):
    """Plan and load through the node core, with these settings fixed."""
    node = Node(str(path), config=resolve(env={}), task=task, **{SETTING.get(k, k): v for k, v in fixed.items()})
    assert node.plan.fits
    return node.plan, node.load()


def _assert_components(report):
    """Within 1 %, or the log's resolution: a tolerance far smaller than even the 192 KiB output buffer."""
    by = {c.component: c for c in report.components}
    for name in ("weights_mapped_bytes", "weights_anon_bytes", "kv_bytes", "output_bytes"):
        c = by[name]
        assert abs(c.planned_bytes - c.actual_bytes) <= max(0.01 * c.actual_bytes, LOG_RESOLUTION_BYTES), c
    c = by["compute_bytes"]
    assert abs(c.planned_bytes - c.actual_bytes) <= 0.05 * c.actual_bytes, c


@pytest.mark.parametrize("fixed", [
    dict(ctx_tokens=2048),
    dict(ctx_tokens=8192, flash_attn=False, n_ubatch=128),
    dict(ctx_tokens=4096, type_k="q8_0", type_v="q8_0", flash_attn=True, use_mmap=False),
])
def test_smollm2_components_match_llama_cpp(smollm2_path, fixed):
    p, model = _load(smollm2_path, **fixed)
    with model:
        s = model.llama
        assert s.n_ctx() == p.settings.n_ctx
        _assert_components(model.report)
        text = model.generate("The capital of France is", max_tokens=4, temperature=0)
        assert isinstance(text, str) and text.strip()
    model.close()  # idempotent


@pytest.mark.parametrize("fixed", [dict(ctx_tokens=2048, swa_full=False), dict(ctx_tokens=4096, swa_full=True,
                                                                               n_ubatch=128),
                                   # label scoring's unified cache: 8 sliding windows, 8 output rows
                                   dict(ctx_tokens=8192, task="classify")])
def test_gemma3_components_match_llama_cpp(gemma3_path, fixed):
    p, model = _load(gemma3_path, **fixed)
    assert p.settings.n_seq_max == (8 if fixed.get("task") else 1)
    with model:
        _assert_components(model.report)


def test_native_log_goes_to_python_logging(smollm2_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="nodeagent.llamacpp"):
        _, model = _load(smollm2_path, ctx_tokens=512)
        model.close()
    assert any("model buffer size" in r.getMessage() for r in caplog.records)


def test_mmap_keeps_weights_file_backed(smollm2_path):
    _, model = _load(smollm2_path, ctx_tokens=512, use_mmap=True)
    with model:
        r = model.report
        mem = r.memory_after
        # with mmap the weights are page cache (RssFile), not anonymous memory
        assert mem.file_bytes is not None and mem.file_bytes - r.memory_before.file_bytes > 0
