#include "engine/model_file.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "nlohmann/json.hpp"

namespace hstu {
namespace {

using json = nlohmann::json;

uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                     // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float Bf16ToFloat(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::string ShapeStr(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

// splitmix64: small, fast and fully deterministic across platforms.
struct Rng {
  uint64_t state;
  uint64_t Next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float Uniform() { return static_cast<float>(Next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }
};

void Fill(std::vector<float>& v, size_t n, Rng& rng, float scale, float offset = 0.f) {
  v.resize(n);
  for (auto& x : v) x = offset + scale * rng.Uniform();
}

struct TensorRef {
  std::string name;
  std::vector<int64_t> shape;
  const std::vector<float>* data;
};

std::vector<TensorRef> ListTensors(const ModelWeights& w) {
  const ModelConfig& c = w.config;
  const int64_t d = c.hidden_dim, hd = c.hd();
  std::vector<TensorRef> t;
  t.push_back({"embeddings.item.weight", {c.item_rows, d}, &w.item_embedding});
  t.push_back({"embeddings.action.weight", {c.action_rows, d}, &w.action_embedding});
  if (c.position_encoding) {
    t.push_back({"embeddings.position.weight", {c.position_rows, d}, &w.position_embedding});
  }
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("layers.", i, ".");
    t.push_back({p + "input_norm.weight", {d}, &l.input_norm_w});
    t.push_back({p + "input_norm.bias", {d}, &l.input_norm_b});
    t.push_back({p + "uvqk.weight", {d, 4 * hd}, &l.uvqk_w});
    t.push_back({p + "uvqk.bias", {4 * hd}, &l.uvqk_b});
    t.push_back({p + "output_norm.weight", {hd}, &l.output_norm_w});
    t.push_back({p + "output_norm.bias", {hd}, &l.output_norm_b});
    t.push_back({p + "output.weight", {hd, d}, &l.output_w});
  }
  for (size_t j = 0; j < w.head.size(); ++j) {
    const HeadLayerWeights& h = w.head[j];
    t.push_back({absl::StrCat("head.", j, ".weight"), {h.in, h.out}, &h.w});
    t.push_back({absl::StrCat("head.", j, ".bias"), {h.out}, &h.b});
  }
  return t;
}

absl::Status InvalidModel(const std::string& file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("model file '", file, "': ", what));
}

}  // namespace

absl::Status ModelConfig::Validate() const {
  auto positive = [](const char* key, int64_t v) -> absl::Status {
    if (v > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(key, " must be > 0, got ", v));
  };
  for (auto [key, v] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"hstu.num_layers", num_layers},
           {"hstu.hidden_dim", hidden_dim},
           {"hstu.num_heads", num_heads},
           {"hstu.head_dim", head_dim},
           {"hstu.attention_norm_len", attention_norm_len},
           {"hstu.max_history_tokens", max_history_tokens},
           {"hstu.max_candidates", max_candidates},
           {"hstu.num_tasks", num_tasks},
           {"item_rows", item_rows},
           {"action_rows", action_rows}}) {
    if (auto s = positive(key, v); !s.ok()) return s;
  }
  // Upper bounds that keep every size computed from them (pages, positions, tables) in range.
  for (auto [key, v, most] : std::initializer_list<std::tuple<const char*, int64_t, int64_t>>{
           {"hstu.num_layers", num_layers, 1024},
           {"hstu.hidden_dim", hidden_dim, 65536},
           {"hstu.num_heads * hstu.head_dim", static_cast<int64_t>(num_heads) * head_dim, 65536},
           {"hstu.max_history_tokens", max_history_tokens, int64_t{1} << 22},
           {"hstu.max_candidates", max_candidates, int64_t{1} << 20},
           {"hstu.num_tasks", num_tasks, 4096},
           // last: a file without it defaults it from the two above
           {"hstu.attention_norm_len", attention_norm_len, int64_t{1} << 24}}) {
    if (v > most) return absl::InvalidArgumentError(absl::StrCat(key, " must be at most ", most, ", got ", v));
  }
  // The embedding tables: rows x hidden_dim values must stay far from int64 (and size_t) wrap.
  constexpr int64_t kMostTableValues = int64_t{1} << 44;
  for (auto [key, rows] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"item_rows", item_rows}, {"action_rows", action_rows}, {"position_rows", position_rows}}) {
    if (rows > kMostTableValues / hidden_dim) {
      return absl::InvalidArgumentError(absl::StrCat(key, " must be at most ", kMostTableValues / hidden_dim,
                                                     " (2^44 values at hidden_dim ", hidden_dim, "), got ",
                                                     rows));
    }
  }
  if (max_attn_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat("hstu.max_attn_len must be >= 0, got ", max_attn_len));
  }
  if (max_history_tokens % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hstu.max_history_tokens must be even (2 tokens per event), got ", max_history_tokens));
  }
  if (position_encoding && position_rows <= 0) {
    return absl::InvalidArgumentError("position encoding is on but the position table has no rows");
  }
  if (truncation_stride_tokens != 0 &&
      (truncation_stride_tokens < 2 || truncation_stride_tokens % 2 != 0 ||
       truncation_stride_tokens > max_history_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hstu.truncation_stride must be even and in [2, hstu.max_history_tokens = ",
        max_history_tokens, "] (whole events), got ", truncation_stride_tokens));
  }
  if (head_dims.size() < 2 || head_dims.front() != hidden_dim || head_dims.back() != num_tasks) {
    return absl::InvalidArgumentError(absl::StrCat("head sizes ", absl::StrJoin(head_dims, "->"),
                                                   " must start at hidden_dim ", hidden_dim,
                                                   " and end at num_tasks ", num_tasks));
  }
  return absl::OkStatus();
}

