// A file written whole or not at all, for outputs a reader may see at any moment (model files,
// benchmark and load-generator reports).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hstu {

// Writes `bytes` to a temporary file beside `path` (fsync'd), then renames it over `path`: a failed
// write (a full disk) or a process killed mid-write leaves what was at `path`, if anything, as it
// was, and no partial file.
//
// What `path` names decides where the bytes go (before, whatever was there was replaced by a
// regular file, /dev/null included):
// - nothing: a new file (mode 0644 less the umask);
// - a regular file, directly or through symbolic links: replaced where it is, with its permission
//   bits and, where the writer may give them (root, or a group it is in), its owner and group, so
//   the links stay links and its users keep reading it;
// - one of the process's open descriptors (/dev/stdout, /dev/stderr, /dev/fd/N,
//   /proc/self/fd/N): written to that descriptor, at its offset (a shell's `>>` appends);
// - a device or a FIFO: written through, as `>` would (not atomic: there is no file to
//   replace); a FIFO without a reader is an error, not a wait;
// - a directory, a socket or a symbolic link to nothing: an error naming it.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

// The descriptor `path` names when it is /dev/stdout, /dev/stderr, /dev/fd/N or /proc/self/fd/N
// (as links these can lead to the file a shell redirected to, which must be written at the
// descriptor's offset, not replaced or truncated), else nullopt.
std::optional<int> OwnDescriptor(const std::string& path);

// How an output is written: replaced whole (WriteFileAtomically: a new file renamed over the
// old one), or opened where it is and written as it goes (a recording: O_TRUNC, no rename).
enum class WriteMode { kReplace, kInPlace };

// Whether an output can be written at `path` in `mode`, checked without writing anything, so that
// a tool refuses a mistyped output path before a run of minutes, not after it. The error says what
// is wrong: "is empty", "is a directory", "is a socket", "is a symbolic link to a missing file",
// "directory D is missing", "directory D is not writable" (a file to create, or to replace),
// "is another user's file in the sticky directory D" (to replace), "is not writable" (a file
// written in place, a device or a FIFO), "the descriptor is not open", "the descriptor is open for
// reading only", or the system's own error. A FIFO's reader is not checked (opening the FIFO to
// see would end the reader's input).
absl::Status CheckWritable(const std::string& path, WriteMode mode = WriteMode::kReplace);

// Opens `path` for writing with `flags` (O_WRONLY and the like; O_CLOEXEC is added) without
// waiting for a FIFO's reader: no reader is UNAVAILABLE ("no process reads it (a FIFO without a
// reader)"), other failures INVALID_ARGUMENT with the system's error. The descriptor returned
// blocks as usual.
absl::StatusOr<int> OpenWithoutWaiting(const std::string& path, int flags, int mode = 0666);

// Whether `path` is a regular file or nothing yet: what WriteFileAtomically replaces whole, so
// that writing it again is safe (a FIFO's reader may be gone after the first write).
bool IsReplaceableFile(const std::string& path);

}  // namespace hstu
