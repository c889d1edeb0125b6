#include "client/report.h"

#include <initializer_list>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace hstu::loadgen {

int64_t LevelResult::error_count() const {
  int64_t n = 0;
  for (const auto& [code, count] : errors) n += count;
  return n;
}

bool LevelResult::sender_fell_behind() const {
  return mode == "open" && sender_lag.count() > 0 &&
         sender_lag.Quantile(0.99) > kSenderLagWarnSeconds;
}

namespace {

double Ms(double s) { return s * 1e3; }

// A table's rule under its header: "|---...---|" over columns of these widths.
std::string Rule(std::initializer_list<int> widths) {
  std::string out = "|";
  for (int w : widths) absl::StrAppend(&out, std::string(w, '-'), "|");
  return out + "\n";
}

double SentRps(const LevelResult& l) {
  return l.duration_s > 0 ? static_cast<double>(l.sent) / l.duration_s : 0;
}

double ReusePercent(const LevelResult& l) {
  const int64_t total = l.reused_tokens + l.computed_tokens;
  return total > 0 ? 100.0 * static_cast<double>(l.reused_tokens) / static_cast<double>(total) : 0;
}

// "NAME:count" pairs joined by `sep`.
std::string JoinCounts(const std::map<std::string, int64_t>& counts, const char* sep) {
  std::vector<std::string> parts;
  for (const auto& [name, count] : counts) parts.push_back(absl::StrCat(name, ":", count));
  return absl::StrJoin(parts, sep);
}

std::string Errors(const LevelResult& l) { return l.errors.empty() ? "0" : JoinCounts(l.errors, ","); }

}  // namespace

std::string LevelLabel(const LevelResult& l) {
  return absl::StrCat(l.mode == "closed" ? absl::StrCat("c=", l.concurrency)
                                         : absl::StrFormat("%.10g rps %s", l.rate_rps, l.arrival),
                      l.interrupted ? " (stopped)" : "");
}

