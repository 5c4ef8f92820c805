"""The plan search: pure, from typed inputs to a Plan with reasons.

Order of preference unless the user fixed a setting: a better quant before a
longer context; the target context before full-precision KV; KV f16, then
q8_0, then q4_0 (a quantized V cache only with flash attention); a smaller
n_ubatch when the compute buffer is what does not fit; every layer on the GPU
before some; mmap on unless mapped weights plus the rest exceed RAM.
"""

from __future__ import annotations

import itertools
from typing import Iterable

from nodeagent.errors import PlanError, SettingError
from nodeagent.hardware.types import HardwareInfo
from nodeagent.modelfile.info import ModelInfo
from nodeagent.planner.budget import budget_for
from nodeagent.planner.kv import QUANTIZED_KV, check_kv_type, kv_bytes_per_token
from nodeagent.planner.memory import Candidate, estimate, shortfall
from nodeagent.planner.speed import prefill_tokens_per_s
from nodeagent.planner.types import Budget, Memory, Plan, Requirements, Settings
from nodeagent.planner.weights import CpuKernels
from nodeagent.profiles import DeviceProfile
from nodeagent.units import format_bytes

KV_LADDER = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"))
UBATCH_LADDER = (512, 256, 128, 64)
# label scoring evaluates up to SCORING_SEQS - 1 label branches in one batch, each its own sequence sharing the
# prompt's cells; it costs an output row per sequence and, on sliding-window layers, n_swa cells per sequence
SCORING_SEQS = 8
MIN_CTX_TOKENS = 512
# llama.cpp's most parallel sequences: an embedding model's forward batch holds min(n_batch, this) inputs, as
# llama-cpp-python's embedding mode sets it
EMBED_SEQS = 256
EMBED_TASKS = 4  # an embedding model's tasks in flight at least: their inputs go into one forward batch


def _kernels(hw: HardwareInfo) -> CpuKernels:
    lc = hw.llama_cpp.cpu_features
    return CpuKernels.from_features(lc if lc is not None else hw.cpu_features)


def _validate(req: Requirements, info: ModelInfo, offload: bool) -> None:
    for name in ("type_k", "type_v"):
        kv = getattr(req, name)
        head = info.key_length if name == "type_k" else info.value_length
        if kv and (why := check_kv_type(kv, head)):
            raise SettingError(f"--{name.replace('_', '-')} {kv} cannot be used: {why}", hint="use f16 or q8_0")
    if req.type_v in QUANTIZED_KV and req.flash_attn is False:
        raise SettingError(f"a quantized V cache ({req.type_v}) needs flash attention; llama.cpp refuses it without",
                           hint="drop --no-flash-attn, or use --type-v f16")
    if req.n_gpu_layers not in (None, 0) and not offload:
        raise SettingError(f"--gpu-layers {req.n_gpu_layers} cannot be used: this device has no GPU offload "
                           "(no GPU, or a llama.cpp build or profile without it)", hint="drop --gpu-layers, or use 0")
    if req.n_batch and req.n_ubatch and req.n_ubatch > req.n_batch:
        raise SettingError(f"--ubatch {req.n_ubatch} is larger than --batch {req.n_batch}; llama.cpp would cut it "
                           "to the batch", hint="give a micro-batch no larger than the batch")


def _halvings(target: int, floor: int) -> list[int]:
    out, ctx = [target], target
    while ctx // 2 >= floor:
        ctx //= 2
        out.append(ctx)
    return out


COLD_START_SAID_S = 10.0  # a cold start this long or longer is worth a reason


def _disk_mb_s(profile: DeviceProfile, hw: HardwareInfo) -> tuple[float | None, bool]:
    """The disk's read speed, MB/s: the one measured on the device's model folder where it was (``hw.storage``:
    `nodeagent probe` measures it once), else the profile's typical disk; and whether it was measured."""
    s = hw.storage
    if s is not None and s.read_mb_s is not None:
        return s.read_mb_s, True
    return profile.nominal.disk_read_mb_s, False


