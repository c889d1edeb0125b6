#!/usr/bin/env python3
"""Per-kernel GPU time of each forward step, from an Nsight Compute CSV (scripts/profile_device.sh).

A forward step starts at the embedding kernel. Steps with the same row count (the embedding's grid)
and kernel count are the same work repeated (warm-ups, reps); the last of each run of equal steps
is printed with every kernel's mean and summed duration, grouped by kernel and grid. Durations are
the kernels' own GPU time (gpu__time_duration), with the profiler serialising kernels: no launch
gaps and no overlap between programmatically dependent kernels, so a step's total is above what
its CUDA graph replay takes.

Usage: ncu_steps.py NCU.csv [--all]   (--all: every step, not only the last of each run)
"""
import csv
import re
import sys


def short_name(name):
    name = name.replace("void ", "").replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    name = name.replace("hstu::cuda::", "").replace("hstu::", "")
    name = re.sub(r"\(.*", "", name)  # parameter list
    depth, out = 0, []
    for ch in name:  # template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)[:64]


def read_kernels(path):
    header, kernels = None, []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "ID":
                header = row
                continue
            if header is None or len(row) != len(header):
                continue
            d = dict(zip(header, row))
            if d.get("Metric Name") != "gpu__time_duration.sum":
                continue
            scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(d["Metric Unit"], 1e-3)
            kernels.append((d["Kernel Name"], d["Grid Size"],
                            float(d["Metric Value"].replace(",", "")) * scale))
    return kernels


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    kernels = read_kernels(sys.argv[1])
    starts = [i for i, k in enumerate(kernels) if "mbedding" in k[0]]
    if not starts:
        sys.exit(f"{sys.argv[1]}: no embedding kernel, so no forward step found")
    steps = [kernels[a:b] for a, b in zip(starts, starts[1:] + [len(kernels)])]
    print_all = "--all" in sys.argv[2:]
    for i, step in enumerate(steps):
        key = (step[0][1], len(step))
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        if not print_all and nxt is not None and (nxt[0][1], len(nxt)) == key:
            continue  # not the last of its run
        groups = {}
        for name, grid, us in step:
            groups.setdefault((short_name(name), grid), []).append(us)
        total = sum(us for _, _, us in step)
        print(f"\n### step {i}: embedding grid {step[0][1]}, {len(step)} kernels, "
              f"{total:.1f} us of kernel time\n")
        print("| kernel | grid | launches | mean (us) | sum (us) |\n|---|---|---|---|---|")
        for (name, grid), times in groups.items():
            print(f"| {name} | {grid} | {len(times)} | {sum(times) / len(times):.2f} | "
                  f"{sum(times):.1f} |")


if __name__ == "__main__":
    main()