std::string FormatTable(const RunInfo& info, const std::vector<LevelResult>& levels) {
  std::string out =
      info.replay_file.empty()
          ? absl::StrFormat(
                "hstu_loadgen: target %s, model %s on %s, %d candidates, %d users (zipf %.2f), %d "
                "connection(s), seed %d\n",
                info.target, info.model, info.device, info.candidates, info.users, info.zipf,
                info.connections, info.seed)
          : absl::StrFormat(
                "hstu_loadgen: target %s, model %s on %s, replaying %s (%d lines, %d users%s), "
                "%d connection(s), seed %d\n",
                info.target, info.model, info.device, info.replay_file, info.replay_lines,
                info.replay_users,
                info.replay_passes > 0
                    ? absl::StrFormat("; went back to its first line %d time(s): the later "
                                      "passes re-sent histories the server held",
                                      info.replay_passes)
                    : "",
                info.connections, info.seed);
  absl::StrAppend(&out, absl::StrFormat("| %-18s | %9s | %8s | %8s | %8s | %8s | %8s | %8s | %8s | %7s | %s |\n",
                                        "load", "requests", "rps", "p50 ms", "p90 ms", "p95 ms",
                                        "p99 ms", "p99.9 ms", "max ms", "reuse %", "errors"));
  absl::StrAppend(&out, Rule({20, 11, 10, 10, 10, 10, 10, 10, 10, 9, 8}));
  for (const LevelResult& l : levels) {
    const LatencyHistogram& h = l.latency;
    absl::StrAppend(
        &out, absl::StrFormat("| %-18s | %9d | %8.1f | %8.3f | %8.3f | %8.3f | %8.3f | %8.3f | %8.3f | %7.1f | %s |\n",
                              LevelLabel(l), l.requests, l.throughput_rps(), Ms(h.Quantile(0.5)),
                              Ms(h.Quantile(0.9)), Ms(h.Quantile(0.95)), Ms(h.Quantile(0.99)),
                              Ms(h.Quantile(0.999)), Ms(h.max_seconds()), ReusePercent(l),
                              Errors(l)));
  }
  absl::StrAppend(&out, "latency: OK answers only (the errors' own, by code, below); rps: OK "
                        "answers that came back in the measured window, over its length\n");
  // Open loop: what the sender achieved against its schedule.
  bool open = false;
  for (const LevelResult& l : levels) open = open || l.mode == "open";
  if (open) {
    absl::StrAppend(&out, "\nopen-loop sender (latency counts from the scheduled send time):\n",
                    absl::StrFormat("| %-18s | %9s | %9s | %12s | %12s | %12s |\n", "load", "sent",
                                    "sent rps", "lag p50 ms", "lag p99 ms", "lag max ms"),
                    Rule({20, 11, 11, 14, 14, 14}));
    for (const LevelResult& l : levels) {
      if (l.mode != "open") continue;
      const LatencyHistogram& g = l.sender_lag;
      absl::StrAppend(&out, absl::StrFormat("| %-18s | %9d | %9.1f | %12.3f | %12.3f | %12.3f |\n",
                                            LevelLabel(l), l.sent, SentRps(l), Ms(g.Quantile(0.5)),
                                            Ms(g.Quantile(0.99)), Ms(g.max_seconds())));
    }
    for (const LevelResult& l : levels) {
      if (!l.sender_fell_behind()) continue;
      absl::StrAppend(
          &out, absl::StrFormat(
                    "warning: at %s the sender left its calls %.3f ms late (p99): its latencies "
                    "and DEADLINE_EXCEEDED count include that lag. Lower --rate, or give "
                    "hstu_loadgen cores of its own.\n",
                    LevelLabel(l), Ms(l.sender_lag.Quantile(0.99))));
    }
  }
  // How fast each kind of error came back (a refusal at once, an expiry at the deadline).
  bool any_errors = false;
  for (const LevelResult& l : levels) any_errors = any_errors || !l.error_latency.empty();
  if (any_errors) {
    absl::StrAppend(&out, "\nerrors by code (latency of the calls that ended with it):\n",
                    absl::StrFormat("| %-18s | %-18s | %9s | %8s | %8s | %8s |\n", "load", "code",
                                    "calls", "p50 ms", "p99 ms", "max ms"),
                    Rule({20, 20, 11, 10, 10, 10}));
    for (const LevelResult& l : levels) {
      for (const auto& [code, hist] : l.error_latency) {
        absl::StrAppend(&out, absl::StrFormat("| %-18s | %-18s | %9d | %8.3f | %8.3f | %8.3f |\n",
                                              LevelLabel(l), code, hist.count(),
                                              Ms(hist.Quantile(0.5)), Ms(hist.Quantile(0.99)),
                                              Ms(hist.max_seconds())));
      }
    }
  }
  // Latency by how the server's KV cache served the request (RankResponse.cache_result).
  bool any = false;
  for (const LevelResult& l : levels) any = any || !l.by_cache_result.empty();
  if (!any) return out;
  absl::StrAppend(&out, "\nby cache result (server-reported):\n",
                  absl::StrFormat("| %-18s | %-13s | %9s | %7s | %8s | %8s |\n", "load",
                                  "cache result", "requests", "share %", "p50 ms", "p99 ms"),
                  Rule({20, 15, 11, 9, 10, 10}));
  for (const LevelResult& l : levels) {
    for (const auto& [result, hist] : l.by_cache_result) {
      const double share = l.requests ? 100.0 * hist.count() / l.requests : 0;
      absl::StrAppend(&out, absl::StrFormat("| %-18s | %-13s | %9d | %7.1f | %8.3f | %8.3f |\n",
                                            LevelLabel(l), result, hist.count(), share,
                                            Ms(hist.Quantile(0.5)), Ms(hist.Quantile(0.99))));
    }
  }
  return out;
}

