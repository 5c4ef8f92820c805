"""`nodeagent bench`: per-device benchmarks (load, speeds, slots, memory against the plan, overhead)."""