std::string SerializeModelFile(const ModelWeights& w, FileDType dtype) {
  const ModelConfig& c = w.config;
  json header;
  header["__metadata__"] = {
      {"hstu.model_name", c.model_name},
      {"hstu.num_layers", std::to_string(c.num_layers)},
      {"hstu.hidden_dim", std::to_string(c.hidden_dim)},
      {"hstu.num_heads", std::to_string(c.num_heads)},
      {"hstu.head_dim", std::to_string(c.head_dim)},
      {"hstu.attention_norm_len", std::to_string(c.attention_norm_len)},
      {"hstu.max_history_tokens", std::to_string(c.max_history_tokens)},
      {"hstu.max_candidates", std::to_string(c.max_candidates)},
      {"hstu.max_attn_len", std::to_string(c.max_attn_len)},
      {"hstu.position_encoding", c.position_encoding ? "true" : "false"},
      {"hstu.num_tasks", std::to_string(c.num_tasks)},
  };
  if (c.truncation_stride_tokens > 0) {  // absent: the default, as in files written before it
    header["__metadata__"]["hstu.truncation_stride"] = std::to_string(c.truncation_stride_tokens);
  }
  const size_t elem = dtype == FileDType::kF32 ? 4 : 2;
  size_t offset = 0;
  const auto tensors = ListTensors(w);
  for (const auto& t : tensors) {
    const size_t bytes = t.data->size() * elem;
    header[t.name] = {{"dtype", dtype == FileDType::kF32 ? "F32" : "BF16"},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::string out;
  out.reserve(8 + h.size() + offset);
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += h;
  for (const auto& t : tensors) {
    if (dtype == FileDType::kF32) {
      out.append(reinterpret_cast<const char*>(t.data->data()), t.data->size() * 4);
    } else {
      for (float f : *t.data) {
        uint16_t b = FloatToBf16(f);
        out.push_back(static_cast<char>(b & 0xff));
        out.push_back(static_cast<char>(b >> 8));
      }
    }
  }
  return out;
}

absl::Status WriteModelFile(const ModelWeights& w, const std::string& path, FileDType dtype) {
  std::string bytes;
  try {
    bytes = SerializeModelFile(w, dtype);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("not enough memory to build the model file '", path, "'; nothing written"));
  }
  return WriteFileAtomically(path, bytes);
}

absl::StatusOr<ModelWeights> ReadModelFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("model file '", path, "' is not a regular file"));
  }
  errno = 0;
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    const int err = errno;
    const std::string why = absl::StrCat("cannot open model file '", path, "': ", std::strerror(err));
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(why);
    return err == ENOENT || err == ENOTDIR ? absl::NotFoundError(why) : absl::UnavailableError(why);
  }
  // The file, then its tensors: about twice its size at the peak.
  try {
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (f.bad()) {
      return absl::DataLossError(absl::StrCat("reading model file '", path, "' failed"));
    }
    return ParseModelFile(bytes, path);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "not enough memory to load model file '", path, "' (",
        std::filesystem::file_size(path, ec), " bytes; loading takes about twice that)"));
  }
}