def _cold_start(mem: Memory, profile: DeviceProfile, hw: HardwareInfo) -> list[str]:
    """What the first tokens after a cold start cost where the weights are large for the device's disk: every
    page of them is read once (mmap on: at the first tokens, as page faults; off: during the load), at the
    disk's speed (``_disk_mb_s``)."""
    s = hw.storage
    disk, measured = _disk_mb_s(profile, hw)
    weights = mem.weights_mapped_bytes + mem.weights_anon_bytes + mem.weights_gpu_bytes
    if not disk or weights / (disk * 1e6) < COLD_START_SAID_S:
        return []
    where = (f"measured on this device's {s.kind or 'disk'}{f' {s.device}' if s.device else ''}"  # type: ignore[union-attr]
             if measured else f"{profile.id}'s disk")
    return [f"cold start: the first tokens after a boot read {format_bytes(weights)} of weights at about "
            f"{disk:g} MB/s ({where}): about {weights / (disk * 1e6):.0f} s; from a warm page cache far "
            "less (`nodeagent bench` measures both)"]


PREFIX_SAID_TOKENS = 1000  # the prefix a plan's reason prices (an extraction's instructions, a system prompt)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.2g} s"


def _warm_prefixes(c: Candidate, info: ModelInfo, profile: DeviceProfile, hw: HardwareInfo) -> list[str]:
    """What a recurring prompt prefix kept on disk costs (``backends/prefix_store.py``): its state's bytes per
    token in the plan's KV types, and the time to read a 1,000-token one back at the device's disk."""
    if not info.kind.generates or not info.head_count_kv:
        return []
    per_token = kv_bytes_per_token(info, c.type_k, c.type_v)
    size = per_token * PREFIX_SAID_TOKENS
    disk, _ = _disk_mb_s(profile, hw)
    read = f", read back in about {size / (disk * 1e6):.2g} s at {disk:g} MB/s" if disk else ""
    rate = prefill_tokens_per_s(info.n_params, profile)
    again = (f" (about {_seconds(PREFIX_SAID_TOKENS / rate)} at the {rate:.3g} tok/s profile {profile.id} "
             "predicts)" if rate else "")
    return [f"warm prefixes: a prompt prefix that recurs is kept on disk at {format_bytes(per_token)} a token "
            f"({c.type_k}/{c.type_v} KV): {format_bytes(size)} for {PREFIX_SAID_TOKENS:,} tokens{read}, in place "
            f"of reading them again{again} (NODEAGENT_PREFIX_CACHE_BYTES)"]


