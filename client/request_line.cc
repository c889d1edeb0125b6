#include "client/request_line.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <set>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace hstu::client {
namespace {

using json = nlohmann::json;

constexpr const char* kRequestLineFields[] = {"user_id",         "history_item_ids",
                                              "history_actions", "candidate_item_ids",
                                              "expected_scores", "cache_result"};

// JSON integer `v` as T, or an error naming `field` when it is not an integer or does not fit
// (a value is never wrapped: an action of 2^32 + 1 is not action 1).
template <typename T>
absl::StatusOr<T> IntegerAs(const json& v, const std::string& field) {
  const std::string range =
      std::string(std::is_signed_v<T> ? "int" : "uint") + std::to_string(8 * sizeof(T));
  if (v.is_number_float()) {
    // A literal past 64 bits is read as a double, as is 1.5.
    return absl::InvalidArgumentError("field '" + field + "' = " + v.dump() +
                                      " is not an integer in the range of " + range);
  }
  if (!v.is_number_integer())
    return absl::InvalidArgumentError("field '" + field + "' is not an integer");
  bool fits;
  if (v.is_number_unsigned()) {
    fits = v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  } else {                               // nlohmann parses only negative literals as signed
    const int64_t x = v.get<int64_t>();  // "-0" is 0
    fits =
        x >= 0 || (std::is_signed_v<T> && x >= static_cast<int64_t>(std::numeric_limits<T>::min()));
  }
  if (!fits) {
    return absl::InvalidArgumentError("field '" + field + "' = " + v.dump() +
                                      " is out of the range of " + range);
  }
  return v.get<T>();
}

}  // namespace

bool IsBlankRequestLine(const std::string& line) {
  return line.find_first_not_of(" \t\r") == std::string::npos;
}

absl::StatusOr<RequestLine> ParseRequestLine(const std::string& line) {
  // A key given twice at the top level: which one was meant is unknown (the parser keeps the last).
  std::string duplicate;
  std::set<std::string> top_keys;
  auto note_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && duplicate.empty() &&
        !top_keys.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json j;
  try {
    j = json::parse(line, note_keys);
  } catch (const json::exception& e) {  // a syntax error, or a number past a double (1e999)
    // "[json.exception.parse_error.101] parse error at line 1, column 9: ...": from "parse error".
    const std::string what = e.what();
    const size_t at = what.find("] ");
    return absl::InvalidArgumentError("not valid JSON: " +
                                      (at == std::string::npos ? what : what.substr(at + 2)));
  }
  if (!j.is_object()) return absl::InvalidArgumentError("not a JSON object");
  if (!duplicate.empty())
    return absl::InvalidArgumentError("field '" + duplicate + "' is given twice");
  for (const auto& [key, value] : j.items()) {
    // A misspelt key would otherwise leave its field empty: "history_items" scored no history.
    if (std::find(std::begin(kRequestLineFields), std::end(kRequestLineFields), key) ==
        std::end(kRequestLineFields)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown field '", key, "' (the fields: ", absl::StrJoin(kRequestLineFields, ", "), ")"));
    }
  }
  RequestLine out;
  if (!j.contains("user_id")) return absl::InvalidArgumentError("field 'user_id' is missing");
  auto user = IntegerAs<uint64_t>(j["user_id"], "user_id");
  if (!user.ok()) return user.status();
  out.user_id = *user;
  auto ints = [&](const char* field, auto* values, bool required) -> absl::Status {
    if (!j.contains(field)) {
      return required ? absl::InvalidArgumentError(std::string("field '") + field + "' is missing")
                      : absl::OkStatus();
    }
    const json& a = j[field];
    if (!a.is_array())
      return absl::InvalidArgumentError(std::string("field '") + field + "' must be an array");
    using T = typename std::remove_pointer_t<decltype(values)>::value_type;
    for (size_t i = 0; i < a.size(); ++i) {
      auto v = IntegerAs<T>(a[i], std::string(field) + "[" + std::to_string(i) + "]");
      if (!v.ok()) return v.status();
      values->push_back(*v);
    }
    return absl::OkStatus();
  };
  if (auto s = ints("history_item_ids", &out.history_item_ids, false); !s.ok()) return s;
  if (auto s = ints("history_actions", &out.history_actions, false); !s.ok()) return s;
  if (auto s = ints("candidate_item_ids", &out.candidate_item_ids, true); !s.ok()) return s;
  if (j.contains("expected_scores")) {
    const json& e = j["expected_scores"];
    const std::string want = "must be an array of arrays of numbers, one per candidate";
    if (!e.is_array()) return absl::InvalidArgumentError("field 'expected_scores' " + want);
    std::vector<std::vector<float>> rows;
    for (size_t c = 0; c < e.size(); ++c) {
      const std::string row_name = absl::StrCat("field 'expected_scores[", c, "]");
      if (!e[c].is_array()) return absl::InvalidArgumentError(row_name + "' " + want);
      std::vector<float> row;
      for (size_t t = 0; t < e[c].size(); ++t) {
        const std::string name = absl::StrCat(row_name, "[", t, "]'");
        if (!e[c][t].is_number()) return absl::InvalidArgumentError(name + " is not a number");
        // As a float, as the server sent it: a score written with 9 digits reads back as the
        // same float, so an answer the recompute reproduces differs by exactly 0. (Past a
        // float's range the cast is undefined: such a value is no score.)
        const double v = e[c][t].get<double>();
        if (!(std::abs(v) <= std::numeric_limits<float>::max())) {
          return absl::InvalidArgumentError(name + " = " + e[c][t].dump() +
                                            " is out of the range of a float");
        }
        row.push_back(static_cast<float>(v));
      }
      rows.push_back(std::move(row));
    }
    out.expected_scores = std::move(rows);
  }
  if (j.contains("cache_result")) {
    if (!j["cache_result"].is_string()) {
      return absl::InvalidArgumentError("field 'cache_result' must be a string");
    }
    out.cache_result = j["cache_result"].get<std::string>();
  }
  return out;
}

}  // namespace hstu::client
