#!/usr/bin/env python3
"""Watches a running hstu_server through a long load (a soak) and checks what must hold at every
sample of its /metrics and of its process:

- each KV tier's pages (used + free) stay its capacity, and pinned pages never exceed used ones;
- counters never go down (every *_total series, histogram _count, _sum and _bucket);
- the process's threads and file descriptors grow by at most --max-extra-threads / --max-extra-fds
  (64) over the first sample that had them;
  its resident memory grows by at most --max-rss-growth-mib from the middle of the run to its end,
  and its GPU memory (nvidia-smi, where present) does not change after the first sample;
- once the load has stopped (the idle sample, taken when --stop-file appears): no request is
  queued or in flight, no page is pinned, each code's hstu_requests_total equals the duration
  histogram's count, and RESOURCE_EXHAUSTED equals the queue_full + user_queue_full refusals.

Each sample is one JSON line in --out; the summary (throughput, p50/p99 a window from the latency
histogram's buckets, cache results, memory) is printed at the end. Exit 1 when a check failed.

  soak_monitor.py --metrics-url http://127.0.0.1:9464/metrics --pid PID --interval 15 \\
      --stop-file /tmp/stop --out samples.jsonl
  soak_monitor.py --metrics-files a.txt b.txt idle.txt     # offline: files as samples, the last idle
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request

SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)(\s+\d+)?$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    """{(name, frozenset(labels)): value} of the text format's samples."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = SERIES.match(line)
        try:
            value = float(m.group(3)) if m else None
        except ValueError:
            value = None
        if value is None:
            raise ValueError(f"not a metrics line: {line[:120]!r}")
        out[(m.group(1), frozenset(LABEL.findall(m.group(2) or "")))] = value
    return out


def get(metrics, name, **labels):
    return metrics.get((name, frozenset(labels.items())))


def is_counter(name):
    return name.endswith(("_total", "_count", "_sum", "_bucket"))