std::string ToJson(const RunInfo& info, const std::vector<LevelResult>& levels) {
  nlohmann::json root;
  root["target"] = info.target;
  root["model"] = info.model;
  root["device"] = info.device;
  if (info.replay_file.empty()) {
    root["candidates"] = info.candidates;
    root["users"] = info.users;
    root["zipf"] = info.zipf;
  } else {
    root["replay"] = {{"file", info.replay_file},
                      {"lines", info.replay_lines},
                      {"users", info.replay_users},
                      {"passes", info.replay_passes}};
  }
  root["connections"] = info.connections;
  root["seed"] = info.seed;
  root["levels_planned"] = info.levels_planned;
  root["interrupted"] = info.interrupted;
  nlohmann::json arr = nlohmann::json::array();
  for (const LevelResult& l : levels) {
    nlohmann::json j;
    j["mode"] = l.mode;
    if (l.mode == "closed") {
      j["concurrency"] = l.concurrency;
    } else {
      j["rate_rps"] = l.rate_rps;
      j["arrival"] = l.arrival;
    }
    j["duration_s"] = l.duration_s;
    j["interrupted"] = l.interrupted;
    j["requests"] = l.requests;
    j["throughput_rps"] = l.throughput_rps();
    const LatencyHistogram& h = l.latency;
    j["latency_ms"] = {{"p50", Ms(h.Quantile(0.5))},   {"p90", Ms(h.Quantile(0.9))},
                       {"p95", Ms(h.Quantile(0.95))},  {"p99", Ms(h.Quantile(0.99))},
                       {"p999", Ms(h.Quantile(0.999))}, {"mean", Ms(h.mean_seconds())},
                       {"max", Ms(h.max_seconds())}};
    nlohmann::json errors = nlohmann::json::object();
    for (const auto& [code, count] : l.errors) errors[code] = count;
    j["errors"] = errors;
    j["error_count"] = l.error_count();
    nlohmann::json error_latency = nlohmann::json::object();
    for (const auto& [code, hist] : l.error_latency) {
      error_latency[code] = {{"calls", hist.count()},
                             {"p50", Ms(hist.Quantile(0.5))},
                             {"p99", Ms(hist.Quantile(0.99))},
                             {"max", Ms(hist.max_seconds())}};
    }
    j["error_latency_ms"] = error_latency;
    j["reused_tokens"] = l.reused_tokens;
    j["computed_tokens"] = l.computed_tokens;
    j["new_user_visits"] = l.new_user_visits;
    nlohmann::json by = nlohmann::json::object();
    for (const auto& [result, hist] : l.by_cache_result) {
      by[result] = {{"requests", hist.count()},
                    {"share", l.requests ? static_cast<double>(hist.count()) / l.requests : 0.0},
                    {"p50_ms", Ms(hist.Quantile(0.5))},
                    {"p99_ms", Ms(hist.Quantile(0.99))},
                    {"mean_ms", Ms(hist.mean_seconds())}};
    }
    j["by_cache_result"] = by;
    if (l.mode == "open") {
      const LatencyHistogram& g = l.sender_lag;
      j["sent"] = l.sent;
      j["sent_rps"] = SentRps(l);
      j["sender_lag_ms"] = {{"p50", Ms(g.Quantile(0.5))},
                            {"p99", Ms(g.Quantile(0.99))},
                            {"max", Ms(g.max_seconds())}};
      j["sender_fell_behind"] = l.sender_fell_behind();
    }
    arr.push_back(j);
  }
  root["levels"] = arr;
  // The last level's headline numbers at the top level too, for scripts that run one level.
  if (!arr.empty()) {
    for (const char* k : {"throughput_rps", "latency_ms", "requests", "errors", "reused_tokens",
                          "computed_tokens"}) {
      root[k] = arr.back()[k];
    }
  }
  // The target, model and file names may hold bytes that are not UTF-8: written as U+FFFD.
  return root.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string ToCsv(const std::vector<LevelResult>& levels) {
  // One row per level; the per-code errors and per-cache-result requests are "NAME:count" pairs
  // joined by ';' in one column each (no commas inside a field).
  std::string out =
      "mode,concurrency,rate_rps,arrival,duration_s,requests,throughput_rps,p50_ms,p90_ms,p95_ms,"
      "p99_ms,p999_ms,mean_ms,max_ms,errors,errors_by_code,reused_tokens,computed_tokens,"
      "requests_by_cache_result,new_user_visits,interrupted,sent,sender_lag_p99_ms\n";
  for (const LevelResult& l : levels) {
    const LatencyHistogram& h = l.latency;
    std::map<std::string, int64_t> by_cache;
    for (const auto& [name, hist] : l.by_cache_result) by_cache[name] = hist.count();
    absl::StrAppend(&out, absl::StrFormat("%s,%d,%.3f,%s,%.3f,%d,%.3f,"
                                          "%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,"
                                          "%d,%s,%d,%d,%s,%d,%d,%d,%.4f\n",
                                          l.mode, l.concurrency, l.rate_rps, l.arrival,
                                          l.duration_s, l.requests, l.throughput_rps(),
                                          Ms(h.Quantile(0.5)), Ms(h.Quantile(0.9)),
                                          Ms(h.Quantile(0.95)), Ms(h.Quantile(0.99)),
                                          Ms(h.Quantile(0.999)), Ms(h.mean_seconds()),
                                          Ms(h.max_seconds()), l.error_count(), JoinCounts(l.errors, ";"),
                                          l.reused_tokens, l.computed_tokens, JoinCounts(by_cache, ";"),
                                          l.new_user_visits, l.interrupted ? 1 : 0, l.sent,
                                          Ms(l.sender_lag.Quantile(0.99))));
  }
  return out;
}

}  // namespace hstu::loadgen
