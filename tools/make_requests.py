#!/usr/bin/env python3
"""Writes a deterministic JSONL workload of returning users for a model file (tests, demos).

Usage:
    make_requests.py --model MODEL.safetensors --users 8 --visits 6 --seed 1 --out REQUESTS.jsonl

Every line is one request {"user_id", "history_item_ids", "history_actions", "candidate_item_ids"}
that `hstu_rank` and tools/hstu_reference.py both read. The workload is built to reach every rule of
DESIGN §2 and §4 that a cached, paged engine can get wrong:

- users return several times, each visit sending the full history with new events appended, so the
  cache is reused (the whole cached prefix);
- some visits EDIT an earlier event or SHORTEN the history, so only a page-aligned prefix (or
  nothing) may be reused; some repeat the previous history unchanged;
- some users have no history at all (candidates only), on every visit or only on the first;
- some histories exceed max_history_tokens, growing across the truncation strides so that some
  visits keep the same start (cache valid) and others move it (cache invalid);
- candidate counts vary from 1 to max_candidates, and one request has more than max_candidates so the
  engine must split it into chunks;
- item ids go beyond item_rows (hashed embedding: id mod rows), some far beyond.

Visits of different users are interleaved (round robin in a shuffled order) as real traffic would be.
Only the standard library and the model file's header are used, so the workload is identical
wherever it is generated.
"""

import argparse
import json
import os
import random
import struct
import sys


