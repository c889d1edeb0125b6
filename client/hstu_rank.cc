// hstu_rank: offline scoring of a JSONL file of requests, in order, in one process (so returning
// users reuse their KV cache). One JSON line out per line in.
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli_util.h"
#include "client/request_line.h"
#include "engine/backend.h"
#include "engine/engine.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, model, "random:tiny", "model file, or random:PRESET (tiny | base)");
ABSL_FLAG(uint64_t, seed, 1, "seed of a random:PRESET model");
ABSL_FLAG(std::string, input, "", "JSONL requests, one per line ('-' = stdin)");
ABSL_FLAG(std::string, device, "cpu",
          "cpu | cpu-bf16 (the CPU reference rounded as the GPU rounds, DESIGN §2.4) | cuda:N | auto");
ABSL_FLAG(bool, no_cache, false, "recompute every history (no KV reuse between requests)");
ABSL_FLAG(int32_t, page_size, 32,
          "tokens per KV page, in [1, 4096]; any size, so that tests can reach odd page layouts "
          "(hstu_server takes powers of two, DESIGN §6)");
ABSL_FLAG(int64_t, cache_pages, 0, "KV pool size in pages (0 = default for the device)");
ABSL_FLAG(int64_t, host_cache_pages, 0,
          "host KV tier size in pages (0 = no host tier, -1 = automatic: on a GPU 2x its pool, within "
          "1/4 of the RAM or cgroup limit and 32 GiB)");
ABSL_FLAG(int64_t, max_candidates, 1 << 20,
          "reject requests with more candidates than this (<= 0: no limit)");
ABSL_FLAG(double, max_score_diff, 2e-3,
          "a line with expected_scores fails when a score differs from its expected one by more "
          "than this (the GPU's score tolerance against the CPU reference; a GPU server's answers "
          "recomputed on the GPU differ by up to ~1e-2 in bf16, docs/server.md; inf: report only)");

namespace {

using json = nlohmann::json;

// How a result's scores differ from the expected ones: the largest difference and where it is,
// and the sum over every score (for the mean); an error when the shapes differ.
struct ScoreDiff {
  double max = 0, sum = 0;
  int64_t scores = 0;
  size_t candidate = 0, task = 0;
  double got = 0, expected = 0;
};
absl::StatusOr<ScoreDiff> CompareScores(const hstu::RankResult& res,
                                        const std::vector<std::vector<float>>& expected,
                                        size_t num_candidates) {
  if (expected.size() != num_candidates) {
    return absl::InvalidArgumentError(absl::StrCat("field 'expected_scores' has ", expected.size(),
                                                   " rows for ", num_candidates, " candidates"));
  }
  ScoreDiff d;
  for (size_t c = 0; c < num_candidates; ++c) {
    if (expected[c].size() != static_cast<size_t>(res.num_tasks)) {
      return absl::InvalidArgumentError(absl::StrCat("field 'expected_scores[", c, "]' has ",
                                                     expected[c].size(), " scores for the model's ",
                                                     res.num_tasks, " tasks"));
    }
    for (int t = 0; t < res.num_tasks; ++t) {
      const double got = res.scores[c * res.num_tasks + t];
      double diff = std::abs(got - static_cast<double>(expected[c][t]));
      // NaN on either side is the largest difference there is.
      if (std::isnan(diff)) diff = std::numeric_limits<double>::infinity();
      d.sum += diff;
      ++d.scores;
      if (diff > d.max || (d.scores == 1)) {
        d.max = diff;
        d.candidate = c;
        d.task = static_cast<size_t>(t);
        d.got = got;
        d.expected = expected[c][t];
      }
    }
  }
  return d;
}

// What the lines with expected_scores came to, overall and by their cache_result. On a GPU the
// lines the server computed whole (miss) show what batching alone changes in bf16; a reuse path
// whose differences stand out from theirs is suspect.
struct CheckSummary {
  struct Group {
    int64_t lines = 0, above = 0, scores = 0;
    double max = 0, sum = 0;
  };
  Group all;
  int max_line = 0;
  std::map<std::string, Group> by_cache_result;

  void Add(const std::string& cache_result, const ScoreDiff& d, bool above, int line_no) {
    if (d.max > all.max || all.lines == 0) max_line = line_no;
    for (Group* g : {&all, &by_cache_result[cache_result.empty() ? "-" : cache_result]}) {
      ++g->lines;
      g->above += above ? 1 : 0;
      g->max = std::max(g->max, d.max);
      g->sum += d.sum;
      g->scores += d.scores;
    }
  }
  std::string Format(double tolerance) const {
    auto mean = [](const Group& g) { return g.scores > 0 ? g.sum / static_cast<double>(g.scores) : 0.0; };
    std::string out = absl::StrFormat(
        "hstu_rank: %d lines checked against expected_scores: largest difference %.3g (line %d), "
        "mean %.3g; %d above --max_score_diff=%g\n",
        all.lines, all.max, max_line, mean(all), all.above, tolerance);
    for (const auto& [name, g] : by_cache_result) {
      absl::StrAppendFormat(&out, "  %-16s %8d lines  largest difference %.3g  mean %.3g  above %d\n",
                            name, g.lines, g.max, mean(g), g.above);
    }
    return out;
  }
};

}  // namespace

