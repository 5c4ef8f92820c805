"""The per-device benchmark: `nodeagent bench` on SmolLM2, Gemma 3 and the bandwidth-bound synthetic 1B model
(benchmarks/synthetic_model.py, Q8_0 and Q4_0), saved for comparing.

Runs the full bench (not --quick) for each model on this machine's matched profile and writes
benchmarks/results/<profile>/<model file>.json and .md and the PNG plots (matplotlib: the `plots` extra).
Anyone can run it on their own device and send the folder; benchmarks/compare.py renders the table across
devices.

Usage: python benchmarks/device.py [--models smollm2,gemma,synthetic-q8_0,synthetic-q4_0] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nodeagent.bench.run import BenchSpec, bench, save, summary_rows  # noqa: E402
from nodeagent.config import load  # noqa: E402
from nodeagent.node import resolve_device  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m-it"}
SYNTHETIC = {"synthetic-q8_0": "Q8_0", "synthetic-q4_0": "Q4_0"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    config = load()
    device = resolve_device(config)
    out = ROOT / "benchmarks" / "results" / device.profile.id
    for key in args.models.split(","):
        if key in SYNTHETIC:
            from benchmarks.synthetic_model import synthetic_model

            path = synthetic_model(SYNTHETIC[key])
        else:
            path = test_model_path(MODELS[key], config.test_models_dir)
        result = bench(BenchSpec(model=str(path), quick=args.quick), device,
                       lambda line: print(f"{key}: {line}", file=sys.stderr, flush=True))
        for p in save(result, out):
            print(f"wrote {p.relative_to(ROOT)}", file=sys.stderr)
        for k, v in summary_rows(result):
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
