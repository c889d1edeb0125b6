#!/usr/bin/env python3
"""The Python tools fail loudly: compare_rank_outputs.py on every mismatch it promises to catch,
hstu_reference.py on bad requests (exit 1, as hstu_rank), make_requests.py on empty workloads,
soak_monitor.py on each metrics invariant it checks.
Each case failed (passed, or raised a traceback) before these checks were added."""

import argparse
import json
import os
import struct
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
    rc, out = run(compare + [a, write("flat.jsonl", [{**base, "scores": 0.5}])])
    expect("scores not a list of lists", rc, out, 1, "scores is not a list of lists")
    rc, out = run(compare + [a, a, "--tol", "nan"])
    expect("--tol nan", rc, out, 2, "--tol must be a finite number >= 0")
    # --bf16: within --tol passes whatever the emulation's distance (before: B within 2e-3 but
    # further from A than an emulation 1e-5 away failed); beyond --tol, B passes only when it is
    # as close to A as the emulation is.
    near = write("near.jsonl", [{**base, "scores": [[0.5005, 0.25, 0.125]]}])
    emu_close = write("emu_close.jsonl", [{**base, "scores": [[0.50001, 0.25, 0.125]]}])
    rc, out = run(compare + [a, near, "--bf16", emu_close])
    expect("--bf16, B within --tol, the emulation closer", rc, out, 0, "worst |difference| 5.000e-04")
    far = write("far.jsonl", [{**base, "scores": [[0.505, 0.25, 0.125]]}])
    rc, out = run(compare + [a, far, "--bf16", emu_close])
    expect("--bf16, B beyond --tol, the emulation closer", rc, out, 1, "as close as the bf16 emulation")
    emu_far = write("emu_far.jsonl", [{**base, "scores": [[0.506, 0.25, 0.125]]}])
    rc, out = run(compare + [a, far, "--bf16", emu_far])
    expect("--bf16, B beyond --tol, as close as the emulation", rc, out, 0, "yes")

    model = os.path.join(args.work_dir, "tiny.safetensors")
    rc, out = run([args.hstu_model, "init", "--preset", "tiny", "--out", model])
    expect("hstu_model init", rc, out, 0, "wrote")
    make = [sys.executable, os.path.join(tools, "make_requests.py"), "--model", model,
            "--out", os.path.join(args.work_dir, "r.jsonl")]
    for flag in ("--users", "--visits"):
        rc, out = run(make + [flag, "0"])
        expect(f"make_requests {flag} 0", rc, out, 2, "must be >= 1")

    # Small workloads keep the request whose candidates must be chunked (before: the first two
    # requests, given 1 and max_candidates candidates, could overwrite it).
    with open(model, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    max_candidates = int(header["__metadata__"]["hstu.max_candidates"])
    for users in (1, 2, 3):
        rc, out = run(make + ["--users", str(users), "--visits", "1", "--seed", "2"])
        expect(f"make_requests --users {users} --visits 1", rc, out, 0, "")
        with open(os.path.join(args.work_dir, "r.jsonl")) as f:
            counts = [len(json.loads(line)["candidate_item_ids"]) for line in f]
        if max(counts) <= max_candidates:
            failures.append(f"make_requests --users {users}: no request past {max_candidates} "
                            f"candidates: {counts}")

    # The reference checks a model file as the C++ loader does (before: NaN weights scored as NaN
    # and written as bare NaN, overlapping or trailing data scored, a missing tensor a traceback).
    with open(model, "rb") as f:
        blob = f.read()
    data_start = 8 + header_len
    first = min(info["data_offsets"][0] for name, info in header.items() if name != "__metadata__")
    requests = write("one.jsonl", [{"user_id": 1, "history_item_ids": [1], "history_actions": [0],
                                    "candidate_item_ids": [3]}])

    def with_header(h, data):
        text = json.dumps(h).encode()
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text + data

    data = blob[data_start:]
    name0 = next(n for n, i in header.items() if n != "__metadata__" and i["data_offsets"][0] == first)
    nan = bytearray(data)
    nan[first:first + 4] = b"\x00\x00\xc0\x7f"  # a float32 NaN
    missing = {k: v for k, v in header.items() if k != "layers.0.uvqk.bias"}
    overlap = json.loads(json.dumps(header))
    b, e = overlap["layers.0.uvqk.bias"]["data_offsets"]
    overlap["layers.0.uvqk.bias"]["data_offsets"] = [b - 4, e - 4]
    capital_true = json.loads(json.dumps(header))
    capital_true["__metadata__"]["hstu.position_encoding"] = "True"
    extra = json.loads(json.dumps(header))
    extra["zzz.extra"] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + 8]}
    reshaped = json.loads(json.dumps(header))
    reshaped["layers.0.input_norm.weight"]["shape"] = [2, reshaped["layers.0.input_norm.weight"]["shape"][0] // 2]
    misspelt = json.loads(json.dumps(header))
    misspelt["__metadata__"]["hstu.attention_norm_length"] = "64"
    wrong_case = json.loads(json.dumps(header))
    wrong_case["__metadata__"]["HSTU.max_attn_len"] = "16"
    non_ascii = json.loads(json.dumps(header))
    non_ascii["__metadata__"]["hstu\u00e9"] = "1"  # the C++ loader refuses it: ASCII rules both
    bad_models = {
        # Before: ignored, and the default norm length scored in its place.
        "a misspelt metadata key": (misspelt, "unknown metadata key 'hstu.attention_norm_length'", data),
        # Before: a key ours but for its case was ignored, and the window's default scored.
        "a metadata key hstu + a non-ASCII letter": (non_ascii, "unknown metadata key", data),
        "a metadata key in the wrong case": (
            wrong_case, "unknown metadata key 'HSTU.max_attn_len' (did you mean 'hstu.max_attn_len'?", data),
        "NaN weight": (bytes(data), f"tensor {name0} contains NaN or Inf", bytes(nan)),
        # Before: read as false and scored, or kept out of the model silently, or a traceback.
        "position encoding 'True'": (capital_true, "is not true/false", data),
        "an unexpected tensor": (extra, "unexpected tensor zzz.extra", data + b"\0" * 8),
        "a norm of the wrong shape": (reshaped, "layers.0.input_norm.weight has shape", data),
        "trailing bytes": (None, "trailing bytes", data + b"\0" * 8),
        "missing tensor": (missing, "hole", data),
        "overlapping tensors": (overlap, "overlaps", data),
    }
    for what, (h, needle, body) in bad_models.items():
        path = os.path.join(args.work_dir, "bad.safetensors")
        with open(path, "wb") as f:
            f.write(with_header(header if not isinstance(h, dict) else h, body))
        rc, out = run([sys.executable, os.path.join(tools, "hstu_reference.py"), "--model", path,
                       "--input", requests])
        expect(f"reference on a model with {what}", rc, out, 1, needle)
        expect(f"reference on a model with {what}", rc, out, 1, "error: ")
        if "Traceback" in out:
            failures.append(f"reference on a model with {what}: a traceback\n{out[-600:]}")

    reference = [sys.executable, os.path.join(tools, "hstu_reference.py"), "--model", model]
    # hstu.attention_norm_len defaults to max history tokens + max candidates (DESIGN §2.2), as
    # the C++ loader has it; tiny's is that sum, so the scores must not change without it.
    no_norm_len = json.loads(json.dumps(header))
    del no_norm_len["__metadata__"]["hstu.attention_norm_len"]
    defaulted = os.path.join(args.work_dir, "no_norm_len.safetensors")
    with open(defaulted, "wb") as f:
        f.write(with_header(no_norm_len, data))
    def score(what, model_path):
        """The reference's output lines on `requests`, or None (a failure is recorded)."""
        out_path = os.path.join(args.work_dir, "scored.out.jsonl")
        rc, out = run([sys.executable, os.path.join(tools, "hstu_reference.py"), "--model",
                       model_path, "--input", requests, "--output", out_path])
        expect(f"reference on {what}", rc, out, 0, "")
        return open(out_path).read() if rc == 0 else None

    scored = {name: score(f"a model with hstu.attention_norm_len {name}", path)
              for name, path in (("given", model), ("defaulted", defaulted))}
    if scored["given"] != scored["defaulted"] or not scored["given"]:
        failures.append(f"hstu.attention_norm_len defaulted scores differently: {scored}")

    # A saturated head keeps its scores inside (0, 1), as the engine's ScoreFromLogit does (before:
    # exactly 1.0 and 0.0).
    last = max(int(n.split(".")[1]) for n in header if n.startswith("head.") and n.endswith(".bias"))
    info = header[f"head.{last}.bias"]
    if info["dtype"] != "F32":
        failures.append(f"head.{last}.bias is {info['dtype']}; this check writes F32")
    else:
        b0 = info["data_offsets"][0]
        saturated = bytearray(data)
        saturated[b0:b0 + 8] = struct.pack("<2f", 200.0, -200.0)
        sat_path = os.path.join(args.work_dir, "saturated.safetensors")
        with open(sat_path, "wb") as f:
            f.write(with_header(header, bytes(saturated)))
        lines = score("a saturated head", sat_path)
        if lines is not None:
            scores = json.loads(lines.splitlines()[0])["scores"][0]
            if scores[0] != 1.0 - 2.0**-24 or scores[1] != 2.0**-126:
                failures.append(f"saturated head scored {scores[:2]}, want [1 - 2^-24, 2^-126]")
    bad = write("bad.jsonl", [{"user_id": 1, "history_item_ids": [1], "history_actions": [0]},
                              {"user_id": 2**64, "history_item_ids": [], "history_actions": [],
                               "candidate_item_ids": [3]}])
    rc, out = run(reference + ["--input", bad])
    expect("no candidates", rc, out, 1, "candidate_item_ids is empty")
    expect("user_id 2^64", rc, out, 1, "user_id must be an integer in [0, 2^64)")
    past_int64 = write("past_int64.jsonl", [{"user_id": 1, "history_item_ids": [2**63],
                                             "history_actions": [0], "candidate_item_ids": [3]}])
    rc, out = run(reference + ["--input", past_int64])
    expect("an item id of 2^63", rc, out, 1, "history_item_ids contains an id past the range of int64")
    kept = write("kept.jsonl", ["previous results"])
    rc, out = run(reference + ["--input", os.path.join(args.work_dir, "missing.jsonl"),
                               "--output", kept])
    with open(kept) as f:
        if f.read() != "previous results\n":
            failures.append("a missing --input emptied the existing --output")
    # --output naming the --input file (before: the input emptied, exit 0).
    rc, out = run(reference + ["--input", requests, "--output", requests])
    expect("--output is --input", rc, out, 1, "is the --input file")
    with open(requests) as f:
        if not f.read().strip():
            failures.append("--output naming the --input emptied it")
    rc, out = run(make + ["--model", requests])
    expect("make_requests on a file that is not a model", rc, out, 1, "error: ")
    if "Traceback" in out:
        failures.append(f"make_requests on a file that is not a model: a traceback\n{out[-600:]}")

    # soak_monitor.py: each invariant of the metrics it promises fails on a sample that breaks it,
    # and a run that keeps them all passes (the process's own checks need a live --pid).
    def metrics(ok=10, exhausted=0, queue_full=0, gpu_used=4, gpu_free=60, pinned=0, queue=0,
                inflight=0, hist_ok=None, ok_bucket=None):
        hist_ok = ok if hist_ok is None else hist_ok
        return "\n".join([
            "# TYPE hstu_requests_total counter",
            f'hstu_requests_total{{code="OK"}} {ok}',
            f'hstu_requests_total{{code="RESOURCE_EXHAUSTED"}} {exhausted}',
            f'hstu_queue_rejections_total{{reason="queue_full"}} {queue_full}',
            'hstu_queue_rejections_total{reason="user_queue_full"} 0',
            f'hstu_request_duration_seconds_bucket{{code="OK",le="0.005"}} {hist_ok if ok_bucket is None else ok_bucket}',
            f'hstu_request_duration_seconds_bucket{{code="OK",le="+Inf"}} {hist_ok}',
            f'hstu_request_duration_seconds_count{{code="OK"}} {hist_ok}',
            f'hstu_request_duration_seconds_count{{code="RESOURCE_EXHAUSTED"}} {exhausted}',
            f'hstu_kv_pages{{state="used",tier="gpu"}} {gpu_used}',
            f'hstu_kv_pages{{state="free",tier="gpu"}} {gpu_free}',
            f'hstu_kv_pages{{state="pinned",tier="gpu"}} {pinned}',
            f"hstu_queue_depth {queue}", f"hstu_inflight_requests {inflight}", ""])

    monitor = [sys.executable, os.path.join(tools, "soak_monitor.py"), "--metrics-files"]
    good = [write("soak0.txt", [metrics()]), write("soak1.txt", [metrics(ok=20, gpu_used=30, gpu_free=34, pinned=8, queue=3, inflight=5, hist_ok=18)]),
            write("soak2.txt", [metrics(ok=30, exhausted=2, queue_full=2)])]
    rc, out = run(monitor + good)
    expect("soak monitor, invariants kept", rc, out, 0, "soak: 3 samples")
    soak_cases = {
        "pages leaked": (dict(ok=30, gpu_used=5), "gpu pages used 5 + free 60 = 65, capacity 64"),
        "a counter down": (dict(ok=15), 'counter hstu_requests_total{\'code\': \'OK\'} went down'),
        "a bucket down": (dict(ok=30, ok_bucket=5), "hstu_request_duration_seconds_bucket"),
        "queue not empty when idle": (dict(ok=30, queue=1), "idle: hstu_queue_depth 1, want 0"),
        "pages pinned when idle": (dict(ok=30, pinned=2), "idle: pinned GPU pages 2, want 0"),
        "pinned past used": (dict(ok=30, pinned=5), "pinned pages 5 > used 4"),
        "calls not in the histogram": (dict(ok=30, hist_ok=29), "!= duration histogram count 29"),
        "refusals not counted": (dict(ok=30, exhausted=3, queue_full=2), "RESOURCE_EXHAUSTED 3 != queue_full"),
    }
    for what, (kw, needle) in soak_cases.items():
        rc, out = run(monitor + good[:2] + [write("soak_bad.txt", [metrics(**kw)])])
        expect(f"soak monitor, {what}", rc, out, 1, needle)
    # A label value holding '}' (a model path) is a label, not a broken line.
    braces = metrics(ok=30) + 'hstu_build_info{model="a}b",version="0.1.0"} 1\n'
    rc, out = run(monitor + good[:2] + [write("soak_braces.txt", [braces])])
    expect("soak monitor, a label value with a brace", rc, out, 0, "soak: 3 samples")
    rc, out = run(monitor + [write("soak_junk.txt", ["hstu_queue_depth one"])])
    expect("soak monitor, a line that is not metrics", rc, out, 1, "not a metrics line")

    for f in failures:
        print("FAIL: " + f)
    print(f"{'FAILED' if failures else 'passed'}: tools test")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
