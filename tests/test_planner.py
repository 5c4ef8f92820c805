"""The planner: pure functions on headers, recorded hardware and profiles."""

from __future__ import annotations

import pytest
from conftest import HARDWARE
from ggufgen import Shape, write_gguf, write_header_only

from nodeagent.errors import UsageError
from nodeagent.hardware import RecordedSystem, probe
from nodeagent.modelfile import inspect_file
from nodeagent.planner import Requirements, plan
from nodeagent.planner.compute import compute_bytes
from nodeagent.planner.kv import kv_layer_bytes
from nodeagent.planner.weights import CpuKernels, place_weights
from nodeagent.profiles import get_profile, load_profiles

GIB = 1 << 30
MIB = 1 << 20
OVERHEAD = 80 * MIB


@pytest.fixture(scope="module")
def info_7b(header_7b):
    return inspect_file(header_7b)


def plan_for(profile_id, infos, **req):
    p = get_profile(profile_id)
    return plan(infos if isinstance(infos, list) else [infos], p.nominal_hardware(), p, Requirements(**req),
                overhead_bytes=OVERHEAD)


def test_headline_7b_on_m2_pro_16gb(info_7b):
    p = plan_for("apple-m2-pro-16gb", info_7b)
    assert p.fits
    assert p.settings.n_ctx >= 8192
    assert p.settings.n_gpu_layers == info_7b.block_count + 1  # every layer, the output layer too
    assert 5.0 * GIB <= p.memory.total_bytes <= 6.5 * GIB
    assert p.settings.type_k == "f16" and p.settings.use_mmap


def test_7b_does_not_fit_rpi4_4gb_and_says_why(info_7b):
    p = plan_for("rpi4-4gb", info_7b)
    assert not p.fits
    assert any("nothing fits" in r and "available RAM" in r for r in p.reasons)
    assert p.alternatives and "at most about" in p.alternatives[0]


def test_7b_fits_rpi5_8gb_on_cpu(info_7b):
    p = plan_for("rpi5-8gb", info_7b)
    assert p.fits and p.settings.n_gpu_layers == 0 and p.memory.gpu_bytes == 0
    # Cortex-A76 repacks Q4_K and Q6_K: with mmap the file pages and the copies would both be resident
    assert not p.settings.use_mmap
    assert any("mmap off" in r for r in p.reasons)


def test_cold_start_cost_is_said_where_the_disk_is_slow_for_the_weights(info_7b, smollm2_path):
    """A Pi 5's SD card reads the 7B's 4.4 GiB in about 50 s: the reasons say so; a Mac's SSD, or a 135M model on
    the Pi, is not worth a word."""
    pi = plan_for("rpi5-8gb", info_7b)
    [said] = [r for r in pi.reasons if r.startswith("cold start")]
    weights = pi.memory.weights_mapped_bytes + pi.memory.weights_anon_bytes + pi.memory.weights_gpu_bytes
    assert f"about {weights / 90e6:.0f} s" in said and "90 MB/s" in said
    assert not any(r.startswith("cold start") for r in plan_for("apple-m2-pro-16gb", info_7b).reasons)
    assert not any(r.startswith("cold start") for r in plan_for("rpi5-8gb", inspect_file(smollm2_path)).reasons)


def test_a_warm_prefix_is_priced_against_the_prefill_the_profile_predicts(info_7b):
    """On a Pi the plan sets a 1,000-token prefix's read from the SD card against its prefill at the profile's
    published prompt rate (2 FLOP a parameter a token): a Pi 5 reads the 7B's prompt at about 7 tok/s, a Pi 4 at
    under 2; a profile that publishes no rate says only the read."""
    for profile_id, gflop_s, disk_mb_s in (("rpi5-8gb", 97, 90), ("rpi4-8gb", 22, 45)):
        p = plan_for(profile_id, info_7b)
        [said] = [r for r in p.reasons if r.startswith("warm prefixes:")]
        rate = gflop_s * 1e9 / (2 * info_7b.n_params)
        seconds = 1000 / rate
        assert f"about {seconds:.0f} s at the {rate:.3g} tok/s profile {profile_id} predicts" in said, said
        assert f"at {disk_mb_s} MB/s" in said
    [said] = [r for r in plan_for("linux-cpu", info_7b).reasons if r.startswith("warm prefixes:")]
    assert "tok/s profile" not in said and "read back in about" in said


