#!/usr/bin/env python3
"""hstu_rank --device cpu-bf16 against the reference's --numerics bf16 (DESIGN §2.4).

DESIGN §2.4 calls a GPU result correct when it is as close to the fp32 reference as a straightforward
bf16 computation would be. That computation exists twice, written independently: the C++ CPU
backend with CpuNumerics::kBf16 (fp32 arithmetic, rounded to bf16 where the CUDA engine stores
bf16) and tools/hstu_reference.py --numerics bf16 (float64 arithmetic, the same roundings). For each
case, on a returning-user workload:

- the roundings are there: the bf16 reference is at least 1e-4 from the float64 one somewhere
  (fp32 arithmetic alone is ~1e-7 from it);
- the two emulations agree far better than either agrees with float64: their mean |difference| is
  at most 0.15 of the bf16 reference's mean distance from float64, and their worst at most 0.5 of
  its worst. (Rounding at different points does not pass: in the tiny case leaving out any one of
  the activation roundings or the TF32 head moves the mean ~6x; leaving the weights in float64,
  ~40x. What remains is where fp32 and float64 land on different sides of a bf16 rounding step.)
- the engine with the cache and without it agrees within the same bound, and reuses exactly the
  tokens the fp32 engine reuses.

Usage (CTest passes the executables):
    compare_bf16_emulation.py --hstu-model PATH --hstu-rank PATH --work-dir DIR --case tiny [...]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # keep the source tree clean: no __pycache__ under tests/ or tools/
from compare_with_reference import CASES, case_arguments, read_jsonl, run  # noqa: E402

MEAN_RATIO = 0.15
WORST_RATIO = 0.5
MIN_BF16_EFFECT = 1e-4


def score_diffs(a: list, b: list, what: str) -> list:
    """Every |score difference| of two outputs of the same requests; exits on a structural mismatch."""
    if len(a) != len(b):
        raise SystemExit(f"FAIL: {what}: {len(a)} lines vs {len(b)}")
    diffs = []
    for i, (ra, rb) in enumerate(zip(a, b), 1):
        if "error" in ra or "error" in rb:
            raise SystemExit(f"FAIL: {what}: line {i}: {ra.get('error')} / {rb.get('error')}")
        if len(ra["scores"]) != len(rb["scores"]):
            raise SystemExit(f"FAIL: {what}: line {i}: candidate counts differ")
        for sa, sb in zip(ra["scores"], rb["scores"]):
            for x, y in zip(sa, sb):
                d = abs(x - y)
                if d != d:  # NaN
                    raise SystemExit(f"FAIL: {what}: line {i}: non-finite score {x} / {y}")
                diffs.append(d)
    return diffs


def run_case(case: str, args) -> bool:
    spec = CASES[case]
    work = os.path.join(args.work_dir, case)
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "model.safetensors")
    requests = os.path.join(work, "requests.jsonl")
    run([args.hstu_model, "init", *spec["init"], "--out", model], "hstu_model init")
    run([sys.executable, os.path.join(args.tools_dir, "make_requests.py"), "--model", model,
         "--users", str(spec["users"]), "--visits", str(spec["visits"]), "--seed", "5",
         "--out", requests], "make_requests.py")
    reference = os.path.join(args.tools_dir, "hstu_reference.py")
    ref = {n: read_jsonl(run([sys.executable, reference, "--model", model, "--input", requests,
                              "--numerics", n], f"hstu_reference.py --numerics {n}"))
           for n in ("fp64", "bf16")}
    rank = {}
    for name, flags in (("fp32", ["--device", "cpu"]), ("bf16", ["--device", "cpu-bf16"]),
                        ("bf16 no cache", ["--device", "cpu-bf16", "--no_cache"])):
        rank[name] = read_jsonl(run([args.hstu_rank, "--model", model, "--input", requests, *flags],
                                    f"hstu_rank {' '.join(flags)}"))

    effect = score_diffs(ref["bf16"], ref["fp64"], "bf16 vs float64 reference")
    effect_mean, effect_worst = sum(effect) / len(effect), max(effect)
    print(f"[{case}] {len(effect)} scores; bf16 reference vs float64: mean {effect_mean:.2e}, "
          f"worst {effect_worst:.2e}")
    ok = True
    if effect_worst < MIN_BF16_EFFECT:
        print(f"  FAIL the bf16 reference is within {effect_worst:.2e} of float64: no rounding?")
        ok = False
    for what, a, b in (("cpu-bf16 vs bf16 reference", rank["bf16"], ref["bf16"]),
                       ("cpu-bf16 cached vs not", rank["bf16"], rank["bf16 no cache"])):
        d = score_diffs(a, b, what)
        mean, worst = sum(d) / len(d), max(d)
        good = mean <= MEAN_RATIO * effect_mean and worst <= WORST_RATIO * effect_worst
        print(f"  {'ok  ' if good else 'FAIL'} {what}: mean {mean:.2e} (at most {MEAN_RATIO} x "
              f"{effect_mean:.2e}), worst {worst:.2e} (at most {WORST_RATIO} x {effect_worst:.2e})")
        ok &= good
    for i, (a, b) in enumerate(zip(rank["bf16"], rank["fp32"]), 1):
        for key in ("reused_tokens", "computed_tokens"):
            if a[key] != b[key]:
                print(f"  FAIL line {i}: {key} {a[key]} with cpu-bf16, {b[key]} with cpu")
                ok = False
    return ok


def main(argv=None) -> int:
    args = case_arguments(__doc__.split("\n\n")[0]).parse_args(argv)
    ok = True
    for case in args.case:
        ok &= run_case(case, args)
    print("PASS" if ok else "FAIL: the two bf16 emulations differ (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
