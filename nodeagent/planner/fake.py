"""The fake backend's plan: no memory (or the made-up size its spec names), the context its spec (or the user) names, the slots asked for. Pure,
like every planner: the spec's own parsing is the backend's (``backends/fake.py``)."""

from __future__ import annotations

from typing import Protocol

from nodeagent.hardware.types import HardwareInfo
from nodeagent.planner.budget import budget_for
from nodeagent.planner.types import Memory, Plan, Requirements, Settings
from nodeagent.profiles import DeviceProfile


class FakeModelInfo(Protocol):
    spec: str
    ctx_per_slot: int
    mem_bytes: int


def plan_fake(info: FakeModelInfo, hw: HardwareInfo, profile: DeviceProfile, req: Requirements,
              overhead_bytes: int = 0) -> Plan:
    slots = req.slots or 1
    size = info.mem_bytes  # made up (fake:mem_mb=N), as if all weights
    zero = Memory(weights_mapped_bytes=0, weights_anon_bytes=size, kv_bytes=0, compute_bytes=0,
                  compute_resident_bytes=0, output_bytes=0, runtime_bytes=0, overhead_bytes=0, total_bytes=size,
                  host_bytes=size, gpu_bytes=0)
    settings = Settings(model_path=info.spec, n_ctx=(req.ctx_tokens or info.ctx_per_slot) * slots, type_k="f16",
                        type_v="f16", flash_attn=False, n_gpu_layers=0, use_mmap=False, use_mlock=False, n_batch=512,
                        n_ubatch=512, swa_full=True, n_threads=req.n_threads or profile.threads_for(hw), slots=slots)
    budget = budget_for(hw, profile)  # the machine's, as a real model's: its made-up size is held to it
    fits = size <= budget.host_limit_bytes
    return Plan(fits=fits, backend="fake", model=info.spec, quant="fake", profile=profile.id, settings=settings,
                memory=zero, budget=budget, reasons=["the fake backend: made-up logits, for tests"]
                + ([] if fits else [f"its made-up {size} bytes are over the budget of {budget.host_limit_bytes}"]))


