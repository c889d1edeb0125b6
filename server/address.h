// gRPC address pieces shared by the server's --listen checks and hstu_loadgen's --target check.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"

namespace hstu {

// gRPC's unix: and unix-abstract: addresses (no port).
inline bool IsUnixSocketAddress(absl::string_view address) {
  return address.rfind("unix:", 0) == 0 || address.rfind("unix-abstract:", 0) == 0;
}

// A port's decimal digits as a number in [0, 65535], or nullopt: empty, not only digits, or out
// of range. gRPC's resolver would take a larger port modulo 65536 and use another one.
inline std::optional<uint32_t> ParsePort(absl::string_view digits) {
  uint32_t value = 0;
  if (digits.empty() || digits.size() > 5 ||
      digits.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(digits, &value) || value > 65535) {
    return std::nullopt;
  }
  return value;
}

}  // namespace hstu