// The hyper-parameters a model file's __metadata__ may give (DESIGN §3, and
// hstu.max_candidates and hstu.truncation_stride).
constexpr const char* kMetadataKeys[] = {
    "hstu.model_name",         "hstu.num_layers",     "hstu.hidden_dim",
    "hstu.num_heads",          "hstu.head_dim",       "hstu.attention_norm_len",
    "hstu.max_history_tokens", "hstu.max_candidates", "hstu.max_attn_len",
    "hstu.position_encoding",  "hstu.num_tasks",      "hstu.truncation_stride"};

absl::StatusOr<ModelWeights> ParseModelFile(const std::string& bytes, const std::string& name) {
  if (bytes.size() < 8) {
    return InvalidModel(name, absl::StrCat("file is ", bytes.size(),
                                           " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  if (header_len == 0 || header_len > bytes.size() - 8) {
    return InvalidModel(name, absl::StrCat("header length ", header_len, " does not fit in the file of ",
                                           bytes.size(), " bytes (not a safetensors file?)"));
  }
  // The JSON parser stops at a NUL byte: what follows it would pass unread.
  if (const void* nul = std::memchr(bytes.data() + 8, '\0', header_len); nul != nullptr) {
    return InvalidModel(name, absl::StrCat("header has a NUL byte at offset ",
                                           static_cast<const char*>(nul) - (bytes.data() + 8),
                                           " of its ", header_len,
                                           " bytes (the header is JSON padded with spaces): the "
                                           "file is corrupt, or its header length is wrong"));
  }
  // A key given twice in one object (the parser keeps the last) makes the file mean two things.
  std::vector<std::set<std::string>> keys_seen;
  std::string duplicate;
  auto note_keys = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) keys_seen.emplace_back();
    if (event == json::parse_event_t::object_end && !keys_seen.empty()) keys_seen.pop_back();
    if (event == json::parse_event_t::key && !keys_seen.empty() &&
        !keys_seen.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_len),
                            note_keys, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return InvalidModel(name, absl::StrCat("header (the ", header_len,
                                           " bytes after its length) is not a JSON object: the "
                                           "file is corrupt, or its header length is wrong"));
  }
  if (!duplicate.empty()) return InvalidModel(name, absl::StrCat("header has the key '", duplicate, "' twice"));
  const size_t data_start = 8 + header_len;
  const size_t data_size = bytes.size() - data_start;

  // ---- metadata ----
  if (!header.contains("__metadata__") || !header["__metadata__"].is_object()) {
    return InvalidModel(name, "header has no __metadata__ object with the hstu.* hyper-parameters");
  }
  const json& meta = header["__metadata__"];
  // An hstu.* key this loader does not know is a misspelling or a newer file's setting: either
  // way, loading on without it would score with a default in its place (before: ignored, so
  // 'hstu.attention_norm_length' silently changed the scores). So is one that is ours but for its
  // case or separator ('HSTU.num_layers', 'hstu_max_attn_len'): keys are case-sensitive. Other
  // keys (a writer's "format") are not ours.
  for (const auto& [key, value] : meta.items()) {
    if (std::find(std::begin(kMetadataKeys), std::end(kMetadataKeys), key) !=
        std::end(kMetadataKeys)) {
      continue;
    }
    const std::string lower = absl::AsciiStrToLower(key);
    if (lower.rfind("hstu", 0) != 0 || (lower.size() > 4 && absl::ascii_isalnum(lower[4]))) {
      continue;
    }
    // What it may have meant: the name in lower case after "hstu.", with '_' between its words.
    std::string meant = lower.size() > 5 ? absl::StrCat("hstu.", lower.substr(5)) : "";
    std::replace_if(meant.begin() + std::min<size_t>(5, meant.size()), meant.end(),
                    [](char ch) { return ch == '-' || ch == ' ' || ch == '.'; }, '_');
    const bool near = std::find(std::begin(kMetadataKeys), std::end(kMetadataKeys), meant) !=
                      std::end(kMetadataKeys);
    return InvalidModel(
        name, absl::StrCat("unknown metadata key '", key, "'",
                           near ? absl::StrCat(" (did you mean '", meant,
                                               "'? metadata keys are case-sensitive)")
                                : absl::StrCat(" (the hstu.* keys: ",
                                               absl::StrJoin(kMetadataKeys, ", "), ")")));
  }
  ModelConfig c;
  auto get_str = [&](const std::string& key, std::string* out, bool required) -> absl::Status {
    if (!meta.contains(key)) {
      if (required) return InvalidModel(name, absl::StrCat("metadata key '", key, "' is missing"));
      return absl::OkStatus();
    }
    if (!meta[key].is_string()) return InvalidModel(name, absl::StrCat("metadata '", key, "' is not a string"));
    *out = meta[key].get<std::string>();
    return absl::OkStatus();
  };
  auto get_int = [&](const std::string& key, int32_t* out, bool required) -> absl::Status {
    std::string s;
    if (auto st = get_str(key, &s, required); !st.ok()) return st;
    if (s.empty() && !required) return absl::OkStatus();
    if (!absl::SimpleAtoi(s, out)) {
      return InvalidModel(name, absl::StrCat("metadata '", key, "' = '", s, "' is not an integer"));
    }
    return absl::OkStatus();
  };
  c.max_candidates = 256;
  std::string pos_str = "false";
#define HSTU_RETURN_IF_ERROR(expr) \
  do {                             \
    absl::Status _s = (expr);      \
    if (!_s.ok()) return _s;       \
  } while (0)
  HSTU_RETURN_IF_ERROR(get_int("hstu.num_layers", &c.num_layers, true));
  HSTU_RETURN_IF_ERROR(get_int("hstu.hidden_dim", &c.hidden_dim, true));
  HSTU_RETURN_IF_ERROR(get_int("hstu.num_heads", &c.num_heads, true));
  HSTU_RETURN_IF_ERROR(get_int("hstu.head_dim", &c.head_dim, true));
  HSTU_RETURN_IF_ERROR(get_int("hstu.attention_norm_len", &c.attention_norm_len, false));
  HSTU_RETURN_IF_ERROR(get_int("hstu.max_history_tokens", &c.max_history_tokens, true));
  HSTU_RETURN_IF_ERROR(get_int("hstu.max_attn_len", &c.max_attn_len, true));
  HSTU_RETURN_IF_ERROR(get_int("hstu.num_tasks", &c.num_tasks, true));
  HSTU_RETURN_IF_ERROR(get_int("hstu.max_candidates", &c.max_candidates, false));
  HSTU_RETURN_IF_ERROR(get_int("hstu.truncation_stride", &c.truncation_stride_tokens, false));
  HSTU_RETURN_IF_ERROR(get_str("hstu.position_encoding", &pos_str, true));
  HSTU_RETURN_IF_ERROR(get_str("hstu.model_name", &c.model_name, false));
  // DESIGN §2.2: N defaults to max history tokens + max candidates (checked after both, below);
  // an empty value or 0 spells the default too, as for hstu.truncation_stride.
  if (c.attention_norm_len == 0) {
    c.attention_norm_len = static_cast<int32_t>(std::clamp<int64_t>(
        int64_t{c.max_history_tokens} + c.max_candidates, 0, std::numeric_limits<int32_t>::max()));
  }
  if (pos_str == "true" || pos_str == "1") {
    c.position_encoding = true;
  } else if (pos_str == "false" || pos_str == "0") {
    c.position_encoding = false;
  } else {
    return InvalidModel(name, absl::StrCat("metadata 'hstu.position_encoding' = '", pos_str,
                                           "' is not true/false"));
  }
  for (auto [key, v] : std::initializer_list<std::pair<const char*, int32_t>>{
           {"hstu.num_layers", c.num_layers}, {"hstu.hidden_dim", c.hidden_dim},
           {"hstu.num_heads", c.num_heads}, {"hstu.head_dim", c.head_dim},
           {"hstu.max_history_tokens", c.max_history_tokens}, {"hstu.num_tasks", c.num_tasks},
           {"hstu.max_candidates", c.max_candidates},
           {"hstu.attention_norm_len", c.attention_norm_len}}) {
    if (v <= 0) return InvalidModel(name, absl::StrCat("metadata '", key, "' must be > 0, got ", v));
  }

  // ---- tensor table ----
  struct Entry {
    std::vector<int64_t> shape;
    bool bf16;
    size_t begin, end;
  };
  std::map<std::string, Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& t = it.key();
    const json& v = it.value();
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      return InvalidModel(name, absl::StrCat("tensor '", t, "' lacks dtype, shape or data_offsets"));
    }
    Entry e;
    const std::string dt = v["dtype"].is_string() ? v["dtype"].get<std::string>() : "";
    if (dt != "F32" && dt != "BF16") {
      return InvalidModel(name, absl::StrCat("tensor '", t, "' has dtype '", dt, "'; only F32 and BF16 are supported"));
    }
    e.bf16 = dt == "BF16";
    if (!v["shape"].is_array()) return InvalidModel(name, absl::StrCat("tensor '", t, "' shape is not an array"));
    // Bytes the shape needs, checked: a product that wraps would let a few bytes pass for a huge
    // table (and the gathers read past the data).
    uint64_t want = e.bf16 ? 2 : 4;
    for (const auto& s : v["shape"]) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0) {
        return InvalidModel(name, absl::StrCat("tensor '", t, "' has a bad shape entry"));
      }
      e.shape.push_back(s.get<int64_t>());
      if (__builtin_mul_overflow(want, static_cast<uint64_t>(e.shape.back()), &want) || want > data_size) {
        if (!std::any_of(v["shape"].begin(), v["shape"].end(),
                         [](const json& x) { return x.is_number_integer() && x.get<int64_t>() == 0; })) {
          return InvalidModel(name, absl::StrCat("tensor '", t, "' has a shape larger than the file's ",
                                                 data_size, " data bytes"));
        }
        want = 0;
      }
    }
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return InvalidModel(name, absl::StrCat("tensor '", t, "' data_offsets must be [begin, end]"));
    }
    e.begin = off[0].get<size_t>();
    e.end = off[1].get<size_t>();
    if (e.end < e.begin) return InvalidModel(name, absl::StrCat("tensor '", t, "' data_offsets end < begin"));
    if (e.end > data_size) {
      return InvalidModel(name, absl::StrCat("tensor '", t, "' data [", e.begin, ", ", e.end,
                                             ") runs past the end of the file (", data_size,
                                             " data bytes): truncated file?"));
    }
    if (e.end - e.begin != want) {
      return InvalidModel(name, absl::StrCat("tensor '", t, "' holds ", e.end - e.begin, " bytes but shape ",
                                             ShapeStr(e.shape), " of ", dt, " needs ", want));
    }
    entries.emplace(t, std::move(e));
  }
  // The data area is the tensors back to back, as safetensors requires: no overlap (two tensors
  // reading the same bytes), no hole, no trailing bytes. Reported after the tensors' own checks,
  // which name what is wrong more precisely (a missing tensor leaves a hole).
  absl::Status layout = absl::OkStatus();
  {
    std::vector<std::pair<size_t, size_t>> spans;
    for (const auto& [t, e] : entries) spans.emplace_back(e.begin, e.end);
    std::sort(spans.begin(), spans.end());
    size_t at = 0;
    for (const auto& [b, e] : spans) {
      if (b != at && layout.ok()) {
        layout = InvalidModel(name, absl::StrCat("tensor data ", b < at ? "overlaps" : "has a hole",
                                                 " at byte ", std::min(b, at), " of the data area"));
      }
      at = std::max(at, e);
    }
    if (at != data_size && layout.ok()) {
      layout = InvalidModel(name, absl::StrCat("the tensors cover ", at, " of the ", data_size,
                                               " data bytes (trailing bytes?)"));
    }
  }

  auto load = [&](const std::string& t, const std::vector<int64_t>& want_shape,
                  std::vector<float>* out) -> absl::Status {
    auto it = entries.find(t);
    if (it == entries.end()) return InvalidModel(name, absl::StrCat("tensor '", t, "' is missing"));
    const Entry& e = it->second;
    if (e.shape != want_shape) {
      return InvalidModel(name, absl::StrCat("tensor '", t, "' has shape ", ShapeStr(e.shape),
                                             ", expected ", ShapeStr(want_shape)));
    }
    const char* src = bytes.data() + data_start + e.begin;
    const size_t n = (e.end - e.begin) / (e.bf16 ? 2 : 4);
    out->resize(n);
    if (e.bf16) {
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        (*out)[i] = Bf16ToFloat(h);
      }
    } else {
      std::memcpy(out->data(), src, n * 4);
    }
    for (float x : *out) {
      // Data read at shifted offsets (a wrong header length) is what the layout error names.
      if (!std::isfinite(x)) {
        return layout.ok() ? InvalidModel(name, absl::StrCat("tensor '", t, "' contains NaN or Inf"))
                           : layout;
      }
    }
    entries.erase(it);
    return absl::OkStatus();
  };
  auto rows_of = [&](const std::string& t, int64_t* rows) -> absl::Status {
    auto it = entries.find(t);
    if (it == entries.end()) return InvalidModel(name, absl::StrCat("tensor '", t, "' is missing"));
    if (it->second.shape.size() != 2 || it->second.shape[1] != c.hidden_dim || it->second.shape[0] <= 0) {
      return InvalidModel(name, absl::StrCat("tensor '", t, "' has shape ", ShapeStr(it->second.shape),
                                             ", expected [rows > 0, ", c.hidden_dim, "]"));
    }
    *rows = it->second.shape[0];
    return absl::OkStatus();
  };

  ModelWeights w;
  const int64_t d = c.hidden_dim, hd = c.hd();
  HSTU_RETURN_IF_ERROR(rows_of("embeddings.item.weight", &c.item_rows));
  HSTU_RETURN_IF_ERROR(rows_of("embeddings.action.weight", &c.action_rows));
  HSTU_RETURN_IF_ERROR(load("embeddings.item.weight", {c.item_rows, d}, &w.item_embedding));
  HSTU_RETURN_IF_ERROR(load("embeddings.action.weight", {c.action_rows, d}, &w.action_embedding));
  if (c.position_encoding) {
    HSTU_RETURN_IF_ERROR(rows_of("embeddings.position.weight", &c.position_rows));
    HSTU_RETURN_IF_ERROR(load("embeddings.position.weight", {c.position_rows, d}, &w.position_embedding));
  }
  // Every layer has tensors of its own: more layers than tensors means a corrupt count, not a
  // reason to allocate them.
  if (static_cast<size_t>(c.num_layers) > entries.size()) {
    return InvalidModel(name, absl::StrCat("metadata 'hstu.num_layers' = ", c.num_layers,
                                           " but the file holds only ", entries.size(), " more tensors"));
  }
  w.layers.resize(c.num_layers);
  for (int i = 0; i < c.num_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("layers.", i, ".");
    HSTU_RETURN_IF_ERROR(load(p + "input_norm.weight", {d}, &l.input_norm_w));
    HSTU_RETURN_IF_ERROR(load(p + "input_norm.bias", {d}, &l.input_norm_b));
    HSTU_RETURN_IF_ERROR(load(p + "uvqk.weight", {d, 4 * hd}, &l.uvqk_w));
    HSTU_RETURN_IF_ERROR(load(p + "uvqk.bias", {4 * hd}, &l.uvqk_b));
    HSTU_RETURN_IF_ERROR(load(p + "output_norm.weight", {hd}, &l.output_norm_w));
    HSTU_RETURN_IF_ERROR(load(p + "output_norm.bias", {hd}, &l.output_norm_b));
    HSTU_RETURN_IF_ERROR(load(p + "output.weight", {hd, d}, &l.output_w));
  }
  c.head_dims = {c.hidden_dim};
  for (int j = 0;; ++j) {
    const std::string wn = absl::StrCat("head.", j, ".weight");
    auto it = entries.find(wn);
    if (it == entries.end()) break;
    const auto shape = it->second.shape;
    if (shape.size() != 2 || shape[0] != c.head_dims.back() || shape[1] <= 0) {
      return InvalidModel(name, absl::StrCat("tensor '", wn, "' has shape ", ShapeStr(shape), ", expected [",
                                             c.head_dims.back(), ", out > 0]"));
    }
    HeadLayerWeights h;
    h.in = static_cast<int32_t>(shape[0]);
    h.out = static_cast<int32_t>(shape[1]);
    HSTU_RETURN_IF_ERROR(load(wn, {h.in, h.out}, &h.w));
    HSTU_RETURN_IF_ERROR(load(absl::StrCat("head.", j, ".bias"), {h.out}, &h.b));
    c.head_dims.push_back(h.out);
    w.head.push_back(std::move(h));
  }
  if (w.head.empty()) return InvalidModel(name, "tensor 'head.0.weight' is missing");
  if (c.head_dims.back() != c.num_tasks) {
    return InvalidModel(name, absl::StrCat("tensor 'head.", w.head.size() - 1, ".weight' outputs ",
                                           c.head_dims.back(), " values but hstu.num_tasks is ", c.num_tasks));
  }
  if (!entries.empty()) {
    return InvalidModel(name, absl::StrCat("unexpected tensor '", entries.begin()->first, "'"));
  }
  if (!layout.ok()) return layout;
  if (auto s = c.Validate(); !s.ok()) return InvalidModel(name, std::string(s.message()));
  w.config = std::move(c);
  return w;
