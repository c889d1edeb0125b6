#include "engine/atomic_file.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/status/statusor.h"
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
  const absl::StatusOr<int> fd = OpenWithoutWaiting(path, O_WRONLY | O_TRUNC);
  if (!fd.ok()) return CannotWrite(path, std::string(fd.status().message()));
  int err = WriteAll(*fd, bytes);
  if (::close(*fd) != 0 && err == 0) err = errno;
  return err == 0 ? absl::OkStatus() : WriteFailed(path, err, "");
}

// Where the bytes written to a path go (engine/atomic_file.h lists the cases).
struct Destination {
  enum class Kind { kDescriptor, kThrough, kReplace, kCreate };
  Kind kind = Kind::kCreate;
  int fd = -1;         // kDescriptor
  std::string file;    // kReplace: the regular file itself, links resolved; kCreate: the path
  mode_t mode = 0644;  // kReplace: its permission bits
  uid_t uid = 0;       // kReplace: its owner and group
  gid_t gid = 0;
};

// What `path` names, or why nothing can be written there (the reason alone, without the path).
absl::StatusOr<Destination> Resolve(const std::string& path) {
  Destination d;
  if (const std::optional<int> fd = OwnDescriptor(path); fd.has_value()) {
    d.kind = Destination::Kind::kDescriptor;
    d.fd = *fd;
    return d;
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::InvalidArgumentError("is a directory");
    if (S_ISSOCK(st.st_mode)) return absl::InvalidArgumentError("is a socket");
    if (!S_ISREG(st.st_mode)) {
      d.kind = Destination::Kind::kThrough;
      return d;
    }
    // A regular file, maybe behind symbolic links: the file itself is replaced.
    char* real = ::realpath(path.c_str(), nullptr);
    if (real == nullptr) return absl::InvalidArgumentError(std::strerror(errno));
    d.kind = Destination::Kind::kReplace;
    d.file = real;
    ::free(real);
    d.mode = st.st_mode & 0777;  // not set-user-ID and the like, on a file the writer now owns
    d.uid = st.st_uid;
    d.gid = st.st_gid;
    return d;
  }
  if (errno != ENOENT) return absl::InvalidArgumentError(std::strerror(errno));
  if (::lstat(path.c_str(), &st) == 0) {
    return absl::InvalidArgumentError("is a symbolic link to a missing file");
  }
  d.kind = Destination::Kind::kCreate;
  d.file = path;
  return d;
}

}  // namespace

absl::StatusOr<int> OpenWithoutWaiting(const std::string& path, int flags, int mode) {
  const int fd = ::open(path.c_str(), flags | O_NONBLOCK | O_CLOEXEC, static_cast<mode_t>(mode));
  if (fd < 0) {
    if (errno == ENXIO) {
      return absl::UnavailableError("no process reads it (a FIFO without a reader)");
    }
    return absl::InvalidArgumentError(std::strerror(errno));
  }
  const int now = ::fcntl(fd, F_GETFL);
  if (now < 0 || ::fcntl(fd, F_SETFL, now & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InvalidArgumentError(std::strerror(err));
  }
  return fd;
}

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
  const absl::StatusOr<Destination> d = Resolve(path);
  return d.ok() &&
         (d->kind == Destination::Kind::kReplace || d->kind == Destination::Kind::kCreate);
}

absl::Status CheckWritable(const std::string& path, WriteMode mode) {
  if (path.empty()) return absl::InvalidArgumentError("is empty");
  absl::StatusOr<Destination> d = Resolve(path);
  if (!d.ok()) return d.status();
  switch (d->kind) {
    case Destination::Kind::kDescriptor: {
      const int flags = ::fcntl(d->fd, F_GETFL);
      if (flags < 0) return absl::InvalidArgumentError("the descriptor is not open");
      if ((flags & O_ACCMODE) == O_RDONLY) {
        return absl::InvalidArgumentError("the descriptor is open for reading only");
      }
      return absl::OkStatus();
    }
    case Destination::Kind::kThrough:
      if (::access(path.c_str(), W_OK) != 0) return absl::InvalidArgumentError("is not writable");
      return absl::OkStatus();
    case Destination::Kind::kReplace:
      // Opened where it is: the file's own permission decides, not its directory's.
      if (mode == WriteMode::kInPlace) {
        if (::access(d->file.c_str(), W_OK) != 0) {
          return absl::InvalidArgumentError("is not writable");
        }
        return absl::OkStatus();
      }
      break;
    case Destination::Kind::kCreate:
      break;
  }
  // The file is created (or its replacement is) in its directory.
  const size_t slash = d->file.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : d->file.substr(0, std::max<size_t>(slash, 1));
  struct stat dir_st {};
  if (::stat(dir.c_str(), &dir_st) != 0) {
    return absl::InvalidArgumentError(
        errno == ENOENT || errno == ENOTDIR
            ? absl::StrCat("directory ", dir, " is missing")
            : absl::StrCat("directory ", dir, ": ", std::strerror(errno)));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("directory ", dir, " is not writable"));
  }
  // In a sticky directory (/tmp) only a file's owner, or the directory's, may rename over it
  // (root stands in for the capability that lifts this, CAP_FOWNER).
  const uid_t me = ::geteuid();
  if (d->kind == Destination::Kind::kReplace && me != 0 && (dir_st.st_mode & S_ISVTX) != 0 &&
      dir_st.st_uid != me && d->uid != me) {
    return absl::InvalidArgumentError(
        absl::StrCat("is another user's file in the sticky directory ", dir,
                     ", which only its owner may replace"));
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  absl::StatusOr<Destination> d = Resolve(path);
  if (!d.ok()) {
    return CannotWrite(path, std::string(d.status().message()));
  }
  switch (d->kind) {
    case Destination::Kind::kDescriptor: {
      if (::fcntl(d->fd, F_GETFD) < 0) return CannotWrite(path, "the descriptor is not open");
      const int err = WriteAll(d->fd, bytes);
      return err == 0 ? absl::OkStatus() : WriteFailed(path, err, "");
    }
    case Destination::Kind::kThrough:
      return WriteThrough(path, bytes);
    case Destination::Kind::kReplace:
    case Destination::Kind::kCreate:
      break;
  }
  const bool replacing = d->kind == Destination::Kind::kReplace;  // keeps its mode and owner
  // Created anew, never opened through a link someone left at the name.
  const std::string tmp = absl::StrCat(d->file, ".tmp.", getpid());
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    return CannotWrite(path, absl::StrCat("cannot create '", tmp, "': ", std::strerror(errno)));
  }
  int err = WriteAll(fd, bytes);
  // The owner and group too, where the writer may give them (root; or a group it is in): before,
  // root rewriting a service user's 0640 report left it root's, unreadable to that user. Where it
  // may not, the file is the writer's, as a rename over it has always made it.
  if (err == 0 && replacing && (d->uid != ::geteuid() || d->gid != ::getegid())) {
    const bool kept =
        ::fchown(fd, d->uid, d->gid) == 0 || ::fchown(fd, static_cast<uid_t>(-1), d->gid) == 0;
    (void)kept;
  }
  if (err == 0 && replacing && ::fchmod(fd, d->mode) != 0) err = errno;
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), d->file.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    return WriteFailed(path, err, "; nothing written");
  }
  return absl::OkStatus();
}

}  // namespace hstu
