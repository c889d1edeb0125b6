// Command-line flags of hstu_server (absl flags; `hstu_server --help` lists them) and their
// conversion into ServerOptions.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/ranking_server.h"

namespace hstu::server {

// Reads the parsed flags; INVALID_ARGUMENT naming the flag when a value is out of range.
absl::StatusOr<ServerOptions> OptionsFromFlags();
std::string LogLevelFlag();
std::string LogFormatFlag();
int32_t ShutdownGraceSeconds();

}  // namespace hstu::server