#undef HSTU_RETURN_IF_ERROR
}

absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset) {
  ModelConfig c;
  if (preset == "tiny") {
    c.model_name = "hstu-tiny";
    c.num_layers = 2;
    c.hidden_dim = 64;
    c.num_heads = 2;
    c.head_dim = 32;
    c.max_history_tokens = 256;
    c.max_candidates = 64;
    c.attention_norm_len = 256 + 64;
    c.max_attn_len = 0;
    c.position_encoding = true;
    c.num_tasks = 3;
    c.item_rows = 1000;
    c.action_rows = 16;
    c.position_rows = 256;
    c.head_dims = {64, 32, 3};
  } else if (preset == "base") {
    c.model_name = "hstu-base";
    c.num_layers = 8;
    c.hidden_dim = 1024;
    c.num_heads = 4;
    c.head_dim = 256;
    c.max_history_tokens = 4096;
    c.max_candidates = 256;
    c.attention_norm_len = 4096 + 256;
    c.max_attn_len = 0;
    c.position_encoding = false;
    c.num_tasks = 4;
    c.item_rows = 1000000;
    c.action_rows = 128;
    c.position_rows = 0;
    c.head_dims = {1024, 512, 4};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown preset '", preset, "' (allowed: tiny, base)"));
  }
  return c;
}