@pytest.mark.parametrize("profile_id", sorted(load_profiles()))
def test_every_profile_plans_consistently(profile_id, info_7b, smollm2_path):
    for info in (info_7b, inspect_file(smollm2_path)):
        p = plan_for(profile_id, info)
        m, b = p.memory, p.budget
        if p.fits:  # held to the budget's own figures, margin included (not through shortfall())
            unified = b.kind == "metal-working-set"
            assert (m.total_bytes if unified else m.host_bytes) + b.margin_bytes <= b.host_limit_bytes
            if b.gpu_limit_bytes is not None:
                assert m.gpu_bytes + b.margin_bytes <= b.gpu_limit_bytes
            assert p.settings.n_ctx <= get_profile(profile_id).context.max_ctx_tokens
        if get_profile(profile_id).runtime.gpu_offload is False:
            assert m.gpu_bytes == 0 and m.weights_gpu_bytes == 0 and m.host_bytes == m.total_bytes


def test_fixed_settings_are_honoured_exactly(info_7b):
    p = plan_for("apple-m2-pro-16gb", info_7b, ctx_tokens=3000, type_k="q8_0", type_v="q4_0", flash_attn=True,
                 n_ubatch=128, n_batch=256, use_mmap=False, n_gpu_layers=10)
    s = p.settings
    assert (s.ctx_per_slot, s.type_k, s.type_v, s.flash_attn, s.n_ubatch, s.n_batch, s.use_mmap, s.n_gpu_layers) == \
        (3000, "q8_0", "q4_0", True, 128, 256, False, 10)
    assert s.slots == 2 and s.n_ctx == 6000  # the profile's two slots: a unified cache of both slots' cells


def test_kv_quantized_when_f16_does_not_fit(tmp_path):
    # a Llama-2-7B shape (no GQA: 32 KV heads) needs 4 GiB of f16 KV at 8k: too much beside 3.6 GiB of
    # weights on an 8 GB Pi 5; q8_0 (2.1 GiB) fits, and the context is kept
    write_header_only(tmp_path / "mha.gguf", "llama", 32, 4096, 32, 32, 11008, 32000, ctx=8192)
    p = plan_for("rpi5-8gb", inspect_file(tmp_path / "mha.gguf"), min_ctx_tokens=8192)
    assert p.fits and p.settings.n_ctx == 8192
    assert p.settings.type_k in ("q8_0", "q4_0")
    assert any("KV cache quantized" in r for r in p.reasons)


def test_ctx_over_trained_needs_flag(smollm2_path):
    info = inspect_file(smollm2_path)
    with pytest.raises(UsageError, match="trained"):
        plan_for("linux-cpu", info, ctx_tokens=16384)
    assert plan_for("linux-cpu", info, ctx_tokens=16384, allow_ctx_over_trained=True).settings.n_ctx == 16384


def test_quantized_v_without_flash_attention_refused(smollm2_path):
    with pytest.raises(UsageError, match="needs flash attention"):
        plan_for("linux-cpu", inspect_file(smollm2_path), type_v="q8_0", flash_attn=False)


def test_kv_type_must_divide_head_size(tmp_path):
    write_gguf(tmp_path / "m.gguf", Shape(n_embd=48, n_head=3, n_head_kv=1))  # head size 16
    with pytest.raises(UsageError, match="divisible by 32"):
        plan_for("linux-cpu", inspect_file(tmp_path / "m.gguf"), type_k="q8_0")


