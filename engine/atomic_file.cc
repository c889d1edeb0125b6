#include "engine/atomic_file.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace hstu {
namespace {

// Writes all of `bytes` to `fd`: 0, or the errno of the failure.
int WriteAll(int fd, std::string_view bytes) {
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

absl::Status WriteFailed(const std::string& path, int err, const char* what) {
  return absl::InternalError(
      absl::StrCat("write to '", path, "' failed: ", std::strerror(err), what));
}

absl::Status CannotWrite(const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("cannot write '", path, "': ", why));
}

// `path` is a device or a FIFO: its bytes go to it. A FIFO without a reader would block the
// open until one comes (forever, for a reader that read the first report and left).
absl::Status WriteThrough(const std::string& path, std::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_TRUNC | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return CannotWrite(path, errno == ENXIO ? "no process reads it (a FIFO without a reader, or a "
                                              "socket)"
                                            : std::strerror(errno));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  int err = flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 ? errno : 0;
  if (err == 0) err = WriteAll(fd, bytes);
  if (::close(fd) != 0 && err == 0) err = errno;
  return err == 0 ? absl::OkStatus() : WriteFailed(path, err, "");
}

}  // namespace

// Resolved as links, these can name a regular file, the one the shell redirected to, which a
// rename would replace: the shell's other output in it lost, and the rest of this process's
// output written to an unlinked file.
std::optional<int> OwnDescriptor(const std::string& path) {
  if (path == "/dev/stdout") return 1;
  if (path == "/dev/stderr") return 2;
  for (const std::string prefix : {"/dev/fd/", "/proc/self/fd/"}) {
    int fd = -1;
    if (path.rfind(prefix, 0) == 0 && absl::SimpleAtoi(path.substr(prefix.size()), &fd) &&
        fd >= 0) {
      return fd;
    }
  }
  return std::nullopt;
}

bool IsReplaceableFile(const std::string& path) {
  if (OwnDescriptor(path).has_value()) return false;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return S_ISREG(st.st_mode);
  return errno == ENOENT && ::lstat(path.c_str(), &st) != 0;  // nothing, not a link to nothing
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  if (const std::optional<int> fd = OwnDescriptor(path); fd.has_value()) {
    if (::fcntl(*fd, F_GETFD) < 0) return CannotWrite(path, "the descriptor is not open");
    const int err = WriteAll(*fd, bytes);
    return err == 0 ? absl::OkStatus() : WriteFailed(path, err, "");
  }
  std::string target = path;
  mode_t mode = 0644;
  bool keep_mode = false;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return CannotWrite(path, "a directory");
    if (S_ISSOCK(st.st_mode)) return CannotWrite(path, "a socket");
    if (!S_ISREG(st.st_mode)) return WriteThrough(path, bytes);
    // A regular file, maybe behind symbolic links: the file itself is replaced.
    char* real = ::realpath(path.c_str(), nullptr);
    if (real == nullptr) return CannotWrite(path, std::strerror(errno));
    target = real;
    ::free(real);
    mode = st.st_mode & 0777;  // not set-user-ID and the like, on a file the writer now owns
    keep_mode = true;
  } else if (errno == ENOENT) {
    if (::lstat(path.c_str(), &st) == 0)
      return CannotWrite(path, "a symbolic link to a missing file");
  } else {
    return CannotWrite(path, std::strerror(errno));
  }
  // Created anew, never opened through a link someone left at the name.
  const std::string tmp = absl::StrCat(target, ".tmp.", getpid());
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    return CannotWrite(path, absl::StrCat("cannot create '", tmp, "': ", std::strerror(errno)));
  }
  int err = WriteAll(fd, bytes);
  if (err == 0 && keep_mode && ::fchmod(fd, mode) != 0) err = errno;
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), target.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    return WriteFailed(path, err, "; nothing written");
  }
  return absl::OkStatus();
}

}  // namespace hstu
