"""Planning for MLX: weights, KV cache (mlx-lm's f16 or quantized cache) and prefill activations,
held to the Metal working set on Apple Silicon (host RAM elsewhere). Pure functions."""

from __future__ import annotations

from nodeagent.backends.mlx import MlxModelInfo, activation_bytes, kv_bytes, kv_group
from nodeagent.hardware.types import HardwareInfo
from nodeagent.output import format_bytes
from nodeagent.planner.budget import budget_for
from nodeagent.planner.memory import shortfall
from nodeagent.planner.search import MIN_CTX_TOKENS, _ctx_ladder
from nodeagent.planner.types import Memory, Plan, Requirements, Settings
from nodeagent.profiles import DeviceProfile

BATCH_LADDER = (512, 256, 128, 64)


def estimate_mlx(info: MlxModelInfo, n_ctx: int, kv_type: str, n_batch: int, overhead_bytes: int,
                 metal: bool) -> Memory:
    kv = kv_bytes(info, n_ctx, kv_type)
    act = activation_bytes(info, min(n_batch, n_ctx))
    device = info.weights_bytes + kv + act
    host = overhead_bytes + (0 if metal else device)
    gpu = device if metal else 0
    return Memory(weights_mapped_bytes=0, weights_anon_bytes=0 if metal else info.weights_bytes,
                  weights_gpu_bytes=info.weights_bytes if metal else 0, kv_bytes=kv, compute_bytes=act,
                  compute_resident_bytes=act, output_bytes=0, runtime_bytes=0, overhead_bytes=overhead_bytes,
                  total_bytes=host + gpu, host_bytes=host, gpu_bytes=gpu)


def plan_mlx(info: MlxModelInfo, hw: HardwareInfo, profile: DeviceProfile, req: Requirements,
             overhead_bytes: int) -> Plan:
    budget = budget_for(hw, profile)
    metal = hw.apple is not None
    target = req.ctx_tokens or req.min_ctx_tokens or profile.ctx_for_task(req.task)
    ctxs = [req.ctx_tokens] if req.ctx_tokens else _ctx_ladder(target, req.min_ctx_tokens or min(
        target, max(MIN_CTX_TOKENS, target // 4)))
    kvs = [req.type_k] if req.type_k else ["f16"] + (["q8_0", "q4_0"] if kv_group(info.head_dim) else [])
    batches = [req.n_batch] if req.n_batch else list(BATCH_LADDER)
    reasons = [f"budget: {format_bytes(budget.host_limit_bytes)} of RAM"
               + (f", Metal working set {format_bytes(budget.gpu_limit_bytes)}" if budget.gpu_limit_bytes else "")
               + f", margin {format_bytes(budget.margin_bytes)}",
               "MLX: weights, KV cache and prefill activations live on the GPU (unified memory)" if metal
               else "MLX on the CPU: everything in host RAM"]
    first = None
    for ctx in ctxs:
        for kv in kvs:
            for nb in batches:
                mem = estimate_mlx(info, ctx, kv, nb, overhead_bytes, metal)
                over, what = shortfall(mem, budget)
                settings = Settings(model_path=info.path, n_ctx=ctx, type_k=kv, type_v=kv,  # type: ignore[arg-type]
                                    flash_attn=False, n_gpu_layers=-1 if metal else 0, use_mmap=False,
                                    use_mlock=False, n_batch=nb, n_ubatch=nb, swa_full=True,
                                    n_threads=profile.threads_for(hw), slots=1)
                if what is None:
                    reasons.append(f"chosen: ctx {ctx}, KV {kv}, prefill chunks of {nb}")
                    if first is not None:
                        reasons.append(f"tried first: {first[1]}, over {first[2]} by {format_bytes(first[0])}")
                    return Plan(fits=True, model=info.path, quant=f"{info.quantization_bits}bit"
                                if info.quantization_bits else None, profile=profile.id, settings=settings,
                                memory=mem, budget=budget, reasons=reasons)
                if first is None:
                    first = (over, f"ctx {ctx}, KV {kv}, chunks of {nb}", what, settings, mem)
    assert first is not None
    reasons.append(f"nothing fits: {first[1]} is over {first[2]} by {format_bytes(first[0])}")
    return Plan(fits=False, model=info.path, quant=None, profile=profile.id, settings=first[3], memory=first[4],
                budget=budget, reasons=reasons)