def process_stats(pid):
    """Resident memory (MiB), threads and open fds of `pid`, or {} when it is gone."""
    stats = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    stats["rss_mib"] = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    stats["threads"] = int(line.split()[1])
        stats["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    return stats


def gpu_memory_mib(pid):
    """The GPU memory nvidia-smi reports for `pid`, or None (no nvidia-smi, no GPU context)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def window_quantiles(prev, cur, qs=(0.5, 0.99)):
    """Quantiles (ms) of the OK calls between two samples, from the duration histogram's buckets
    (the upper bound of the bucket the quantile falls in), and their count."""
    buckets = []
    for (name, labels), value in cur.items():
        if name != "hstu_request_duration_seconds_bucket":
            continue
        d = dict(labels)
        if d.get("code") != "OK":
            continue
        le = math.inf if d["le"] == "+Inf" else float(d["le"])
        buckets.append((le, value - prev.get((name, labels), 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    result = {}
    for q in qs:
        le = None
        for bound, count in buckets:
            if total > 0 and count >= q * total:
                le = bound
                break
        result[q] = None if le is None or math.isinf(le) else 1e3 * le
    return result, total


class Checker:
    def __init__(self, args):
        self.args = args
        self.failures = []
        self.samples = []  # (time, metrics, process stats, gpu MiB)
        self.capacity = {}

    def fail(self, sample, message):
        self.failures.append(f"sample {sample}: {message}")

    def add(self, t, metrics, proc, gpu_mib, idle=False):
        i = len(self.samples)
        for tier in ("gpu", "host"):
            used = get(metrics, "hstu_kv_pages", state="used", tier=tier)
            free = get(metrics, "hstu_kv_pages", state="free", tier=tier)
            if used is None or free is None:
                continue
            self.capacity.setdefault(tier, used + free)
            if used + free != self.capacity[tier]:
                self.fail(i, f"{tier} pages used {used:.0f} + free {free:.0f} = "
                             f"{used + free:.0f}, capacity {self.capacity[tier]:.0f}")
        pinned = get(metrics, "hstu_kv_pages", state="pinned", tier="gpu")
        used_gpu = get(metrics, "hstu_kv_pages", state="used", tier="gpu")
        if pinned is not None and used_gpu is not None and pinned > used_gpu:
            self.fail(i, f"pinned pages {pinned:.0f} > used {used_gpu:.0f}")
        if self.samples:
            prev = self.samples[-1][1]
            for key, value in metrics.items():
                before = prev.get(key)
                if is_counter(key[0]) and before is not None and value < before:
                    self.fail(i, f"counter {key[0]}{dict(key[1]) or ''} went down: "
                                 f"{before:g} -> {value:g}")
            # Against the first sample that had each (a first scrape may come without them).
            for what in ("threads", "fds"):
                first = next((s[2][what] for s in self.samples if what in s[2]), None)
                if first is not None and what in proc and proc[what] > first + self.args.max_extra[what]:
                    self.fail(i, f"{what} {proc[what]} (first sample {first})")
            gpu0 = next((s[3] for s in self.samples if s[3] is not None), None)
            if gpu0 is not None and gpu_mib is not None and gpu_mib != gpu0:
                self.fail(i, f"GPU memory {gpu_mib:.0f} MiB (first sample {gpu0:.0f} MiB)")
        if idle:
            self.check_idle(i, metrics)
        self.samples.append((t, metrics, proc, gpu_mib))

    def check_idle(self, i, m):
        for name in ("hstu_queue_depth", "hstu_inflight_requests"):
            if (get(m, name) or 0) != 0:
                self.fail(i, f"idle: {name} {get(m, name):g}, want 0")
        if (get(m, "hstu_kv_pages", state="pinned", tier="gpu") or 0) != 0:
            self.fail(i, "idle: pinned GPU pages "
                         f"{get(m, 'hstu_kv_pages', state='pinned', tier='gpu'):g}, want 0")
        codes = {dict(l)["code"] for (n, l) in m if n == "hstu_requests_total"}
        if not codes:
            self.fail(i, "idle: no hstu_requests_total series")
        for code in sorted(codes):
            total = get(m, "hstu_requests_total", code=code) or 0
            hist = get(m, "hstu_request_duration_seconds_count", code=code) or 0
            if total != hist:
                self.fail(i, f"idle: hstu_requests_total{{code={code}}} {total:g} != duration "
                             f"histogram count {hist:g}")
        refused = sum(get(m, "hstu_queue_rejections_total", reason=r) or 0
                      for r in ("queue_full", "user_queue_full"))
        exhausted = get(m, "hstu_requests_total", code="RESOURCE_EXHAUSTED") or 0
        if refused != exhausted:
            self.fail(i, f"idle: RESOURCE_EXHAUSTED {exhausted:g} != queue_full + "
                         f"user_queue_full {refused:g}")

    def finish(self):
        """The memory-growth check and the summary (a dict)."""
        loaded = [s for s in self.samples[:-1] if s[2]] or [s for s in self.samples if s[2]]
        rss_mid = rss_end = None
        if len(loaded) >= 2:
            rss_mid = loaded[len(loaded) // 2][2].get("rss_mib")
            rss_end = loaded[-1][2].get("rss_mib")
            if rss_mid is not None and rss_end is not None and \
                    rss_end - rss_mid > self.args.max_rss_growth_mib:
                self.failures.append(f"resident memory grew {rss_end - rss_mid:.0f} MiB from the "
                                     f"middle of the run ({rss_mid:.0f}) to its end ({rss_end:.0f})")
        windows = []
        for (t0, m0, _, _), (t1, m1, _, _) in zip(self.samples, self.samples[1:]):
            q, n = window_quantiles(m0, m1)
            windows.append({"seconds": round(t1 - t0, 1), "ok": n,
                            "rps": round(n / (t1 - t0), 1) if t1 > t0 else None,
                            "p50_ms": q[0.5], "p99_ms": q[0.99]})
        last = self.samples[-1][1] if self.samples else {}
        lookups = {dict(l)["result"]: v for (n, l), v in last.items()
                   if n == "hstu_kv_lookups_total"}
        codes = {dict(l)["code"]: v for (n, l), v in last.items() if n == "hstu_requests_total"}
        return {
            "samples": len(self.samples),
            "requests": {k: v for k, v in codes.items() if v},
            "lookups": {k: v for k, v in lookups.items() if v},
            "evictions": {dict(l)["tier"]: v for (n, l), v in last.items()
                          if n == "hstu_kv_evictions_total"},
            "dropped_entries": get(last, "hstu_kv_dropped_entries_total"),
            "graph_replays": get(last, "hstu_cuda_graph_replays_total"),
            "graph_fallbacks": get(last, "hstu_cuda_graph_fallbacks_total"),
            "capacity_pages": self.capacity,
            "rss_mib": {"first": loaded[0][2].get("rss_mib") if loaded else None,
                        "middle": rss_mid, "end": rss_end},
            "threads": [s[2].get("threads") for s in self.samples if s[2]][-1:] or None,
            "gpu_mib": sorted({s[3] for s in self.samples if s[3] is not None}),
            "windows": windows,
            "failures": self.failures,
        }


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--metrics-url")
    src.add_argument("--metrics-files", nargs="+", help="samples from files; the last is idle")
    ap.add_argument("--pid", type=int, help="the server's process (with --metrics-url)")
    ap.add_argument("--interval", type=float, default=15)
    ap.add_argument("--stop-file", help="the load has stopped once it exists: a last, idle sample")
    ap.add_argument("--idle-wait", type=float, default=2, help="seconds from the stop file to the idle sample")
    ap.add_argument("--out", help="one JSON line a sample")
    ap.add_argument("--summary", help="the summary as JSON")
    ap.add_argument("--max-rss-growth-mib", type=float, default=256)
    ap.add_argument("--max-extra-threads", type=int, default=64)
    ap.add_argument("--max-extra-fds", type=int, default=64)
    args = ap.parse_args()
    args.max_extra = {"threads": args.max_extra_threads, "fds": args.max_extra_fds}
    if args.metrics_url and not args.stop_file:
        ap.error("--metrics-url needs --stop-file")
    checker = Checker(args)
    out = open(args.out, "w") if args.out else None

    def record(t, text, idle):
        try:
            metrics = parse_metrics(text)
        except ValueError as e:
            checker.failures.append(f"sample {len(checker.samples)}: {e}")
            return
        proc = process_stats(args.pid) if args.pid else {}
        gpu = gpu_memory_mib(args.pid) if args.pid else None
        checker.add(t, metrics, proc, gpu, idle)
        if out:
            # NaN and infinities (a gauge with no value yet) as null: the line stays JSON.
            finite = lambda v: v if math.isfinite(v) else None
            out.write(json.dumps({"t": round(t, 3), "idle": idle, "process": proc, "gpu_mib": gpu,
                                  "metrics": {k[0] + json.dumps(dict(sorted(k[1])), separators=(",", ":"))
                                              if k[1] else k[0]: finite(v) for k, v in metrics.items()}},
                                 allow_nan=False) + "\n")
            out.flush()

    if args.metrics_files:
        for i, path in enumerate(args.metrics_files):
            with open(path) as f:
                record(float(i), f.read(), i == len(args.metrics_files) - 1)
    else:
        start = time.monotonic()
        while not os.path.exists(args.stop_file):
            try:
                record(time.monotonic() - start, scrape(args.metrics_url), False)
            except OSError as e:
                checker.failures.append(f"scrape at {time.monotonic() - start:.0f} s failed: {e}")
            deadline = time.monotonic() + args.interval
            while time.monotonic() < deadline and not os.path.exists(args.stop_file):
                time.sleep(0.2)
        time.sleep(args.idle_wait)
        try:
            record(time.monotonic() - start, scrape(args.metrics_url), True)
        except OSError as e:
            checker.failures.append(f"idle scrape failed: {e}")
    summary = checker.finish()
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"soak: {summary['samples']} samples; requests {summary['requests']}; "
          f"cache {summary['lookups']}")
    print(f"soak: resident MiB first/middle/end {summary['rss_mib']}; GPU MiB seen "
          f"{summary['gpu_mib']}; evictions {summary['evictions']}, dropped entries "
          f"{summary['dropped_entries']}; graph replays {summary['graph_replays']}, fallbacks "
          f"{summary['graph_fallbacks']}")
    for w in summary["windows"]:
        print(f"soak: window {w['seconds']:>6} s  ok {w['ok']:>8.0f}  rps {w['rps']}  "
              f"p50 <= {w['p50_ms']} ms  p99 <= {w['p99_ms']} ms")
    for f in summary["failures"]:
        print(f"soak: FAILED {f}")
    if not summary["samples"]:
        print("soak: FAILED no sample was taken")
        return 1
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