def ctx_ladder(req: Requirements, profile: DeviceProfile, trained: int | None, reasons: list[str]) -> list[int]:
    """The contexts to try, longest first. A fixed context (--ctx) is the only one; a minimum (--min-ctx) is
    never undercut; else the profile's context for the task, halved down to a floor. A context past what the
    model was trained for, or past the profile's maximum, is refused unless explicitly allowed."""
    limit = profile.context.max_ctx_tokens
    asked = req.ctx_tokens or req.min_ctx_tokens
    flag = "--ctx" if req.ctx_tokens else "--min-ctx"
    if asked and trained and asked > trained:
        if not req.allow_ctx_over_trained:
            raise SettingError(f"{flag} {asked} is larger than the {trained} tokens the model was trained for",
                               hint=f"use a shorter {flag}, or pass --allow-ctx-over-trained")
        reasons.append(f"context {asked} exceeds the trained {trained}: allowed by --allow-ctx-over-trained")
    if asked and asked > limit:
        if not req.allow_ctx_over_profile:
            raise SettingError(f"{flag} {asked} is larger than profile {profile.id}'s maximum of {limit} tokens",
                               hint=f"use a shorter {flag}, or pass --allow-ctx-over-profile")
        reasons.append(f"context {asked} exceeds profile {profile.id}'s maximum of {limit}: allowed by "
                       "--allow-ctx-over-profile")
    if req.ctx_tokens:
        return [req.ctx_tokens]
    if req.min_ctx_tokens:  # at least this: the longer context the profile wants is tried first
        floor = req.min_ctx_tokens
        ladder = _halvings(max(floor, min(profile.ctx_for_task(req.task), limit, trained or limit)), floor)
        return ladder if ladder[-1] == floor else [*ladder, floor]
    target = min(profile.ctx_for_task(req.task), limit)
    if trained and target > trained:
        reasons.append(f"target context {target} exceeds the trained {trained}: using {trained}")
        target = trained
    return _halvings(target, min(target, max(MIN_CTX_TOKENS, target // 4)))


def embed_ctxs(req: Requirements, profile: DeviceProfile, trained: int | None, reasons: list[str],
               info: ModelInfo) -> list[int]:
    """An embedding model's context: the longest input it reads, whole, in one micro-batch (its compute buffer
    grows with the square of it without flash attention): the trained context within the profile's maximum, or
    what --ctx fixes (and no more than trained, unless allowed). A context shortened here refuses longer
    inputs, never cuts them."""
    reasons.append(f"an embedding model ({info.architecture}, {info.pooling} pooling): no KV cache"
                   + ("" if info.causal else ", attention over the whole input") + "; it embeds and classifies by "
                   "embeddings, and never generates")
    if req.ctx_tokens and trained and req.ctx_tokens > trained and not req.allow_ctx_over_trained:
        # one context for a node's every model (NODEAGENT_CTX) must not make its embedding model unservable
        reasons.append(f"--ctx {req.ctx_tokens} is over the {trained} tokens the model was trained for: inputs up to "
                       f"{trained} (a longer one is refused, never cut; --allow-ctx-over-trained reads further)")
        req = req.model_copy(update={"ctx_tokens": trained})
    if req.ctx_tokens:
        return ctx_ladder(req, profile, trained, reasons)
    limit = min(trained or profile.context.max_ctx_tokens, profile.context.max_ctx_tokens)
    if trained and limit < trained:
        reasons.append(f"inputs up to {limit} tokens: profile {profile.id}'s maximum context, under the trained "
                       f"{trained}")
    return [limit]


def can_offload(profile: DeviceProfile, hw: HardwareInfo) -> bool:
    return profile.runtime.gpu_offload and hw.llama_cpp.gpu_offload and (hw.apple is not None or bool(hw.gpus))


def _options(req: Requirements, profile: DeviceProfile, hw: HardwareInfo, info: ModelInfo) -> dict[str, list]:
    offload = can_offload(profile, hw)
    fa = [req.flash_attn] if req.flash_attn is not None else [profile.runtime.flash_attn]
    if req.type_k or req.type_v:
        kv = [(req.type_k or profile.context.type_k, req.type_v or profile.context.type_v)]
    else:
        kv = [p for p in KV_LADDER if not check_kv_type(p[0], info.key_length)
              and not check_kv_type(p[1], info.value_length)]
    ub_default = min(profile.runtime.n_ubatch, req.n_batch or profile.runtime.n_ubatch)  # never over a fixed batch
    ubatch = [req.n_ubatch] if req.n_ubatch else [ub_default] + [u for u in UBATCH_LADDER if u < ub_default]
    mmap = [req.use_mmap] if req.use_mmap is not None else [True, False]
    swa = [req.swa_full] if req.swa_full is not None else [False] if info.swa_layers else [True]
    if req.n_gpu_layers is not None:
        layers = [req.n_gpu_layers]
    elif offload:
        layers = list(range(info.block_count + 1, -1, -1))
    else:
        layers = [0]
    if req.n_seq_max is not None:
        seqs = [req.n_seq_max]
    else:  # batched label scoring is the first thing given up when memory is short
        seqs = [SCORING_SEQS, 1] if req.task == "classify" else [1]
    # parallel slots: given up (one at a time) before the context is shortened; fixed ones are kept. An
    # embedding model's are the tasks in flight whose inputs share its forward batches (they cost no memory)
    wanted = req.slots or (max(profile.runtime.slots, EMBED_TASKS) if not info.kind.generates
                           else profile.runtime.slots)
    slots = [req.slots] if req.slots else list(range(wanted, 0, -1))
    return {"fa": fa, "kv": kv, "ubatch": ubatch, "mmap": mmap, "swa": swa, "layers": layers, "seqs": seqs,
            "outputs": req.n_outputs_max, "slots": slots}


def _settings(c: Candidate, path: str, threads: int) -> Settings:
    return Settings(model_path=path, n_ctx=c.n_ctx, type_k=c.type_k, type_v=c.type_v,  # type: ignore[arg-type]
                    flash_attn=c.flash_attn, n_gpu_layers=c.n_gpu_layers, use_mmap=c.use_mmap, use_mlock=False,
                    n_batch=max(c.n_batch, c.n_ubatch), n_ubatch=c.n_ubatch, swa_full=c.swa_full,
                    n_threads=threads, slots=c.slots, n_outputs_max=c.n_outputs, n_seq_max=c.n_seq,
                    pooling=c.info.pooling)


def _describe(c: Candidate) -> str:
    q = c.info.quant or "?"
    if not c.info.kind.generates:
        return (f"{q} inputs up to {c.n_ctx} tokens, {c.n_seq} to a forward batch, {c.slots} tasks in flight, fa "
                f"{'on' if c.flash_attn else 'off'} gpu layers {c.n_gpu_layers} mmap {'on' if c.use_mmap else 'off'}")
    return (f"{q} ctx {c.ctx_per_slot}"
            + (f" x {c.slots} slots" if c.slots > 1 else "")
            + f" kv {c.type_k}/{c.type_v} fa {'on' if c.flash_attn else 'off'} "
            f"ubatch {c.n_ubatch} gpu layers {c.n_gpu_layers} mmap {'on' if c.use_mmap else 'off'}"
            + (f" seqs {c.n_seq}" if c.n_seq > c.slots else ""))


def _walk(info: ModelInfo, ctxs: Iterable[int], opts: dict[str, list], n_batch: int):
    """Candidates in order of preference for one model file (the first option varies slowest). ``ctx`` is
    each task's context: slots run as parallel sequences of one unified KV cache, so the context holds
    ``ctx * slots`` cells, every sequence (a slot's label branches too) asks for a logits row, and the compute
    buffer is sized for the whole. An embedding model reads each input whole in one micro-batch (its context and
    micro-batch are the longest input), a forward batch of up to EMBED_SEQS inputs; its slots are the tasks in
    flight that share that batch."""
    if not info.kind.generates:
        for ctx, slots, layers, fa, mmap in itertools.product(ctxs, opts["slots"], opts["layers"], opts["fa"],
                                                               opts["mmap"]):
            n_seq = min(ctx, EMBED_SEQS)
            yield Candidate(info, ctx, "f16", "f16", fa, ctx, ctx, mmap, True, layers, n_seq, n_seq, slots)
        return
    for ctx, slots, layers, (type_k, type_v), fa, ub, mmap, swa, seqs in itertools.product(
            ctxs, opts["slots"], opts["layers"], opts["kv"], opts["fa"], opts["ubatch"], opts["mmap"], opts["swa"],
            opts["seqs"]):
        if type_v in QUANTIZED_KV and not fa:
            continue
        n_seq = seqs * slots
        yield Candidate(info, ctx * slots, type_k, type_v, fa, ub, n_batch, mmap, swa, layers, n_seq,
                        max(n_seq, opts["outputs"]), slots)


def plan(models: list[ModelInfo], hw: HardwareInfo, profile: DeviceProfile, req: Requirements,
         overhead_bytes: int) -> Plan:
    """Choose the best configuration. ``models`` is a quant ladder, best quant first."""
    if not models:
        raise PlanError("no model file to plan for")
    for info in models:
        _validate(req, info, can_offload(profile, hw))
    budget = budget_for(hw, profile)
    cpu = _kernels(hw)
    metal = hw.apple is not None
    threads = req.n_threads or profile.threads_for(hw)
    n_batch = req.n_batch or profile.runtime.n_batch
    trained = min((m.context_length or 1 << 30) for m in models)
    reasons: list[str] = []
    embedder = not models[0].kind.generates
    ctxs = embed_ctxs(req, profile, trained, reasons, models[0]) if embedder else ctx_ladder(req, profile, trained,
                                                                                            reasons)
    target = ctxs[0]
    reasons.append(f"budget: {format_bytes(budget.host_limit_bytes)} of RAM ({budget.source}, "
                   f"{format_bytes(budget.reserve_bytes)} kept for the OS)"
                   + (f", GPU {format_bytes(budget.gpu_limit_bytes)}" if budget.gpu_limit_bytes else "")
                   + f", margin {format_bytes(budget.margin_bytes)}")
    for info in models:
        opts = _options(req, profile, hw, info)
        first_fail: tuple[int, Candidate, Memory, str] | None = None
        for c in _walk(info, ctxs, opts, n_batch):
            mem = estimate(c, cpu, overhead_bytes, metal)
            over, what = shortfall(mem, budget)
            if what is None:
                reasons.extend(_why_chosen(c, info, models, target, opts, req, first_fail))
                reasons.extend(_cold_start(mem, profile, hw))
                reasons.extend(_warm_prefixes(c, info, profile, hw))
                return Plan(fits=True, backend="llamacpp", model=info.source, quant=info.quant, profile=profile.id,
                            settings=_settings(c, info.source, threads), memory=mem, budget=budget,
                            reasons=reasons)
            if first_fail is None:
                first_fail = (over, c, mem, what)
        assert first_fail is not None
        over, c, mem, what = first_fail
        reasons.append(f"rejected {info.quant or info.source}: even the smallest setting tried exceeds {what} by "
                       f"{format_bytes(over)} (best first try: {_describe(c)}, {format_bytes(mem.total_bytes)})")
    # report the configuration with the smallest footprint tried: the most useful "what it would need"
    smallest = _smallest(models, ctxs, req, profile, hw, n_batch, cpu, overhead_bytes, metal, budget)
    c, mem = smallest
    over, what = shortfall(mem, budget)
    reasons.append(f"nothing fits: the smallest configuration ({_describe(c)}) needs {format_bytes(mem.total_bytes)}"
                   f", {format_bytes(over)} more than {what} allows")
    return Plan(fits=False, backend="llamacpp", model=c.info.source, quant=c.info.quant, profile=profile.id,
                settings=_settings(c, c.info.source, threads), memory=mem, budget=budget, reasons=reasons,
                alternatives=_alternatives(c, mem, budget, over))


def _smallest(models, ctxs, req, profile, hw, n_batch, cpu, overhead, metal, budget):
    best = None
    for info in models:
        opts = _options(req, profile, hw, info)
        for c in _walk(info, ctxs[-1:], opts, n_batch):
            mem = estimate(c, cpu, overhead, metal)
            key = shortfall(mem, budget)[0]
            if best is None or key < best[0]:
                best = (key, c, mem)
    return best[1], best[2]


def _alternatives(c: Candidate, mem: Memory, budget: Budget, over: int) -> list[str]:
    weights = mem.weights_mapped_bytes + mem.weights_anon_bytes + mem.weights_gpu_bytes
    room = max(0, weights - over)
    out = [f"a model whose weights take at most about {format_bytes(room)} at context {c.ctx_per_slot} "
           f"(this file needs {format_bytes(weights)})"]
    if c.ctx_per_slot > MIN_CTX_TOKENS:
        out.append(f"a shorter context saves at most {format_bytes(mem.kv_bytes)} of KV cache, not enough alone"
                   if mem.kv_bytes < over else "a shorter context (see --ctx)")
    return out


def _why_chosen(c: Candidate, info: ModelInfo, models: list[ModelInfo], target: int, opts: dict, req: Requirements,
                first_fail) -> list[str]:
    out = [f"chosen: {_describe(c)}"]
    if info is not models[0]:
        out.append(f"{info.quant} is the best quant that fits")
    if c.ctx_per_slot < target:
        out.append(f"context shortened from {target} to {c.ctx_per_slot} to keep the better quant")
    if (c.type_k, c.type_v) != opts["kv"][0] and not (req.type_k or req.type_v):
        out.append(f"KV cache quantized to {c.type_k}/{c.type_v} to reach context {c.ctx_per_slot}")
    if c.n_ubatch != opts["ubatch"][0] and not req.n_ubatch:
        out.append(f"n_ubatch lowered to {c.n_ubatch}: the compute buffer did not fit at {opts['ubatch'][0]}")
    if c.slots != opts["slots"][0] and info.kind.generates:
        out.append(f"slots lowered from {opts['slots'][0]} to {c.slots}: {opts['slots'][0]} parallel tasks did not "
                   f"fit at context {c.ctx_per_slot} (slots are given up before context)")
    if c.n_seq // c.slots != opts["seqs"][0] and info.kind.generates:
        out.append(f"label branches scored one at a time (n_seq_max {c.n_seq}): a batch of {opts['seqs'][0] - 1} "
                   f"did not fit")
    if not c.use_mmap and req.use_mmap is None:
        out.append("mmap off: mapped weights plus repacked copies and the rest exceed RAM (disk thrash); "
                   "loading into anonymous memory needs less")
    if opts["layers"][0] > 0 and c.n_gpu_layers < info.block_count + 1 and req.n_gpu_layers is None:
        out.append(f"partial offload: {c.n_gpu_layers} of {info.block_count + 1} layers on the GPU")
    elif c.n_gpu_layers > info.block_count:
        out.append("every layer on the GPU")
    if first_fail is not None:
        over, fc, _, what = first_fail
        out.append(f"tried first: {_describe(fc)}, over {what} by {format_bytes(over)}")
    return out

