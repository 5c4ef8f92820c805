"""A node's throughput on a model as the planner figures it, for placing models where no `nodeagent bench` has
measured the node (a bench result, when the node has one, is used instead: ``fleet/scheduler.py``).

Decoding on a CPU, on Apple Silicon and on a GPU is bound by memory bandwidth: each token reads every weight
once. So tokens/s is about the memory's bandwidth over the weights' bytes, times the share of the spec's peak
that llama.cpp's kernels reach; a typed task is a few dozen tokens (a label's few, an extraction's tens, and
its prompt read in batches). The scheduler only compares these figures with one another and with the queue's
arrival rate, so a constant factor off moves no placement.
"""

from __future__ import annotations

from nodeagent.planner.types import Plan
from nodeagent.profiles import DeviceProfile

DECODE_EFFICIENCY = 0.5  # the share of the spec's peak bandwidth llama.cpp's decode reaches
TOKENS_PER_TASK = 32  # a nominal typed task
DEFAULT_BANDWIDTH_GB_S = 20.0  # a profile that names none
MIN_WEIGHT_BYTES = 1 << 20  # the fake backend's models may weigh nothing


def decode_tokens_per_s(plan: Plan, profile: DeviceProfile) -> float:
    m = plan.memory
    weights = max(MIN_WEIGHT_BYTES, m.weights_mapped_bytes + m.weights_anon_bytes + m.weights_gpu_bytes)
    bandwidth = (profile.nominal.memory_bandwidth_gb_s or DEFAULT_BANDWIDTH_GB_S) * 1e9
    return DECODE_EFFICIENCY * bandwidth / weights


def tasks_per_s(plan: Plan, profile: DeviceProfile) -> float:
    return decode_tokens_per_s(plan, profile) / TOKENS_PER_TASK


def prefill_tokens_per_s(n_params: int, profile: DeviceProfile) -> float | None:
    """Prompt tokens/s the profile predicts for a model of ``n_params`` parameters (reading a prompt is bound by
    compute: about 2 FLOP a parameter a token, at the device's measured rate, ``nominal.prefill_gflop_s``); None
    where the profile names no rate."""
    rate = profile.nominal.prefill_gflop_s
    return rate * 1e9 / (2 * n_params) if rate and n_params else None