ModelWeights RandomModel(const ModelConfig& c, uint64_t seed) {
  ModelWeights w;
  w.config = c;
  Rng rng{seed * 0x2545f4914f6cdd1dull + 0x1234567ull};
  const int64_t d = c.hidden_dim, hd = c.hd();
  const float sqrt3 = std::sqrt(3.f);  // uniform(-a, a) has std a / sqrt(3)
  Fill(w.item_embedding, static_cast<size_t>(c.item_rows * d), rng, 1.f);
  Fill(w.action_embedding, static_cast<size_t>(c.action_rows * d), rng, 1.f);
  if (c.position_encoding) Fill(w.position_embedding, static_cast<size_t>(c.position_rows * d), rng, 1.f);
  w.layers.resize(c.num_layers);
  for (auto& l : w.layers) {
    Fill(l.input_norm_w, d, rng, 0.1f, 1.f);
    Fill(l.input_norm_b, d, rng, 0.1f);
    // LayerNorm output has unit variance, so std 1/sqrt(d) keeps uvqk pre-activations ~N(0, 1).
    Fill(l.uvqk_w, d * 4 * hd, rng, sqrt3 / std::sqrt(static_cast<float>(d)));
    Fill(l.uvqk_b, 4 * hd, rng, 0.1f);
    Fill(l.output_norm_w, hd, rng, 0.1f, 1.f);
    Fill(l.output_norm_b, hd, rng, 0.1f);
    // Half the unit-variance scale: each layer adds a bounded amount to the residual stream.
    Fill(l.output_w, hd * d, rng, 0.5f * sqrt3 / std::sqrt(static_cast<float>(hd)));
  }
  for (size_t j = 0; j + 1 < c.head_dims.size(); ++j) {
    HeadLayerWeights h;
    h.in = c.head_dims[j];
    h.out = c.head_dims[j + 1];
    // The head's input is L2-normalised (unit norm), so the first layer uses unit-variance weights.
    const float scale = j == 0 ? sqrt3 : 1.5f * sqrt3 / std::sqrt(static_cast<float>(h.in));
    Fill(h.w, static_cast<size_t>(h.in) * h.out, rng, scale);
    Fill(h.b, h.out, rng, 0.1f);
    w.head.push_back(std::move(h));
  }
  return w;
}

absl::StatusOr<ModelWeights> LoadModel(const std::string& spec, uint64_t seed) {
  if (absl::StartsWith(spec, "random:")) {
    auto c = PresetConfig(spec.substr(7));
    if (!c.ok()) return c.status();
    return RandomModel(*c, seed);
  }
  return ReadModelFile(spec);
}

}  // namespace hstu
