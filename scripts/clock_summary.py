#!/usr/bin/env python3
"""Summarises nvidia-smi's clock log per benchmark run (scripts/run_device.sh bench).

    clock_summary.py gpu_clocks.csv bench_spans.txt

gpu_clocks.csv: nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits lines (timestamps in UTC);
bench_spans.txt: "mode start end" lines (Unix seconds). Prints, per run, over the samples in which
the GPU was busy (utilisation >= 50 %, so that start-up and host-side phases do not count): the SM
clock's median and minimum, the power's median and maximum, and the share of samples in which the
software power cap (reason bit 0x4) held the clock down.
"""

import datetime
import statistics
import sys

SW_POWER_CAP = 0x4
BUSY_UTILISATION = 50


def samples(path):
    out = []
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.split(",")]
            if len(cells) < 5:
                continue
            try:
                t = datetime.datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f")
                out.append((t.replace(tzinfo=datetime.timezone.utc).timestamp(), float(cells[1]),
                            float(cells[2]), float(cells[3]), int(cells[4], 16)))
            except ValueError:
                continue  # a cut-off last line, or a field nvidia-smi could not read
    return out


def spans(path):
    """(mode, start, end) of each "mode start end" line; blank lines skipped."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            cells = line.split()
            try:
                if len(cells) != 3:
                    raise ValueError(f"{len(cells)} fields")
                out.append((cells[0], float(cells[1]), float(cells[2])))
            except ValueError as e:
                raise ValueError(f"{path} line {n} is not 'mode start end': {e}") from None
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    try:
        log, runs = samples(sys.argv[1]), spans(sys.argv[2])
    except (OSError, ValueError) as e:
        sys.exit(f"clock_summary.py: {e}")
    print("| run | busy samples | SM clock median / min (MHz) | power median / max (W) | power-capped |")
    print("|---|---|---|---|---|")
    for mode, start, end in runs:
        sel = [s for s in log
               if start <= s[0] <= end and s[3] >= BUSY_UTILISATION]
        if not sel:
            print(f"| {mode} | 0 | – | – | – |")
            continue
        clocks, power = [s[1] for s in sel], [s[2] for s in sel]
        capped = sum(1 for s in sel if s[4] & SW_POWER_CAP) / len(sel)
        print(f"| {mode} | {len(sel)} | {statistics.median(clocks):.0f} / {min(clocks):.0f} | "
              f"{statistics.median(power):.0f} / {max(power):.0f} | {100 * capped:.0f} % |")


if __name__ == "__main__":
    main()
