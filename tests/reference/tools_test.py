#!/usr/bin/env python3
"""The Python tools fail loudly: compare_rank_outputs.py on every mismatch it promises to catch,
hstu_reference.py on bad requests (exit 1, as hstu_rank), make_requests.py on empty workloads.
Each case failed (passed, or raised a traceback) before these checks were added."""

import argparse
import json
import os
import subprocess
import sys


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hstu-model", required=True)
    ap.add_argument("--tools-dir", required=True)
    ap.add_argument("--work-dir", required=True)
    args = ap.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    tools = args.tools_dir
    failures = []

    def expect(what, rc, out, want_rc, needle):
        if rc != want_rc or needle not in out:
            failures.append(f"{what}: exit {rc} (want {want_rc}), output lacks '{needle}':\n{out[-600:]}")

    def write(name, rows):
        path = os.path.join(args.work_dir, name)
        with open(path, "w") as f:
            for r in rows:
                f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
        return path

    base = {"user_id": 1, "scores": [[0.5, 0.25, 0.125]], "reused_tokens": 0, "computed_tokens": 3}
    a = write("a.jsonl", [base])
    compare = [sys.executable, os.path.join(tools, "compare_rank_outputs.py")]
    rc, out = run(compare + [a, a])
    expect("identical outputs", rc, out, 0, "worst |difference| 0.000e+00")
    cases = {
        "fewer tasks": ({**base, "scores": [[0.5]]}, "3 vs 1 tasks"),
        "another user": ({**base, "user_id": 99}, "user_id 1 vs 99"),
        "NaN written as null": ({**base, "scores": [[None, 0.25, 0.125]]}, "non-finite"),
    }
    for what, (row, needle) in cases.items():
        rc, out = run(compare + [a, write("b.jsonl", [row])])
        expect(what, rc, out, 1, needle)
    empty = write("empty.jsonl", [])
    rc, out = run(compare + [empty, empty])
    expect("two empty outputs", rc, out, 1, "no requests to compare")
    rc, out = run(compare + [a, write("junk.jsonl", ["{not json"])])
    expect("a line that is not JSON", rc, out, 1, "line 1 is not JSON")

    model = os.path.join(args.work_dir, "tiny.safetensors")
    rc, out = run([args.hstu_model, "init", "--preset", "tiny", "--out", model])
    expect("hstu_model init", rc, out, 0, "wrote")
    make = [sys.executable, os.path.join(tools, "make_requests.py"), "--model", model,
            "--out", os.path.join(args.work_dir, "r.jsonl")]
    for flag in ("--users", "--visits"):
        rc, out = run(make + [flag, "0"])
        expect(f"make_requests {flag} 0", rc, out, 2, "must be >= 1")

    reference = [sys.executable, os.path.join(tools, "hstu_reference.py"), "--model", model]
    bad = write("bad.jsonl", [{"user_id": 1, "history_item_ids": [1], "history_actions": [0]},
                              {"user_id": 2**64, "history_item_ids": [], "history_actions": [],
                               "candidate_item_ids": [3]}])
    rc, out = run(reference + ["--input", bad])
    expect("no candidates", rc, out, 1, "candidate_item_ids is empty")
    expect("user_id 2^64", rc, out, 1, "user_id must be an integer in [0, 2^64)")
    kept = write("kept.jsonl", ["previous results"])
    rc, out = run(reference + ["--input", os.path.join(args.work_dir, "missing.jsonl"),
                               "--output", kept])
    with open(kept) as f:
        if f.read() != "previous results\n":
            failures.append("a missing --input emptied the existing --output")

    for f in failures:
        print("FAIL: " + f)
    print(f"{'FAILED' if failures else 'passed'}: tools test")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