def test_better_quant_first_then_context(tmp_path):
    """Two quants of one shape: the better one wins at a shorter context before the worse at full context."""
    from gguf import GGMLQuantizationType as Q

    files = []
    for name, qt in (("q8", Q.Q8_0), ("q4", Q.Q4_K)):
        path = tmp_path / f"{name}.gguf"
        write_header_only(path, "llama", 32, 4096, 32, 8, 14336, 128256, qtype=qt)
        files.append(inspect_file(path))
    # rpi5-16gb: the Q8_0 weights (~7.5 GiB + output) fit, but not with the default 8k context in f16
    p = plan_for("rpi5-16gb", sorted(files, key=lambda i: -i.bits_per_weight))
    assert p.fits and p.quant == files[0].quant


def test_gqa_and_per_layer_kv_heads(tmp_path):
    write_gguf(tmp_path / "m.gguf", Shape(n_layer=4, n_embd=256, n_head=8, n_head_kv=[8, 4, 2, 0]))
    info = inspect_file(tmp_path / "m.gguf")
    layers = kv_layer_bytes(info, 1000, "f16", "f16")
    cells = 1024  # 1000 rounded up to 256
    assert layers == [2 * 32 * h * 2 * cells for h in (8, 4, 2, 0)]


def test_swa_cache_small_without_swa_full(gemma3_path):
    info = inspect_file(gemma3_path)
    full = sum(kv_layer_bytes(info, 8192, "f16", "f16", swa_full=True, n_ubatch=512))
    small = sum(kv_layer_bytes(info, 8192, "f16", "f16", swa_full=False, n_ubatch=512))
    # llama.cpp reports 150994944 and 40894464 bytes for these settings (CPU KV buffers, both caches)
    assert (full, small) == (150_994_944, 40_894_464)


def test_huge_vocabulary_shrinks_ubatch(tmp_path):
    """A 262k vocabulary: logits alone need n_vocab * n_ubatch * 4 bytes, so a workload that reads every
    position's logits on a tight budget lowers n_ubatch; one that reads the last token's does not need to."""
    from gguf import GGMLQuantizationType as Q

    write_header_only(tmp_path / "big.gguf", "gemma3", 18, 640, 4, 1, 2048, 262144, sliding_window=512,
                      qtype=Q.Q8_0)
    info = inspect_file(tmp_path / "big.gguf")
    assert compute_bytes(info, 2048, 512, True) >= 262144 * 512 * 4
    hw = probe(RecordedSystem.load(HARDWARE / "rpi4-4gb.json"))
    tight = hw.model_copy(update={"ram_available_bytes": 1560 * MIB})
    p = plan([info], tight, get_profile("rpi4-4gb"), Requirements(n_outputs_max=256), overhead_bytes=OVERHEAD)
    assert p.fits and p.settings.n_ubatch < 256
    assert any("n_ubatch lowered" in r for r in p.reasons)
    last_only = plan([info], tight, get_profile("rpi4-4gb"), Requirements(), overhead_bytes=OVERHEAD)
    assert last_only.fits and last_only.settings.n_ubatch == 256
    assert last_only.memory.compute_resident_bytes < last_only.memory.compute_bytes


def test_moe_sized_header(tmp_path):
    write_header_only(tmp_path / "moe.gguf", "qwen3moe", 48, 2048, 32, 4, 768, 151936, n_expert=128,
                      n_expert_used=8)
    info = inspect_file(tmp_path / "moe.gguf")
    assert info.tensor_bytes > 15 * GIB and not info.is_complete
    assert not plan_for("rpi5-8gb", info).fits
    assert plan_for("apple-m3-max-64gb", info).fits


