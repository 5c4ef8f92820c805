"""Planning for MLX: weights, KV cache (mlx-lm's f16 or quantized cache) and prefill activations,
held to the Metal working set on Apple Silicon (host RAM elsewhere). Pure functions."""

from __future__ import annotations

from nodeagent.hardware.types import HardwareInfo
from nodeagent.kv_types import MLX_KV_BITS
from nodeagent.modelfile.mlx import MlxModelInfo
from nodeagent.planner.budget import budget_for
from nodeagent.planner.memory import shortfall, task_runtime_bytes
from nodeagent.planner.search import ctx_ladder
from nodeagent.planner.types import Memory, Plan, Requirements, Settings
from nodeagent.profiles import DeviceProfile
from nodeagent.units import format_bytes

BATCH_LADDER = (512, 256, 128, 64)


def kv_bytes(info: MlxModelInfo, n_ctx: int, kv_type: str) -> int:
    """K and V for n_ctx tokens in the model's float type; a quantized cache packs bits per value and
    keeps a scale and a bias (in the model's float type) per group."""
    values = 2 * info.n_layers * info.n_kv_heads * info.head_dim * n_ctx
    bits = MLX_KV_BITS[kv_type]
    if bits is None:
        return values * info.dtype_bytes
    return values * bits // 8 + values // (info.kv_group_size or 64) * 2 * info.dtype_bytes


def activation_bytes(info: MlxModelInfo, n_batch: int) -> int:
    """One prefill chunk: its logits (n_batch x vocab, f32) and the FFN and attention activations."""
    return n_batch * info.vocab_size * 4 + n_batch * (4 * info.hidden_size + 3 * info.intermediate_size) \
        * info.dtype_bytes


def estimate_mlx(info: MlxModelInfo, n_ctx: int, kv_type: str, n_batch: int, overhead_bytes: int,
                 metal: bool) -> Memory:
    kv = kv_bytes(info, n_ctx, kv_type)
    act = activation_bytes(info, min(n_batch, n_ctx))
    device = info.weights_bytes + kv + act
    tasks = task_runtime_bytes(info.vocab_size)
    host = overhead_bytes + tasks + (0 if metal else device)
    gpu = device if metal else 0
    return Memory(weights_mapped_bytes=0, weights_anon_bytes=0 if metal else info.weights_bytes,
                  weights_gpu_bytes=info.weights_bytes if metal else 0, kv_bytes=kv, compute_bytes=act,
                  compute_resident_bytes=act, output_bytes=0, runtime_bytes=0, task_runtime_bytes=tasks,
                  overhead_bytes=overhead_bytes,
                  total_bytes=host + gpu, host_bytes=host, gpu_bytes=gpu)


def plan_mlx(info: MlxModelInfo, hw: HardwareInfo, profile: DeviceProfile, req: Requirements,
             overhead_bytes: int) -> Plan:
    budget = budget_for(hw, profile)
    metal = hw.apple is not None
    reasons: list[str] = []
    ctxs = ctx_ladder(req, profile, None, reasons)
    if req.type_k and req.type_k not in MLX_KV_BITS:
        from nodeagent.errors import PlanError

        raise PlanError(f"MLX's KV cache takes {', '.join(MLX_KV_BITS)}, not {req.type_k}")
    kvs = [req.type_k] if req.type_k else ["f16"] + (["q8_0", "q4_0"] if info.kv_group_size else [])
    batches = [req.n_batch] if req.n_batch else list(BATCH_LADDER)
    threads = req.n_threads or profile.threads_for(hw)
    reasons += [f"budget: {format_bytes(budget.host_limit_bytes)} of RAM"
                + (f", Metal working set {format_bytes(budget.gpu_limit_bytes)}" if budget.gpu_limit_bytes else "")
                + f", margin {format_bytes(budget.margin_bytes)}",
                "MLX: weights, KV cache and prefill activations live on the GPU (unified memory)" if metal
                else "MLX on the CPU: everything in host RAM",
                "MLX serves one task at a time (slots 1); label branches are scored one after another"]
    quant = f"{info.quantization_bits}bit" if info.quantization_bits else None
    first = None
    for ctx in ctxs:
        for kv in kvs:
            for nb in batches:
                mem = estimate_mlx(info, ctx, kv, nb, overhead_bytes, metal)
                over, what = shortfall(mem, budget)
                settings = Settings(model_path=info.path, n_ctx=ctx, type_k=kv, type_v=kv,  # type: ignore[arg-type]
                                    flash_attn=False, n_gpu_layers=-1 if metal else 0, use_mmap=False,
                                    use_mlock=False, n_batch=nb, n_ubatch=nb, swa_full=True,
                                    n_threads=threads, slots=1)
                if what is None:
                    reasons.append(f"chosen: ctx {ctx}, KV {kv}, prefill chunks of {nb}")
                    if first is not None:
                        reasons.append(f"tried first: {first[1]}, over {first[2]} by {format_bytes(first[0])}")
                    return Plan(fits=True, backend="mlx", model=info.path, quant=quant, profile=profile.id,
                                settings=settings, memory=mem, budget=budget, reasons=reasons)
                if first is None:
                    first = (over, f"ctx {ctx}, KV {kv}, chunks of {nb}", what, settings, mem)
    assert first is not None
    reasons.append(f"nothing fits: {first[1]} is over {first[2]} by {format_bytes(first[0])}")
    return Plan(fits=False, backend="mlx", model=info.path, quant=quant, profile=profile.id, settings=first[3],
                memory=first[4], budget=budget, reasons=reasons)
