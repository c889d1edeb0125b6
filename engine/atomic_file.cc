#include "engine/atomic_file.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

// `path` is not a file that can be replaced (a device, a FIFO, a socket): its bytes go to it.
absl::Status WriteThrough(const std::string& path, std::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write '", path, "': ", std::strerror(errno)));
  }
  int err = WriteAll(fd, bytes);
  if (::close(fd) != 0 && err == 0) err = errno;
  return err == 0 ? absl::OkStatus() : WriteFailed(path, err, "");
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  std::string target = path;
  mode_t mode = 0644;
  bool keep_mode = false;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat("cannot write '", path, "': a directory"));
    }
    if (!S_ISREG(st.st_mode)) return WriteThrough(path, bytes);
    // A regular file, maybe behind symbolic links: the file itself is replaced.
    char* real = ::realpath(path.c_str(), nullptr);
    if (real == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write '", path, "': ", std::strerror(errno)));
    }
    target = real;
    ::free(real);
    mode = st.st_mode & 07777;
    keep_mode = true;
  } else if (errno == ENOENT) {
    if (::lstat(path.c_str(), &st) == 0) {  // a link to nothing: where it points is not said
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write '", path, "': a symbolic link to a missing file"));
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write '", path, "': ", std::strerror(errno)));
  }
  const std::string tmp = absl::StrCat(target, ".tmp.", getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write '", path, "': cannot create '",
                                                   tmp, "': ", std::strerror(errno)));
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
