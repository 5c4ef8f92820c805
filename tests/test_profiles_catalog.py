"""Device profiles and the model catalog: they load, they are complete, they are honest."""

from __future__ import annotations

from nodeagent.errors import NotFoundError
from nodeagent.kv_types import KV_TYPES
from nodeagent.profiles import get_profile, load_profiles
from nodeagent.store.catalog import NOMINAL_BPW, get_model, load_catalog

REQUIRED_PROFILES = {"apple-m1-8gb", "apple-m2-pro-16gb", "apple-m3-max-64gb", "rpi4-4gb", "rpi4-8gb",
                     "rpi5-8gb", "rpi5-16gb", "linux-cpu"}


def test_required_profiles_present_and_sane():
    profiles = load_profiles()
    assert REQUIRED_PROFILES <= set(profiles)
    for p in profiles.values():
        assert p.context.default_ctx_tokens <= p.context.max_ctx_tokens
        assert p.context.type_k in KV_TYPES and p.context.type_v in KV_TYPES
        assert p.runtime.n_ubatch <= p.runtime.n_batch
        if p.memory.budget == "metal-working-set":
            assert p.match.os == "darwin" and "mlx" in p.runtime.backends
        else:
            assert "mlx" not in p.runtime.backends


def test_m2_pro_default_context_at_least_8k():
    assert get_profile("apple-m2-pro-16gb").context.default_ctx_tokens >= 8192


def test_unknown_profile_hint():
    try:
        get_profile("rpi9")
    except NotFoundError as exc:
        assert "rpi4-4gb" in (exc.hint or "")
    else:
        raise AssertionError("expected NotFoundError")


def test_catalog_families_and_range():
    catalog = load_catalog()
    assert len({m.family for m in catalog.values()}) >= 8
    params = [m.params for m in catalog.values()]
    assert min(params) <= 140_000_000 and max(params) >= 8_000_000_000


def test_catalog_sizes_are_sourced_or_marked_estimates():
    for m in load_catalog().values():
        assert m.files, m.id
        for f in m.files:
            assert f.size_source in ("header", "published", "pypi", "estimate")
            if f.size_source == "estimate":  # between 2 and 34 bits per weight, whatever the table says
                assert m.params * 2 / 8 < f.size_bytes < m.params * 34 / 8, (m.id, f.quant)
                assert f.size_note and "bits per weight" in f.size_note
            if f.source == "hub":
                assert f.repo and f.file_name.endswith(".gguf") and f.quant in f.file_name


def test_test_models_in_catalog_match_test_models_doc():
    smol = get_model("smollm2-135m-instruct").file("Q4_1")
    assert smol.source == "pypi" and smol.size_bytes == 98_362_432
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    gemma = get_model("gemma-3-270m-it").file("Q4_K_M")
    # the hub ladder's Q4_K_M comes first; the package-index file is listed too
    files = [f for f in get_model("gemma-3-270m-it").files if f.source == "pypi"]
    assert gemma.quant == "Q4_K_M"
    assert len(files) == 1 and len(files[0].packages) == 4
    assert files[0].sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_7b_size_from_header():
    f = get_model("deepseek-r1-distill-qwen-7b").file("Q4_K_M")
    assert f.size_source == "header" and f.size_bytes == 4_683_073_248


def test_unknown_model_suggests():
    try:
        get_model("smollm2")
    except NotFoundError as exc:
        assert "smollm2-135m-instruct" in (exc.hint or "")
    else:
        raise AssertionError("expected NotFoundError")


def test_size_estimates_land_near_a_real_file():
    """The nominal bits per weight, checked against a size nobody estimated: the 7B Q4_K_M header's."""
    m = get_model("deepseek-r1-distill-qwen-7b")
    real = m.file("Q4_K_M")
    assert real.size_source == "header" and real.size_bytes == 4_683_073_248
    estimate = m.params * NOMINAL_BPW["Q4_K_M"] / 8
    assert abs(estimate - real.size_bytes) / real.size_bytes < 0.03
