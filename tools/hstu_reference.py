#!/usr/bin/env python3
"""Independent float64 reference of the HSTU forward (DESIGN §2) with history truncation (DESIGN §4).

This is the oracle that `hstu_rank` is compared against. It shares no code with the C++ engine and is
deliberately written the "obvious" way: every request is computed from scratch (no KV cache, no pages,
no candidate chunking), attention uses one dense [T, T] mask built from the rules in DESIGN §2.2, and
all arithmetic is float64 so that the only error in a comparison is the engine's own fp32 rounding.

Usage:
    hstu_reference.py --model MODEL.safetensors --input REQUESTS.jsonl [--output SCORES.jsonl]
                      [--numerics fp64|bf16]

--numerics bf16 rounds where the CUDA engine stores bf16 (DESIGN §2.4; docs/cuda_kernels.md,
"Numerics"), everything else staying float64: the embedding tables and layer GEMM weights, LayerNorm
outputs, the UVQK GEMM's output and its bias + SiLU, P before P·V, the attention output and
LayerNorm · u; the head's hidden layers take TF32 inputs. It is the "straightforward bf16
computation" that DESIGN §2.4 measures a GPU result against, written independently of the C++
engine's `--device cpu-bf16`, which it checks.

Each input line {"user_id": 7, "history_item_ids": [...], "history_actions": [...],
"candidate_item_ids": [...]} produces one output line {"user_id": 7, "scores": [[t0, t1, ...], ...]}
(one inner list per candidate, one value per task). A line that is not a valid request produces
{"line": N, "error": "..."} (N counts from 1) and the other lines still run.

numpy and the standard library only: the model file is parsed here, not by the `safetensors` package,
so that a format misunderstanding in our C++ writer/reader cannot be hidden by a shared library.
"""

import argparse
import json
import math
import os
import re
import struct
import sys
from dataclasses import dataclass, field

import numpy as np

LAYER_NORM_EPS = 1e-5
L2_NORM_FLOOR = 1e-6
MIN_SCORE = 2.0**-126  # scores stay inside (0, 1): kMinScore, kMaxScore in kernels/params.h
MAX_SCORE = 1.0 - 2.0**-24


# --------------------------------------------------------------------------------------------------
# Model file (DESIGN §3)
# --------------------------------------------------------------------------------------------------


@dataclass
class Layer:
    input_norm_w: np.ndarray  # [d]
    input_norm_b: np.ndarray  # [d]
    uvqk_w: np.ndarray  # [d, 4*H*D], column blocks u | v | q | k
    uvqk_b: np.ndarray  # [4*H*D]
    output_norm_w: np.ndarray  # [H*D]
    output_norm_b: np.ndarray  # [H*D]
    output_w: np.ndarray  # [H*D, d]


