#!/usr/bin/env python3
"""Per-kernel GPU time of each forward step, from an Nsight Compute CSV (scripts/profile_device.sh).

A forward step starts at the embedding kernel. Steps with the same row count (the embedding's grid)
and kernel count are the same work repeated (warm-ups, reps); the last of each run of equal steps
is printed with every kernel's mean and summed duration, grouped by kernel and grid. Durations are
the kernels' own GPU time (gpu__time_duration), with the profiler serialising kernels: no launch
gaps and no overlap between programmatically dependent kernels, so a step's total is above what
its CUDA graph replay takes.

Usage: ncu_steps.py NCU.csv [--all]   (--all, before or after the file: every step, not only the
last of each run)
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
            missing = [k for k in ("Metric Unit", "Metric Value", "Kernel Name", "Grid Size")
                       if k not in d]
            if missing:
                raise ValueError(f"{path}: no column {', '.join(missing)} (ncu --csv output?)")
            unit = d["Metric Unit"]
            if unit not in UNIT_US:
                raise ValueError(f"{path}: unknown time unit '{unit}' for {d['Kernel Name'][:60]}")
            try:
                value = float(d["Metric Value"].replace(",", ""))
            except ValueError:
                raise ValueError(f"{path}: {d['Kernel Name'][:60]} has no duration "
                                 f"('{d['Metric Value']}')") from None
            kernels.append((d["Kernel Name"], d["Grid Size"], value * UNIT_US[unit]))
    return kernels


UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
           "second": 1e6, "s": 1e6}


def main():
    args = sys.argv[1:]
    print_all = "--all" in args
    files = [a for a in args if a != "--all"]
    if len(files) != 1:
        sys.exit(__doc__)
    try:
        kernels = read_kernels(files[0])
    except (OSError, ValueError) as e:
        sys.exit(f"ncu_steps.py: {e}")
    starts = [i for i, k in enumerate(kernels) if "mbedding" in k[0]]
    if not starts:
        sys.exit(f"{files[0]}: no embedding kernel, so no forward step found")
    steps = [kernels[a:b] for a, b in zip(starts, starts[1:] + [len(kernels)])]
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
