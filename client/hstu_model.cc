// hstu_model: writes deterministic random model files and describes existing ones.
//   hstu_model init --preset tiny|base --seed N --out FILE [shape overrides] [--dtype f32|bf16]
//   hstu_model info FILE
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "client/cli_util.h"
#include "engine/atomic_file.h"
#include "engine/model_file.h"

ABSL_FLAG(std::string, preset, "tiny", "init: preset to start from (tiny | base)");
ABSL_FLAG(uint64_t, seed, 1, "init: seed of the random weights");
ABSL_FLAG(std::string, out, "", "init: output file (.safetensors)");
ABSL_FLAG(std::string, dtype, "f32", "init: tensor dtype in the file (f32 | bf16)");
ABSL_FLAG(int32_t, layers, 0, "init: override the number of layers (0 = preset)");
ABSL_FLAG(int32_t, hidden, 0, "init: override hidden size d (0 = preset)");
ABSL_FLAG(int32_t, heads, 0, "init: override number of heads H (0 = preset)");
ABSL_FLAG(int32_t, head_dim, 0, "init: override head dim D (0 = preset)");
ABSL_FLAG(int32_t, max_history, 0, "init: override max history tokens M, even (0 = preset)");
ABSL_FLAG(int32_t, max_candidates, 0, "init: override candidates per forward (0 = preset)");
ABSL_FLAG(int32_t, norm_len, 0, "init: override attention_norm_len N (0 = M + max candidates)");
ABSL_FLAG(int32_t, window, -1, "init: sliding window max_attn_len W (0 = none, -1 = preset)");
ABSL_FLAG(std::string, position_encoding, "", "init: true | false (empty = preset)");
ABSL_FLAG(int32_t, tasks, 0, "init: override number of tasks (0 = preset)");
ABSL_FLAG(int64_t, items, 0, "init: override item embedding rows (0 = preset)");
ABSL_FLAG(int64_t, actions, 0, "init: override action embedding rows (0 = preset)");
ABSL_FLAG(std::string, name, "", "init: model name (empty = preset's)");
ABSL_FLAG(int32_t, truncation_stride, 0,
          "init: history tokens a long history's kept start moves by (even, <= M; 0 = M/4 rounded "
          "down to even)");