@dataclass
class Model:
    num_layers: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    attention_norm_len: int
    max_history_tokens: int
    max_attn_len: int
    position_encoding: bool
    num_tasks: int
    max_candidates: int
    model_name: str
    item_emb: np.ndarray  # [item_rows, d]
    action_emb: np.ndarray  # [action_rows, d]
    position_emb: np.ndarray | None  # [position_rows, d] or None
    layers: list = field(default_factory=list)
    head: list = field(default_factory=list)  # [(weight [in, out], bias [out]), ...]

    truncation_stride_tokens: int = 0  # hstu.truncation_stride; 0: the default

    @property
    def truncation_stride(self) -> int:
        # DESIGN §4: the file's hstu.truncation_stride, by default M/4 rounded down to an even
        # number (so a kept window always starts on an item token), and at least 2 so that the
        # stride can never be 0.
        if self.truncation_stride_tokens > 0:
            return self.truncation_stride_tokens
        return max(2, (self.max_history_tokens // 4) // 2 * 2)


def _decode_tensor(raw: bytes, dtype: str, shape: list) -> np.ndarray:
    if dtype == "F32":
        values = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    elif dtype == "BF16":
        # bf16 is the upper half of an IEEE float32: widen by shifting the 16 bits into place.
        halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
        values = (halves << 16).view(np.float32).astype(np.float64)
    else:
        raise ValueError(f"unsupported dtype {dtype!r} (only F32 and BF16)")
    return values.reshape(shape)


def load_model(path: str) -> Model:
    """Reads a model file, checking what the C++ loader checks (engine/model_file.cc): a ValueError
    names what is wrong."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len == 0 or header_len > len(blob) - 8:
        raise ValueError(f"{path}: header length {header_len} does not fit in the file of {len(blob)} bytes")
    if b"\0" in blob[8 : 8 + header_len]:
        raise ValueError(f"{path}: header has a NUL byte")
    try:
        header = json.loads(blob[8 : 8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ValueError(f"{path}: header is not a JSON object with __metadata__")
    data = blob[8 + header_len :]
    meta = header.pop("__metadata__")
    # As the C++ loader: an hstu.* key it does not know is an error, not a default in its place.
    known = ("hstu.model_name", "hstu.num_layers", "hstu.hidden_dim", "hstu.num_heads",
             "hstu.head_dim", "hstu.attention_norm_len", "hstu.max_history_tokens",
             "hstu.max_candidates", "hstu.max_attn_len", "hstu.position_encoding",
             "hstu.num_tasks", "hstu.truncation_stride")
    for key in sorted(meta):  # the C++ loader's order (its JSON object's), for the same first error
        # ASCII case and letters, as the C++ loader (str.lower/isalnum would fold 'É' and '²').
        raw = key.encode("utf-8", "surrogatepass").lower()
        if key in known or not raw.startswith(b"hstu") or raw[4:5].isalnum():
            continue
        lower = raw.decode("utf-8", "surrogatepass")
        meant = "hstu." + re.sub(r"[-. ]", "_", lower[5:]) if len(lower) > 5 else ""
        if meant in known:  # ours but for its case or separator: keys are case-sensitive
            raise ValueError(f"{path}: unknown metadata key '{key}' (did you mean '{meant}'? "
                             "metadata keys are case-sensitive)")
        raise ValueError(f"{path}: unknown metadata key '{key}' (the hstu.* keys: "
                         f"{', '.join(known)})")

    tensors = {}
    spans = []
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], info["shape"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name} lacks dtype, shape or data_offsets [begin, end]") from None
        if not (0 <= begin <= end <= len(data)):
            raise ValueError(f"{path}: tensor {name} data [{begin}, {end}) runs past the end of the file")
        try:
            values = _decode_tensor(data[begin:end], dtype, shape)
        except ValueError as e:  # a dtype, or a byte count that is not the shape's
            raise ValueError(f"{path}: tensor {name}: {e}") from None
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{path}: tensor {name} contains NaN or Inf")
        tensors[name] = values
        spans.append((begin, end))
    # Back to back, as safetensors requires: no overlap, no hole, no trailing bytes.
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            raise ValueError(f"{path}: tensor data {'overlaps' if begin < at else 'has a hole'} at byte "
                             f"{min(begin, at)} of the data area")
        at = end
    if at != len(data):
        raise ValueError(f"{path}: the tensors cover {at} of the {len(data)} data bytes (trailing bytes?)")

    class Tensors(dict):
        def __missing__(self, name):
            raise ValueError(f"{path}: tensor {name} is missing")

    tensors = Tensors(tensors)

    def meta_int(key, default=None):
        if key not in meta:
            if default is None:
                raise ValueError(f"{path}: metadata {key} is missing")
            return default
        try:
            return int(meta[key])
        except (TypeError, ValueError):
            raise ValueError(f"{path}: metadata {key} = {meta[key]!r} is not an integer") from None

    if "hstu.position_encoding" not in meta:
        raise ValueError(f"{path}: metadata hstu.position_encoding is missing")
    if meta["hstu.position_encoding"] not in ("true", "1", "false", "0"):
        raise ValueError(f"{path}: metadata hstu.position_encoding = "
                         f"{meta['hstu.position_encoding']!r} is not true/false")
    position_encoding = meta["hstu.position_encoding"] in ("true", "1")
    for key in ("hstu.num_layers", "hstu.hidden_dim", "hstu.num_heads", "hstu.head_dim",
                "hstu.max_history_tokens", "hstu.num_tasks"):
        if meta_int(key) <= 0:
            raise ValueError(f"{path}: metadata {key} must be > 0, got {meta_int(key)}")
    if meta_int("hstu.max_candidates", 256) <= 0:
        raise ValueError(f"{path}: metadata hstu.max_candidates must be > 0")
    # The C++ loader's upper bounds (ModelConfig::Validate), which keep every size in range.
    for key, value, most in (
            ("hstu.num_layers", meta_int("hstu.num_layers"), 1024),
            ("hstu.hidden_dim", meta_int("hstu.hidden_dim"), 65536),
            ("hstu.num_heads * hstu.head_dim",
             meta_int("hstu.num_heads") * meta_int("hstu.head_dim"), 65536),
            ("hstu.max_history_tokens", meta_int("hstu.max_history_tokens"), 2**22),
            ("hstu.max_candidates", meta_int("hstu.max_candidates", 256), 2**20),
            ("hstu.num_tasks", meta_int("hstu.num_tasks"), 4096)):
        if value > most:
            raise ValueError(f"{path}: metadata {key} must be at most {most}, got {value}")
    if meta_int("hstu.max_attn_len") < 0:
        raise ValueError(f"{path}: metadata hstu.max_attn_len must be >= 0, got {meta_int('hstu.max_attn_len')}")
    if meta_int("hstu.max_history_tokens") % 2:
        raise ValueError(f"{path}: metadata hstu.max_history_tokens must be even (2 tokens an event)")
    stride = meta_int("hstu.truncation_stride", 0)
    if stride != 0 and not (2 <= stride <= meta_int("hstu.max_history_tokens") and stride % 2 == 0):
        raise ValueError(f"{path}: metadata hstu.truncation_stride must be even and in "
                         f"[2, hstu.max_history_tokens], got {stride}")
    if meta.get("hstu.attention_norm_len", "") not in ("", "0") and meta_int("hstu.attention_norm_len") < 0:
        raise ValueError(f"{path}: metadata hstu.attention_norm_len must be >= 0")

    d = meta_int("hstu.hidden_dim")
    hd = meta_int("hstu.num_heads") * meta_int("hstu.head_dim")
    used = set()

    def tensor(name, shape):
        """The tensor `name`, which must have `shape` (None: any size there)."""
        t = tensors[name]
        if len(t.shape) != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape)):
            want = "[" + ", ".join("rows" if w is None else str(w) for w in shape) + "]"
            raise ValueError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {want}")
        if any(g <= 0 for g in t.shape):
            raise ValueError(f"{path}: tensor {name} has an empty dimension: {list(t.shape)}")
        used.add(name)
        return t

    layers = []
    for i in range(meta_int("hstu.num_layers")):
        p = f"layers.{i}."
        layers.append(
            Layer(
                input_norm_w=tensor(p + "input_norm.weight", (d,)),
                input_norm_b=tensor(p + "input_norm.bias", (d,)),
                uvqk_w=tensor(p + "uvqk.weight", (d, 4 * hd)),
                uvqk_b=tensor(p + "uvqk.bias", (4 * hd,)),
                output_norm_w=tensor(p + "output_norm.weight", (hd,)),
                output_norm_b=tensor(p + "output_norm.bias", (hd,)),
                output_w=tensor(p + "output.weight", (hd, d)),
            )
        )
    head = []
    j, width = 0, d
    while f"head.{j}.weight" in tensors:
        w = tensor(f"head.{j}.weight", (width, None))
        width = w.shape[1]
        head.append((w, tensor(f"head.{j}.bias", (width,))))
        j += 1
    if not head:
        raise ValueError(f"{path}: no head.0.weight")
    for name in ("embeddings.item.weight", "embeddings.action.weight") + (
            ("embeddings.position.weight",) if position_encoding else ()):
        tensor(name, (None, d))
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise ValueError(f"{path}: unexpected tensor {unexpected[0]}"
                         + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))

    model = Model(
        num_layers=meta_int("hstu.num_layers"),
        hidden_dim=meta_int("hstu.hidden_dim"),
        num_heads=meta_int("hstu.num_heads"),
        head_dim=meta_int("hstu.head_dim"),
        # DESIGN §2.2: by default max history tokens + max candidates ("" or "0" spell it too).
        attention_norm_len=(
            int(meta["hstu.attention_norm_len"])
            if meta.get("hstu.attention_norm_len", "") not in ("", "0")
            else meta_int("hstu.max_history_tokens") + meta_int("hstu.max_candidates", 256)
        ),
        max_history_tokens=meta_int("hstu.max_history_tokens"),
        max_attn_len=meta_int("hstu.max_attn_len"),
        position_encoding=position_encoding,
        num_tasks=meta_int("hstu.num_tasks"),
        max_candidates=meta_int("hstu.max_candidates", 256),
        model_name=meta.get("hstu.model_name", ""),
        truncation_stride_tokens=meta_int("hstu.truncation_stride", 0),
        item_emb=tensors["embeddings.item.weight"],
        action_emb=tensors["embeddings.action.weight"],
        position_emb=tensors["embeddings.position.weight"] if position_encoding else None,
        layers=layers,
        head=head,
    )
    if head[-1][0].shape[1] != model.num_tasks:
        raise ValueError(f"{path}: last head layer does not output num_tasks={model.num_tasks}")
    return model


# --------------------------------------------------------------------------------------------------
# The GPU's roundings (--numerics bf16)
# --------------------------------------------------------------------------------------------------


def round_mantissa(x, dropped_bits: int) -> np.ndarray:
    """x through float32, then its low `dropped_bits` mantissa bits rounded off (nearest, ties to even)."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    lsb = (u >> np.uint64(dropped_bits)) & np.uint64(1)
    u = (u + np.uint64((1 << (dropped_bits - 1)) - 1) + lsb) & ~np.uint64((1 << dropped_bits) - 1)
    rounded = (u & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(f), f, rounded).astype(np.float64)


def to_bf16(x) -> np.ndarray:
    return round_mantissa(x, 16)


def to_tf32(x) -> np.ndarray:
    return round_mantissa(x, 13)


def exact(x):
    return x


@dataclass
class Numerics:
    act: callable = exact  # applied where the GPU stores an activation in bf16
    head_hidden: callable = exact  # applied to the inputs of the head's hidden layers (TF32)


FP64 = Numerics()
BF16 = Numerics(act=to_bf16, head_hidden=to_tf32)


def with_bf16_weights(model: Model) -> Model:
    """The model as the GPU holds it: embeddings and layer GEMM weights in bf16."""
    layers = [
        Layer(l.input_norm_w, l.input_norm_b, to_bf16(l.uvqk_w), l.uvqk_b, l.output_norm_w,
              l.output_norm_b, to_bf16(l.output_w))
        for l in model.layers
    ]
    pos = None if model.position_emb is None else to_bf16(model.position_emb)
    return Model(**{**model.__dict__, "item_emb": to_bf16(model.item_emb),
                    "action_emb": to_bf16(model.action_emb), "position_emb": pos,
                    "layers": layers})


# --------------------------------------------------------------------------------------------------
# Forward (DESIGN §2) with truncation (DESIGN §4)
# --------------------------------------------------------------------------------------------------


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # population variance
    return (x - mean) / np.sqrt(var + LAYER_NORM_EPS) * w + b


def truncation_start(num_history_tokens: int, model: Model) -> int:
    """First kept history token: the start moves in whole strides so consecutive visits share it."""
    excess = num_history_tokens - model.max_history_tokens
    if excess <= 0:
        return 0
    stride = model.truncation_stride
    return -(-excess // stride) * stride  # ceil(excess / stride) * stride, in integers


def history_tokens(item_ids: list, actions: list) -> list:
    """Interleaves events into [item_1, action_1, ..., item_n, action_n] as ('item'|'action', id)."""
    tokens = []
    for item_id, action in zip(item_ids, actions):
        tokens.append(("item", item_id))
        tokens.append(("action", action))
    return tokens


def attention_mask(num_history: int, num_candidates: int, window: int) -> np.ndarray:
    """Dense [T, T] boolean mask, True where query i may read key j (DESIGN §2.2)."""
    total = num_history + num_candidates
    i = np.arange(total)[:, None]  # query index, as a column
    j = np.arange(total)[None, :]  # key index, as a row
    i_is_history = i < num_history
    j_is_history = j < num_history
    # History reads history causally (itself included); a candidate reads all history and itself,
    # never another candidate; nothing reads a candidate except the candidate itself.
    allowed = (i_is_history & j_is_history & (j <= i)) | (~i_is_history & (j_is_history | (i == j)))
    if window > 0:
        # The window compares "ids": a history token's position, or the history length for every
        # candidate (candidates all sit at the same point in time, right after the history).
        id_i = np.minimum(i, num_history)
        id_j = np.minimum(j, num_history)
        allowed &= id_i - id_j <= window
    return allowed


def hstu_layer(x: np.ndarray, layer: Layer, model: Model, mask: np.ndarray,
               num: Numerics = FP64) -> np.ndarray:
    H, D = model.num_heads, model.head_dim
    hd = H * D
    normed = num.act(layer_norm(x, layer.input_norm_w, layer.input_norm_b))
    uvqk = num.act(silu(num.act(normed @ layer.uvqk_w) + layer.uvqk_b))
    u, v, q, k = (uvqk[:, c * hd : (c + 1) * hd] for c in range(4))

    alpha = 1.0 / math.sqrt(D)
    attn = np.zeros_like(u)
    for h in range(H):
        cols = slice(h * D, (h + 1) * D)
        scores = alpha * (q[:, cols] @ k[:, cols].T)  # [T, T]
        # No softmax: SiLU of the score divided by a constant of the model, masked pairs exactly 0.
        p = num.act(np.where(mask, silu(scores) / model.attention_norm_len, 0.0))
        attn[:, cols] = p @ v[:, cols]

    y = num.act(layer_norm(num.act(attn), layer.output_norm_w, layer.output_norm_b) * u)
    return y @ layer.output_w + x


def score_request(model: Model, item_ids: list, actions: list, candidates: list,
                  num: Numerics = FP64) -> np.ndarray:
    """Scores one request from scratch: returns [num_candidates, num_tasks] in (0, 1). With BF16
    numerics the model must come from with_bf16_weights."""
    tokens = history_tokens(item_ids, actions)
    start = truncation_start(len(tokens), model)
    tokens = tokens[start:]
    num_history = len(tokens)
    tokens = tokens + [("item", c) for c in candidates]

    d = model.hidden_dim
    x = np.zeros((len(tokens), d))
    for t, (kind, token_id) in enumerate(tokens):
        if kind == "item":
            x[t] = model.item_emb[token_id % model.item_emb.shape[0]]
        else:
            x[t] = model.action_emb[token_id]
        if model.position_encoding:
            # Positions count from the first kept token; every candidate sits at the history length.
            pos = min(t, num_history)
            row = min(pos, model.position_emb.shape[0] - 1)
            x[t] = x[t] * math.sqrt(d) + model.position_emb[row]

    mask = attention_mask(num_history, len(candidates), model.max_attn_len)
    for layer in model.layers:
        x = hstu_layer(x, layer, model, mask, num)

    cand = x[num_history:]
    norms = np.sqrt((cand**2).sum(axis=1, keepdims=True))
    h = cand / np.maximum(norms, L2_NORM_FLOOR)
    for j, (w, b) in enumerate(model.head):
        hidden = j + 1 < len(model.head)
        h = (num.head_hidden(h) @ num.head_hidden(w) if hidden else h @ w) + b
        if hidden:
            h = np.maximum(h, 0.0)
    # As the engine's ScoreFromLogit (kernels/params.h): the sigmoid kept inside (0, 1).
    return np.clip(1.0 / (1.0 + np.exp(-h)), MIN_SCORE, MAX_SCORE)


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------


def parse_request(obj, model: Model):
    """Returns (user_id, items, actions, candidates) or raises ValueError naming the field."""
    if not isinstance(obj, dict):
        raise ValueError("request is not a JSON object")

    def int_list(key):
        value = obj.get(key, [])
        if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value
        ):
            raise ValueError(f"{key} must be a list of integers")
        return value

    user_id = obj.get("user_id")
    if isinstance(user_id, bool) or not isinstance(user_id, int) or not 0 <= user_id < 2**64:
        raise ValueError("user_id must be an integer in [0, 2^64)")
    items = int_list("history_item_ids")
    actions = int_list("history_actions")
    candidates = int_list("candidate_item_ids")
    if not candidates:
        raise ValueError("candidate_item_ids is empty")
    if len(items) != len(actions):
        raise ValueError(
            f"history_actions has {len(actions)} entries but history_item_ids has {len(items)}"
        )
    if any(i < 0 for i in items):
        raise ValueError("history_item_ids contains a negative id")
    if any(c < 0 for c in candidates):
        raise ValueError("candidate_item_ids contains a negative id")
    # The wire format's ids are int64 (proto/hstu/v1/ranking.proto), as hstu_rank reads them.
    for key, ids in (("history_item_ids", items), ("candidate_item_ids", candidates)):
        if any(i >= 2**63 for i in ids):
            raise ValueError(f"{key} contains an id past the range of int64")
    action_rows = model.action_emb.shape[0]
    if any(a < 0 or a >= action_rows for a in actions):
        raise ValueError(f"history_actions contains an id outside [0, {action_rows})")
    return user_id, items, actions, candidates


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="safetensors model file")
    parser.add_argument("--input", required=True, help="JSONL requests")
    parser.add_argument("--output", help="write JSONL scores here instead of stdout")
    parser.add_argument("--numerics", choices=("fp64", "bf16"), default="fp64",
                        help="bf16: round as the CUDA engine does (see above)")
    args = parser.parse_args(argv)

    # The input is read, and the output checked, before the model (which takes a while to load
    # for `base`), so that a wrong path fails at once; an existing --output is left as it was.
    try:
        if args.output and os.path.exists(args.output) and os.path.samefile(args.input, args.output):
            raise ValueError(f"--output {args.output} is the --input file")
        # Lines end at "\n" only, as hstu_rank reads them: "\r" is JSON whitespace, and U+2028
        # or a form feed inside a string is part of its line.
        with open(args.input, encoding="utf-8", newline="") as f:
            lines = f.read().split("\n")
        if args.output and os.path.isdir(args.output):
            raise ValueError(f"--output {args.output} is a directory")
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        model = load_model(args.model)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    num = FP64
    if args.numerics == "bf16":
        model, num = with_bf16_weights(model), BF16
    try:
        out = open(args.output, "w") if args.output else sys.stdout
    except OSError as e:
        print(f"error: --output: {e}", file=sys.stderr)
        return 1
    failures = 0
    try:
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                user_id, items, actions, candidates = parse_request(json.loads(line), model)
            except (ValueError, json.JSONDecodeError) as e:
                out.write(json.dumps({"line": line_no, "error": str(e)}) + "\n")
                failures += 1
                continue
            scores = score_request(model, items, actions, candidates, num)
            if not np.all(np.isfinite(scores)):
                # As the engine: a model that overflows gives an error, not NaN (invalid JSON).
                out.write(json.dumps({"line": line_no, "error": "the model produced non-finite scores"}) + "\n")
                failures += 1
                continue
            # repr-exact floats: the comparison tolerance is the test's business, not ours.
            out.write(json.dumps({"user_id": user_id, "scores": scores.tolist()}, allow_nan=False) + "\n")
        out.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a failure (not every line was written).
        sys.stdout = None
        return 1
    except OSError as e:
        print(f"error: writing {args.output or 'stdout'}: {e}", file=sys.stderr)
        return 1
    finally:
        if out is not sys.stdout and out is not None:
            out.close()
    return 1 if failures else 0  # as hstu_rank: 1 when any line was an error


if __name__ == "__main__":
    sys.exit(main())
