"""Rewrite the README's benchmark paragraph from benchmarks/results/*.json (never by hand).

Usage: python benchmarks/readme_results.py
"""
import json
import re
from pathlib import Path
root = str(Path(__file__).resolve().parent.parent) + '/'
d = json.load(open(root + 'benchmarks/results/memory_accuracy.json'))
s = d['summary']
t = json.load(open(root + 'benchmarks/results/tasks.json'))
comp = s['components']
cls_lines = []
for r in t:
    c = r['classification']
    e = r['extraction']
    cls_lines.append(f"- {r['model']}: extraction {e['constrained']['schema_valid']}/{e['constrained']['inputs']} "
                     f"schema-valid with constrained decoding vs {e['unconstrained']['schema_valid']}/"
                     f"{e['unconstrained']['inputs']} unconstrained; classification by label scoring "
                     f"{c['scoring']['tasks_per_s']} tasks/s vs {c['naive']['tasks_per_s']} for a chat completion "
                     f"with a JSON response format ({c['speedup_tasks_per_s']}x), accuracy "
                     f"{c['scoring']['accuracy']} vs {c['naive']['accuracy']}.")
text = f"""## Benchmarks (measured here, 2 cores)

Memory planner ([benchmarks/results/memory_accuracy.md](benchmarks/results/memory_accuracy.md),
`python benchmarks/memory_accuracy.py [--resume]`): {s['cases']} of the {s['matrix_cases']} cases of the matrix
have run (all of context 512 and 2048; context 8192 with mmap on and n_ubatch 512 for every model, KV
setting and SWA setting; {s['cases'] - 108} of the 36 other 8192 variants; `--resume` runs the rest). Against the buffers llama.cpp
reports, every case is within target for every component (largest errors: weights
{comp['weights_mapped_bytes']['max_abs_error_pct']} % / {comp['weights_anon_bytes']['max_abs_error_pct']} %,
KV {comp['kv_bytes']['max_abs_error_pct']} %, output within 1 MiB, compute
{comp['compute_bytes']['max_abs_error_pct']} %). The planned total over the peak RSS after filling the context:
{s['planned_over_peak']['min']} to {s['planned_over_peak']['max']} (median {s['planned_over_peak']['median']}),
never more than 2 % below. The naive rule "file size + f16 KV", in the same run: {s['naive_over_peak']['min']}
to {s['naive_over_peak']['max']} of the peak (median {s['naive_over_peak']['median']}), more than 2 % below it in
{s['naive_over_peak']['below_peak_by_more_than_2pct']} cases.

Typed tasks ([benchmarks/results/tasks.md](benchmarks/results/tasks.md), `python benchmarks/tasks.py`;
only the SmolLM2 pass has run so far, and it shared the CPU with the memory benchmark):
""" + "\n".join(cls_lines) + """
Label scoring does not yet reach the 2x throughput target and is less accurate than the JSON route on this
135M model; see the issue notes.
"""
readme = open(root + 'README.md').read()
readme = re.sub(r"## Benchmarks \(measured here, 2 cores\)\n.*?(?=\n## )", text.rstrip() + "\n", readme, flags=re.S) \
    if "## Benchmarks (measured here" in readme else readme.replace("## MLX\n", text + "\n## MLX\n")
open(root + 'README.md', 'w').write(readme)

