#!/usr/bin/env python3
"""Compares two hstu_rank outputs of the same requests (e.g. --device cuda:0 vs --device cpu).

Fails (exit 1) on any error line, NaN/Inf (written as null), a shape mismatch (lines, candidates,
tasks), a different user or reused/computed token count, no lines at all, or a score difference
above --tol; prints the worst difference either way.

    compare_rank_outputs.py A.jsonl B.jsonl [--tol 2e-3] [--bf16 C.jsonl]

--bf16 C.jsonl (hstu_rank --device cpu-bf16 on the same requests, A being --device cpu) adds DESIGN
§2.4's own test: B is correct when it is as close to A as a straightforward bf16 computation (C)
is. Then a difference above --tol fails only if B is also further from A than C is, by more than
--bf16-slack on the mean |difference| or on the worst one.
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
    ap.add_argument("--bf16", help="hstu_rank --device cpu-bf16 output of the same requests")
    ap.add_argument("--bf16-slack", type=float, default=1.25,
                    help="how much further from A than the bf16 emulation B may be (ratio)")
    args = ap.parse_args()
    for name in ("tol", "bf16_slack"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            ap.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    try:
        rows_a, rows_b = read(args.a), read(args.b)
        rows_c = read(args.bf16) if args.bf16 else None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        print(f"error: {e}")
        return 1
    problems, over_tol, diffs = compare(rows_a, rows_b, args.tol)
    worst = max(diffs, default=0.0)
    mean = sum(diffs) / len(diffs) if diffs else 0.0
    print(f"{len(rows_a)} requests, {len(diffs)} scores, worst |difference| {worst:.3e}, "
          f"mean {mean:.3e} (tolerance {args.tol})")
    failures = problems + over_tol
    if args.bf16:
        emu_problems, _, emu = compare(rows_a, rows_c, args.tol)
        emu_worst, emu_mean = max(emu, default=0.0), sum(emu) / len(emu) if emu else 0.0
        print(f"  the bf16 emulation ({args.bf16}): worst {emu_worst:.3e}, mean {emu_mean:.3e}")
        as_close = (worst <= args.bf16_slack * emu_worst and mean <= args.bf16_slack * emu_mean)
        print(f"  as close as the bf16 emulation (within x{args.bf16_slack} on worst and mean): "
              f"{'yes' if as_close else 'NO'} (worst x{worst / max(emu_worst, 1e-30):.2f}, "
              f"mean x{mean / max(emu_mean, 1e-30):.2f})")
        if as_close:
            # Scores beyond --tol pass; what is broken in either output does not.
            failures = problems + ["bf16 emulation: " + p for p in emu_problems]
    for p in failures[:20]:
        print("  " + p)
    return 1 if failures else 0


def read(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path} line {n} is not JSON: {e}") from None
            if not isinstance(row, dict) or ("error" not in row and not all(
                    k in row for k in ("user_id", "scores", "reused_tokens", "computed_tokens"))):
                raise ValueError(f"{path} line {n} is not an hstu_rank output line")
            if "error" not in row and not (
                    isinstance(row["scores"], list)
                    and all(isinstance(c, list) for c in row["scores"])):
                raise ValueError(f"{path} line {n}: scores is not a list of lists (one per "
                                 "candidate, a score per task)")
            rows.append(row)
    return rows


def finite(x):
    """hstu_rank writes NaN and Inf as null (JSON has neither)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def compare(rows_a, rows_b, tol):
    """(problems, scores beyond tol, every |score difference|) of two outputs of the same requests.
    Problems are what is wrong whatever the tolerance: errors, non-finite scores, shapes, token
    counts."""
    problems, over_tol, diffs = [], [], []
    if len(rows_a) != len(rows_b):
        problems.append(f"{len(rows_a)} lines vs {len(rows_b)}")
    if not rows_a or not rows_b:
        problems.append("no requests to compare")
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b), 1):
        if "error" in ra or "error" in rb:
            problems.append(f"line {i}: error {ra.get('error')} / {rb.get('error')}")
            continue
        for key in ("user_id", "reused_tokens", "computed_tokens"):
            if ra[key] != rb[key]:
                problems.append(f"line {i}: {key} {ra[key]} vs {rb[key]}")
        if len(ra["scores"]) != len(rb["scores"]):
            problems.append(f"line {i}: {len(ra['scores'])} vs {len(rb['scores'])} candidates")
            continue
        for c, (sa, sb) in enumerate(zip(ra["scores"], rb["scores"])):
            if len(sa) != len(sb):
                problems.append(f"line {i} candidate {c}: {len(sa)} vs {len(sb)} tasks")
                continue
            for t, (x, y) in enumerate(zip(sa, sb)):
                if not (finite(x) and finite(y)):
                    problems.append(f"line {i} candidate {c} task {t}: non-finite {x} / {y}")
                    continue
                d = abs(x - y)
                diffs.append(d)
                if d > tol and len(over_tol) < 20:
                    over_tol.append(f"line {i} candidate {c} task {t}: {x:.6f} vs {y:.6f} (|d| {d:.2e})")
    return problems, over_tol, diffs


if __name__ == "__main__":
    sys.exit(main())