def test_repack_rules_by_cpu():
    from nodeagent.modelfile.info import TensorSpec

    q4k = TensorSpec(name="blk.0.ffn_up.weight", shape=(4096, 14336), type="Q4_K", n_bytes=4096 * 14336 // 256 * 144)
    q8 = TensorSpec(name="blk.0.attn_v.weight", shape=(4096, 1024), type="Q8_0", n_bytes=4096 * 1024 // 32 * 34)
    from nodeagent.planner.weights import amx_bytes, repack_bytes

    pi4, pi5, avx2 = CpuKernels(neon=True), CpuKernels(neon=True, dotprod=True), CpuKernels(avx2=True)
    assert repack_bytes(q4k, pi4) is None and repack_bytes(q4k, pi5) == q4k.n_bytes
    assert repack_bytes(q4k, avx2) == q4k.n_bytes and repack_bytes(q8, avx2) is None
    assert repack_bytes(q8, pi5) == q8.n_bytes
    assert amx_bytes(q8) == 1024 * (4096 // 32) * 38  # VNNI layout keeps an int32 sum per block


def test_offload_order_follows_llama_cpp(info_7b):
    """llama.cpp (src/llama-model.cpp): i_gpu_start = n_layer + 1 - n_gpu_layers, the output layer counting as
    layer n_layer: the output goes to the GPU first, then the blocks from the last one down."""
    cpu = CpuKernels(neon=True, dotprod=True)
    n = info_7b.block_count
    one = place_weights(info_7b, 1, True, cpu, metal=True)
    assert one.gpu_bytes == info_7b.output_bytes + 14336  # output.weight and output_norm
    part = place_weights(info_7b, n, True, cpu, metal=True)
    full = place_weights(info_7b, n + 1, True, cpu, metal=True)
    assert full.gpu_bytes - part.gpu_bytes == info_7b.block_tensor_bytes[0]
    assert place_weights(info_7b, 0, True, cpu).gpu_bytes == 0


def test_classification_plans_sequences_for_label_branches(gemma3_path):
    """Label scoring runs its branches as sequences of a unified KV cache: an output row each, and on
    sliding-window layers n_swa cells each (what llama.cpp allocates; the backend test checks it)."""
    info = inspect_file(gemma3_path)
    one = plan_for("linux-cpu", info, ctx_tokens=8192, task="extract")
    many = plan_for("linux-cpu", info, ctx_tokens=8192, task="classify")
    assert (one.settings.n_seq_max, many.settings.n_seq_max) == (1, 8)
    assert many.memory.output_bytes == 8 * one.memory.output_bytes == 8 * info.vocab_size * 4
    # by hand from the header: 18 layers, 1 KV head of 256 (K and V, f16: 1024 bytes a cell), window 512 on 15
    # of them; 3 full layers keep 8192 cells, SWA layers PAD(512 * 8 + 512, 256) = 4608. llama.cpp reports
    # 95,944,704 bytes for this cache (test_llamacpp_backend checks the plan against its buffers)
    assert (info.block_count, info.head_count_kv[0], info.key_length, sum(info.swa_layers)) == (18, 1, 256, 15)
    assert many.memory.kv_bytes == 3 * 8192 * 1024 + 15 * 4608 * 1024 == 95_944_704
    assert many.memory.kv_bytes > one.memory.kv_bytes
    assert plan_for("linux-cpu", info, ctx_tokens=8192, task="classify", n_seq_max=2).settings.n_seq_max == 2


def test_label_batches_are_given_up_first_when_memory_is_short(gemma3_path):
    """With room for the model at the target context but not for 8 sliding windows, the plan keeps the
    context and the quant and scores label branches one at a time."""
    info = inspect_file(gemma3_path)
    hw = probe(RecordedSystem.load(HARDWARE / "rpi4-4gb.json"))
    profile = get_profile("rpi4-4gb")
    need = {n: plan([info], hw, profile, Requirements(task="classify", ctx_tokens=8192, n_seq_max=n, use_mmap=True),
                    overhead_bytes=OVERHEAD).memory.host_bytes for n in (1, 8)}
    assert need[8] > need[1]
    budget = plan([info], hw, profile, Requirements(), overhead_bytes=OVERHEAD).budget
    spare = budget.host_limit_bytes - budget.margin_bytes - need[1]  # what the budget leaves at n_seq_max 1
    tight = hw.model_copy(update={"ram_available_bytes": hw.ram_available_bytes - spare + (need[8] - need[1]) // 2})
    p = plan([info], tight, profile, Requirements(task="classify", ctx_tokens=8192, use_mmap=True),
             overhead_bytes=OVERHEAD)
    assert p.fits and p.settings.n_seq_max == 1 and p.settings.n_ctx == 8192
    assert any("one at a time" in r for r in p.reasons)
