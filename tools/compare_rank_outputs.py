#!/usr/bin/env python3
"""Compares two hstu_rank outputs of the same requests (e.g. --device cuda:0 vs --device cpu).

Fails (exit 1) on any error line, NaN/Inf, a shape mismatch, a score difference above --tol, or a
different reused/computed token count; prints the worst difference either way.

    compare_rank_outputs.py A.jsonl B.jsonl [--tol 2e-3]
"""

import argparse
import json
import math
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol", type=float, default=2e-3)
    args = ap.parse_args()
    with open(args.a) as fa, open(args.b) as fb:
        rows_a = [json.loads(l) for l in fa if l.strip()]
        rows_b = [json.loads(l) for l in fb if l.strip()]
    problems = []
    if len(rows_a) != len(rows_b):
        problems.append(f"{len(rows_a)} lines vs {len(rows_b)}")
    worst, scores = 0.0, 0
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b), 1):
        if "error" in ra or "error" in rb:
            problems.append(f"line {i}: error {ra.get('error')} / {rb.get('error')}")
            continue
        for key in ("reused_tokens", "computed_tokens"):
            if ra[key] != rb[key]:
                problems.append(f"line {i}: {key} {ra[key]} vs {rb[key]}")
        if len(ra["scores"]) != len(rb["scores"]):
            problems.append(f"line {i}: {len(ra['scores'])} vs {len(rb['scores'])} candidates")
            continue
        for c, (sa, sb) in enumerate(zip(ra["scores"], rb["scores"])):
            for t, (x, y) in enumerate(zip(sa, sb)):
                scores += 1
                if not (math.isfinite(x) and math.isfinite(y)):
                    problems.append(f"line {i} candidate {c} task {t}: non-finite {x} / {y}")
                    continue
                d = abs(x - y)
                worst = max(worst, d)
                if d > args.tol and len(problems) < 20:
                    problems.append(f"line {i} candidate {c} task {t}: {x:.6f} vs {y:.6f} (|d| {d:.2e})")
    print(f"{len(rows_a)} requests, {scores} scores, worst |difference| {worst:.3e} (tolerance {args.tol})")
    for p in problems[:20]:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
