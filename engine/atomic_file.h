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
//
// What `path` names decides where the bytes go (before, whatever was there was replaced by a
// regular file, /dev/null included):
// - nothing: a new file (mode 0644 less the umask);
// - a regular file, directly or through symbolic links: replaced where it is, with its mode, so
//   the links stay links;
// - a device, a FIFO, a socket or a terminal (`/dev/stdout` into a pipe): written through, as
//   `>` would (not atomic: there is no file to replace);
// - a directory, or a symbolic link to nothing: an error naming it.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

}  // namespace hstu
