// A file written whole or not at all, for outputs a reader may see at any moment (model files,
// benchmark and load-generator reports).
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace hstu {

// Writes `bytes` to a temporary file beside `path` (fsync'd), then renames it over `path`: a failed
// write (a full disk) or a process killed mid-write leaves what was at `path`, if anything, as it
// was, and no partial file.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

}  // namespace hstu