namespace {

int Init() {
  auto preset = hstu::PresetConfig(absl::GetFlag(FLAGS_preset));
  if (!preset.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(preset.status().message()).c_str());
    return 2;
  }
  hstu::ModelConfig c = *preset;
  if (absl::GetFlag(FLAGS_out).empty()) {
    std::fprintf(stderr, "error: --out FILE is required\n");
    return 2;
  }
  // Before the weights are drawn (seconds to minutes for a large --items).
  if (absl::Status s = hstu::CheckWritable(absl::GetFlag(FLAGS_out)); !s.ok()) {
    std::fprintf(stderr, "error: --out=%s: %s\n", absl::GetFlag(FLAGS_out).c_str(),
                 std::string(s.message()).c_str());
    return 2;
  }
  const int32_t prev_max = c.max_history_tokens, prev_cand = c.max_candidates;
  if (int v = absl::GetFlag(FLAGS_layers)) c.num_layers = v;
  if (int v = absl::GetFlag(FLAGS_hidden)) c.hidden_dim = v;
  if (int v = absl::GetFlag(FLAGS_heads)) c.num_heads = v;
  if (int v = absl::GetFlag(FLAGS_head_dim)) c.head_dim = v;
  if (int v = absl::GetFlag(FLAGS_max_history)) c.max_history_tokens = v;
  if (int v = absl::GetFlag(FLAGS_max_candidates)) c.max_candidates = v;
  if (int v = absl::GetFlag(FLAGS_window); v >= 0) {
    c.max_attn_len = v;
  } else if (v != -1) {
    std::fprintf(stderr, "error: --window must be >= 0 (0: no window), or -1 for the preset's, got %d\n", v);
    return 2;
  }
  if (int v = absl::GetFlag(FLAGS_tasks)) c.num_tasks = v;
  c.truncation_stride_tokens = absl::GetFlag(FLAGS_truncation_stride);
  if (int64_t v = absl::GetFlag(FLAGS_items)) c.item_rows = v;
  if (int64_t v = absl::GetFlag(FLAGS_actions)) c.action_rows = v;
  if (auto n = absl::GetFlag(FLAGS_name); !n.empty()) c.model_name = n;
  const std::string pe = absl::GetFlag(FLAGS_position_encoding);
  if (pe == "true") c.position_encoding = true;
  if (pe == "false") c.position_encoding = false;
  if (!pe.empty() && pe != "true" && pe != "false") {
    std::fprintf(stderr, "error: --position_encoding must be true or false, got '%s'\n", pe.c_str());
    return 2;
  }
  if (int v = absl::GetFlag(FLAGS_norm_len)) {
    c.attention_norm_len = v;
  } else if (c.max_history_tokens != prev_max || c.max_candidates != prev_cand) {
    const int64_t n = int64_t{c.max_history_tokens} + c.max_candidates;  // no int32 wrap
    c.attention_norm_len = static_cast<int32_t>(std::min<int64_t>(n, INT32_MAX));
  }
  c.position_rows = c.position_encoding ? c.max_history_tokens : 0;
  // Head: keep the preset's hidden layer sizes relative to d: d -> d/2 -> tasks.
  c.head_dims = {c.hidden_dim, std::max(1, c.hidden_dim / 2), c.num_tasks};
  if (auto s = c.Validate(); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  const std::string dt = absl::GetFlag(FLAGS_dtype);
  if (dt != "f32" && dt != "bf16") {
    std::fprintf(stderr, "error: --dtype must be f32 or bf16, got '%s'\n", dt.c_str());
    return 2;
  }
  hstu::ModelWeights w;
  try {
    w = hstu::RandomModel(c, absl::GetFlag(FLAGS_seed));
  } catch (const std::exception&) {  // bad_alloc, or length_error past what a vector can hold
    std::fprintf(stderr, "error: not enough memory for the weights of this model (%lld item rows x "
                 "hidden %d)\n", static_cast<long long>(c.item_rows), c.hidden_dim);
    return 1;
  }
  auto s = hstu::WriteModelFile(w, absl::GetFlag(FLAGS_out),
                                dt == "bf16" ? hstu::FileDType::kBF16 : hstu::FileDType::kF32);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  // On stderr: with --out=/dev/stdout the model file is stdout (before, this line ended it).
  std::fprintf(stderr, "wrote %s (%s, %s)\n", absl::GetFlag(FLAGS_out).c_str(),
               c.model_name.c_str(), dt.c_str());
  return 0;
}

int Info(const std::string& path) {
  auto w = hstu::ReadModelFile(path);
  if (!w.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(w.status().message()).c_str());
    return 1;
  }
  const hstu::ModelConfig& c = w->config;
  std::printf("model_name          %s\n", c.model_name.c_str());
  std::printf("num_layers          %d\nhidden_dim          %d\nnum_heads           %d\n", c.num_layers,
              c.hidden_dim, c.num_heads);
  std::printf("head_dim            %d\nattention_norm_len  %d\nmax_history_tokens  %d\n", c.head_dim,
              c.attention_norm_len, c.max_history_tokens);
  std::printf("max_candidates      %d\nmax_attn_len        %d\nposition_encoding   %s\n",
              c.max_candidates, c.max_attn_len, c.position_encoding ? "true" : "false");
  std::printf("num_tasks           %d\nitem_rows           %lld\naction_rows         %lld\n",
              c.num_tasks, static_cast<long long>(c.item_rows), static_cast<long long>(c.action_rows));
  std::printf("position_rows       %lld\nhead                %s\n",
              static_cast<long long>(c.position_rows), absl::StrJoin(c.head_dims, " -> ").c_str());
  std::printf("truncation_stride   %d%s\n", c.truncation_stride(),
              c.truncation_stride_tokens > 0 ? "" : " (default)");
  std::printf("tensors:\n");
  auto row = [](const std::string& n, int64_t a, int64_t b) {
    if (b > 0) {
      std::printf("  %-32s [%lld, %lld]\n", n.c_str(), static_cast<long long>(a), static_cast<long long>(b));
    } else {
      std::printf("  %-32s [%lld]\n", n.c_str(), static_cast<long long>(a));
    }
  };
  row("embeddings.item.weight", c.item_rows, c.hidden_dim);
  row("embeddings.action.weight", c.action_rows, c.hidden_dim);
  if (c.position_encoding) row("embeddings.position.weight", c.position_rows, c.hidden_dim);
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    row(p + "input_norm.weight", c.hidden_dim, 0);
    row(p + "input_norm.bias", c.hidden_dim, 0);
    row(p + "uvqk.weight", c.hidden_dim, 4 * c.hd());
    row(p + "uvqk.bias", 4 * c.hd(), 0);
    row(p + "output_norm.weight", c.hd(), 0);
    row(p + "output_norm.bias", c.hd(), 0);
    row(p + "output.weight", c.hd(), c.hidden_dim);
  }
  for (size_t j = 0; j < w->head.size(); ++j) {
    row("head." + std::to_string(j) + ".weight", w->head[j].in, w->head[j].out);
    row("head." + std::to_string(j) + ".bias", w->head[j].out, 0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "model files.\n"
      "  hstu_model init --preset tiny|base --seed N --out FILE [--dtype f32|bf16] [overrides]\n"
      "  hstu_model info FILE");
  auto args = hstu::NormalizeFlagDashes(argc, argv);
  auto argv2 = hstu::ArgvOf(args);
  std::vector<char*> pos = hstu::ParseFlags(argv2);
  if (pos.size() >= 2 && std::string(pos[1]) == "init" && pos.size() == 2) return Init();
  if (pos.size() == 3 && std::string(pos[1]) == "info") return Info(pos[2]);
  if (pos.size() < 2) {
    std::fprintf(stderr, "error: a command is required: init or info\n");
  } else if (std::string(pos[1]) == "init") {
    std::fprintf(stderr, "error: init takes flags only, not '%s'\n", pos[2]);
  } else if (std::string(pos[1]) == "info") {
    std::fprintf(stderr, "error: info takes one model file\n");
  } else {
    std::fprintf(stderr, "error: unknown command '%s' (init or info)\n", pos[1]);
  }
  std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
  return 2;
}