def read_model_shape(path: str) -> dict:
    """The few model facts a workload needs, from the safetensors header alone. ValueError (naming
    the file) when it is not an HSTU model file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if len(first) < 8:
            raise ValueError(f"{path}: {len(first)} bytes, not a safetensors file")
        (header_len,) = struct.unpack("<Q", first)
        if header_len == 0 or header_len > size - 8:
            raise ValueError(f"{path}: header length {header_len} does not fit in the file of "
                             f"{size} bytes (not a safetensors file?)")
        try:
            header = json.loads(f.read(header_len).decode("utf-8"))
            meta = header["__metadata__"]
            return {
                "item_rows": int(header["embeddings.item.weight"]["shape"][0]),
                "action_rows": int(header["embeddings.action.weight"]["shape"][0]),
                "max_history_tokens": int(meta["hstu.max_history_tokens"]),
                "max_candidates": int(meta.get("hstu.max_candidates", "256")),
                "truncation_stride": int(meta.get("hstu.truncation_stride", "0")),
            }
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the header is not JSON: {e}") from None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not an HSTU model file (header lacks or mistypes {e})") \
                from None


class Workload:
    def __init__(self, shape: dict, seed: int):
        self.shape = shape
        self.rng = random.Random(seed)
        # Events, not tokens: every event is two history tokens.
        self.max_events = shape["max_history_tokens"] // 2
        stride = shape["truncation_stride"] or max(2, (shape["max_history_tokens"] // 4) // 2 * 2)
        self.stride_events = stride // 2

    def item_id(self) -> int:
        r = self.rng.random()
        rows = self.shape["item_rows"]
        if r < 0.05:
            # Far beyond the table (still exact in a double, so every JSON reader agrees).
            return self.rng.randrange(2**40, 2**50)
        if r < 0.3:
            return self.rng.randrange(rows, 4 * rows)
        return self.rng.randrange(rows)

    def event(self) -> tuple:
        return (self.item_id(), self.rng.randrange(self.shape["action_rows"]))

    def events(self, n: int) -> list:
        return [self.event() for _ in range(n)]

    def candidates(self, count: int) -> list:
        return [self.item_id() for _ in range(count)]

    def candidate_count(self) -> int:
        cmax = self.shape["max_candidates"]
        r = self.rng.random()
        if r < 0.15:
            return 1
        if r < 0.25:
            return cmax
        return self.rng.randint(1, cmax)

    def next_history(self, history: list, kind: str) -> tuple:
        """Returns (new history, what was done) for a returning user of `kind`."""
        rng = self.rng
        if kind == "empty":
            return [], "empty"
        weights = [6, 2, 2, 1] if kind != "long" else [8, 1, 1, 1]
        op = rng.choices(["grow", "edit", "shorten", "same"], weights=weights if history else [1, 0, 0, 0])[0]
        if kind == "long" and op in ("grow", "same"):
            # Small steps relative to the stride: several visits share one truncation start, then
            # one crosses into the next stride.
            return history + self.events(rng.randint(1, max(1, self.stride_events // 2))), "grow"
        if op == "grow":
            return history + self.events(rng.randint(1, max(1, self.max_events // 8))), "grow"
        if op == "same":
            return list(history), "same"
        if op == "edit":
            edited = list(history)
            # Mostly in the middle (partial page-aligned reuse), sometimes the very first event
            # (nothing reusable).
            pos = 0 if rng.random() < 0.2 else rng.randrange(len(edited))
            item, action = edited[pos]
            if rng.random() < 0.5:
                edited[pos] = (item + 1, action)
            else:
                edited[pos] = (item, (action + 1) % self.shape["action_rows"])
            # An edit usually comes with new events too.
            return edited + self.events(rng.randint(0, 3)), "edit"
        # shorten: drop the last few events (a client that lost some), rarely almost everything.
        drop = rng.randint(1, max(1, len(history) // 4)) if rng.random() < 0.8 else len(history) - 1
        return history[: len(history) - drop], "shorten"


def make_workload(shape: dict, num_users: int, num_visits: int, seed: int) -> list:
    w = Workload(shape, seed)
    rng = w.rng
    # User kinds, cycled so that every kind appears once there are at least 5 users.
    kinds = ["normal", "long", "empty_first", "normal", "empty", "very_long"]
    users = []
    for u in range(num_users):
        kind = kinds[u % len(kinds)]
        if kind == "long":
            # Just under the limit: the next visits cross into truncation.
            history = w.events(max(1, w.max_events - rng.randint(1, 4)))
        elif kind == "very_long":
            history = w.events(3 * w.max_events + rng.randint(0, w.max_events))
        elif kind in ("empty", "empty_first"):
            history = []
        else:
            history = w.events(rng.randint(1, max(1, w.max_events // 2)))
        # Non-sequential ids, including one above 2^32, so nothing can assume small user ids.
        user_id = 1000 + 7919 * u if u != 1 else 2**33 + 5
        users.append({"user_id": user_id, "kind": kind, "history": history})

    requests = []
    for visit in range(num_visits):
        order = list(range(num_users))
        rng.shuffle(order)
        for u in order:
            user = users[u]
            if visit > 0:
                kind = "normal" if user["kind"] == "empty_first" else user["kind"]
                kind = "long" if kind == "very_long" else kind
                user["history"], _ = w.next_history(user["history"], kind)
            requests.append(
                {
                    "user_id": user["user_id"],
                    "history_item_ids": [item for item, _ in user["history"]],
                    "history_actions": [action for _, action in user["history"]],
                    "candidate_item_ids": w.candidates(w.candidate_count()),
                }
            )
    # Every candidate count from the extremes is present even in small workloads: the first two
    # requests take 1 and max_candidates.
    requests[0]["candidate_item_ids"] = w.candidates(1)
    if len(requests) > 1:
        requests[1]["candidate_item_ids"] = w.candidates(shape["max_candidates"])
    # One request larger than a forward's maximum, so the engine must chunk its candidates: on a
    # returning user late in the workload so that it also reuses a cache, and not one of the first
    # two unless there is no other (then the last: chunking comes first).
    rest = requests[2:] or requests[-1:]
    big = next((r for r in reversed(rest) if r["history_item_ids"]), rest[-1])
    big["candidate_item_ids"] = w.candidates(shape["max_candidates"] + 7)
    return requests


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="safetensors model file (header is read)")
    parser.add_argument("--users", type=positive, default=8)
    parser.add_argument("--visits", type=positive, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, help="JSONL file to write")
    args = parser.parse_args(argv)

    try:
        shape = read_model_shape(args.model)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    requests = make_workload(shape, args.users, args.visits, args.seed)
    try:
        with open(args.out, "w") as f:
            for r in requests:
                f.write(json.dumps(r) + "\n")
    except OSError as e:
        print(f"error: --out {args.out}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