int main(int argc, char** argv) {
  // A closed stdout is a write error (exit 1, as the help says), not a death by SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  absl::SetProgramUsageMessage(
      "scores JSONL requests offline.\n"
      "  hstu_rank --model FILE|random:PRESET --input=FILE.jsonl|--input=- [--device cpu|cpu-bf16|cuda:N|auto]\n"
      "            [--no-cache] [--page-size N] [--cache-pages N] [--host-cache-pages N]\n"
      "            [--max-candidates N] [--seed N]\n"
      "(--input=- reads stdin; write it with '=': absl asks whether a separate '-' was meant;\n"
      " a blank input line gives no output line.)\n"
      "Input line: {\"user_id\": 7, \"history_item_ids\": [...], \"history_actions\": [...],\n"
      "             \"candidate_item_ids\": [...]}\n"
      "  optionally with \"expected_scores\": [[t0, t1, ...] per candidate] and \"cache_result\": \"...\"\n"
      "  (hstu_loadgen --record writes such lines: each is then checked, --max-score-diff)\n"
      "Output line: {\"user_id\": 7, \"scores\": [[t0, t1, ...] per candidate], \"reused_tokens\": R,\n"
      "              \"computed_tokens\": C[, \"max_score_diff\": D]}  or  {\"line\": N, \"error\": \"...\"}\n"
      "Exit status: 0 every line scored (and within --max-score-diff of its expected_scores);\n"
      "1 a line was an error or differed from its expected_scores, the output could not be written,\n"
      "a flag did not parse, or the model or the device could not be used; 2 a flag value out of\n"
      "its range (an unknown --device included), a missing or unreadable --input, a word that is\n"
      "no flag, or a pool too small for the model.");
  auto args = hstu::NormalizeFlagDashes(argc, argv);
  auto argv2 = hstu::ArgvOf(args);
  const std::vector<char*> rest = hstu::ParseFlags(argv2);
  if (!hstu::OnlyFlagsGiven(rest)) return 2;
  // Logs go to stderr: stdout carries only the JSON lines.
  spdlog::set_default_logger(spdlog::stderr_color_mt("hstu_rank"));
  spdlog::set_level(spdlog::level::warn);

  const std::string input = absl::GetFlag(FLAGS_input);
  if (input.empty()) {
    std::fprintf(stderr, "error: --input=FILE.jsonl (or --input=- for stdin) is required (see --help)\n");
    return 2;
  }
  std::ifstream file;
  std::istream* in = &std::cin;
  if (input != "-") {
    std::error_code ec;
    if (std::filesystem::is_directory(input, ec)) {
      std::fprintf(stderr, "error: --input '%s' is a directory\n", input.c_str());
      return 2;
    }
    file.open(input);
    if (!file) {
      std::fprintf(stderr, "error: cannot open --input '%s'\n", input.c_str());
      return 2;
    }
    in = &file;
  }

  const int32_t page_size = absl::GetFlag(FLAGS_page_size);
  if (page_size < 1 || page_size > 4096) {
    std::fprintf(stderr, "error: --page_size=%d: must be in [1, 4096]\n", page_size);
    return 2;
  }
  // The pools' ranges, named as the flags (the engine's own check names its options' fields).
  if (const int64_t pages = absl::GetFlag(FLAGS_cache_pages);
      pages < 0 || pages > hstu::kMaxPoolPages) {
    std::fprintf(stderr, "error: --cache_pages=%lld: must be in [0, %lld]\n",
                 static_cast<long long>(pages), static_cast<long long>(hstu::kMaxPoolPages));
    return 2;
  }
  if (const int64_t pages = absl::GetFlag(FLAGS_host_cache_pages);
      pages < -1 || pages > hstu::kMaxPoolPages) {
    std::fprintf(stderr, "error: --host_cache_pages=%lld: must be in [0, %lld], or -1 for auto\n",
                 static_cast<long long>(pages), static_cast<long long>(hstu::kMaxPoolPages));
    return 2;
  }
  const double tolerance = absl::GetFlag(FLAGS_max_score_diff);
  if (!(tolerance >= 0)) {  // inf: report the differences, fail none
    std::fprintf(stderr, "error: --max_score_diff=%g: must be >= 0 (inf: report only)\n", tolerance);
    return 2;
  }
  if (absl::Status name = hstu::CheckDeviceName(absl::GetFlag(FLAGS_device)); !name.ok()) {
    std::fprintf(stderr, "error: --device=%s: %s\n", absl::GetFlag(FLAGS_device).c_str(),
                 std::string(name.message()).c_str());
    return 2;
  }
  hstu::EngineOptions opts;
  opts.model = absl::GetFlag(FLAGS_model);
  opts.seed = absl::GetFlag(FLAGS_seed);
  opts.device = absl::GetFlag(FLAGS_device);
  opts.enable_cache = !absl::GetFlag(FLAGS_no_cache);
  opts.page_size = absl::GetFlag(FLAGS_page_size);
  opts.cache_pages = absl::GetFlag(FLAGS_cache_pages);
  opts.host_cache_pages = absl::GetFlag(FLAGS_host_cache_pages);
  opts.limits.max_candidates = absl::GetFlag(FLAGS_max_candidates);
  // A flag out of its range exits 2, as --page_size does, before the model is loaded.
  if (absl::Status range = hstu::CheckEngineOptions(opts); !range.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(range.message()).c_str());
    return 2;
  }
  auto engine = hstu::Engine::Create(opts);
  if (!engine.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  // As hstu_server: a pool that cannot hold one user of the longest history would fail every
  // such line.
  if (absl::Status pool = (*engine)->CheckPoolHoldsTheLongestHistory(); !pool.ok()) {
    std::fprintf(stderr, "error: --cache_pages=%lld: %s\n", static_cast<long long>(opts.cache_pages),
                 std::string(pool.message()).c_str());
    return 2;
  }

  int failures = 0;
  CheckSummary checked;
  std::string line;
  // A reader that went away (`| head -1`) ends the run: the rest would be scored for nobody.
  for (int line_no = 1; !std::ferror(stdout) && std::getline(*in, line); ++line_no) {
    if (hstu::client::IsBlankRequestLine(line)) continue;
    auto parsed = hstu::client::ParseRequestLine(line);
    hstu::RankRequest request;
    if (parsed.ok()) {
      request = {.user_id = parsed->user_id,
                 .history_item_ids = std::move(parsed->history_item_ids),
                 .history_actions = std::move(parsed->history_actions),
                 .candidate_item_ids = std::move(parsed->candidate_item_ids)};
    }
    const hstu::RankRequest* req = parsed.ok() ? &request : nullptr;
    absl::StatusOr<hstu::RankResult> res =
        req != nullptr ? std::move((*engine)->Rank({req, 1})[0])
                       : absl::StatusOr<hstu::RankResult>(parsed.status());
    absl::StatusOr<ScoreDiff> diff = ScoreDiff{};
    if (res.ok() && parsed->expected_scores.has_value()) {
      diff = CompareScores(*res, *parsed->expected_scores, req->candidate_item_ids.size());
      if (!diff.ok()) res = diff.status();
    }
    if (!res.ok()) {
      ++failures;
      nlohmann::ordered_json err = {{"line", line_no}, {"error", std::string(res.status().message())}};
      // The message may quote the line's bytes, cut anywhere (a parse error's excerpt): what is
      // not UTF-8 is written as U+FFFD (before: the dump threw and the process aborted).
      std::printf("%s\n", err.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
      std::fprintf(stderr, "line %d: %s\n", line_no, std::string(res.status().message()).c_str());
      continue;
    }
    json scores = json::array();
    for (size_t c = 0; c < req->candidate_item_ids.size(); ++c) {
      json row = json::array();
      for (int t = 0; t < res->num_tasks; ++t) row.push_back(res->scores[c * res->num_tasks + t]);
      scores.push_back(std::move(row));
    }
    nlohmann::ordered_json out = {{"user_id", req->user_id},
                {"scores", std::move(scores)},
                {"reused_tokens", res->reused_tokens},
                {"computed_tokens", res->computed_tokens}};
    if (parsed->expected_scores.has_value()) {
      const bool above = !(diff->max <= tolerance);
      out["max_score_diff"] = diff->max;
      checked.Add(parsed->cache_result, *diff, above, line_no);
      if (above) {
        ++failures;
        std::fprintf(stderr,
                     "line %d: user %llu (%s): candidate %zu task %zu scored %.9g, expected %.9g: "
                     "a difference of %.3g, above --max_score_diff=%g\n",
                     line_no, static_cast<unsigned long long>(req->user_id),
                     parsed->cache_result.empty() ? "-" : parsed->cache_result.c_str(),
                     diff->candidate, diff->task, diff->got, diff->expected, diff->max, tolerance);
      }
    }
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  if (checked.all.lines > 0) std::fprintf(stderr, "%s", checked.Format(tolerance).c_str());
  if (in->bad()) {
    std::fprintf(stderr, "error: reading --input '%s' failed\n", input.c_str());
    return 1;
  }
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "error: writing the results to stdout failed\n");
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
