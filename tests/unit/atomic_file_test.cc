// WriteFileAtomically (engine/atomic_file.h): a file is replaced whole where it is, through its
// links and with its mode; a FIFO or device is written through, an open descriptor written to; a
// directory, a FIFO without a reader or a link to nothing is an error. Before, whatever the path
// named was replaced by a regular file: a symbolic link lost its target, a FIFO its reader, and,
// run as root, /dev/null became a file.

#include "engine/atomic_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace hstu {
namespace {

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/atomic_file_" + std::to_string(getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  // The names in the test's directory, sorted (no temporary left behind).
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      names.push_back(e.path().filename());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string dir_;
};

TEST_F(AtomicFileTest, NewAndExistingFilesAreReplacedWithTheirMode) {
  const std::string path = dir_ + "/a.json";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  EXPECT_EQ(Read(path), "first");
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  ASSERT_TRUE(WriteFileAtomically(path, "second").ok());
  EXPECT_EQ(Read(path), "second");
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(Names(), std::vector<std::string>{"a.json"});
}

TEST_F(AtomicFileTest, ALinkStaysALinkAndItsTargetIsReplaced) {
  std::filesystem::create_directories(dir_ + "/data");
  const std::string target = dir_ + "/data/model.safetensors";
  ASSERT_TRUE(WriteFileAtomically(target, "old").ok());
  const std::string link = dir_ + "/current";
  std::filesystem::create_symlink("data/model.safetensors", link);
  ASSERT_TRUE(WriteFileAtomically(link, "new").ok());
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(Read(target), "new");
  EXPECT_EQ(Names(), (std::vector<std::string>{"current", "data"}));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_ + "/data"),
                          std::filesystem::directory_iterator()),
            1);
}

TEST_F(AtomicFileTest, AFifoIsWrittenThroughToItsReaderAndOneWithoutIsAnError) {
  const std::string fifo = dir_ + "/pipe";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  // No reader: an error at once (before the change the open would have waited for one).
  const absl::Status alone = WriteFileAtomically(fifo, "x");
  EXPECT_EQ(alone.code(), absl::StatusCode::kInvalidArgument) << alone;
  EXPECT_NE(alone.message().find("no process reads it"), std::string::npos) << alone;
  // A reader (opened without waiting for a writer) gets the bytes; the FIFO stays a FIFO.
  const int reader = open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  const absl::Status s = WriteFileAtomically(fifo, "through the pipe");
  char buf[64] = {};
  const ssize_t n = read(reader, buf, sizeof(buf));
  close(reader);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(std::string(buf, n > 0 ? n : 0), "through the pipe");
  struct stat st {};
  ASSERT_EQ(lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_EQ(Names(), std::vector<std::string>{"pipe"});
}

// /dev/fd/N (and /dev/stdout, /proc/self/fd/N) resolve to the file a shell redirected to: written
// to the descriptor, at its offset (before: the file was replaced, `>>`'s earlier lines lost).
TEST_F(AtomicFileTest, AnOpenDescriptorIsWrittenToWhereItStands) {
  const std::string log = dir_ + "/runs.log";
  { std::ofstream(log) << "earlier run\n"; }
  const int fd = open(log.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  const absl::Status s = WriteFileAtomically("/dev/fd/" + std::to_string(fd), "this run\n");
  close(fd);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Read(log), "earlier run\nthis run\n");
  EXPECT_EQ(Names(), std::vector<std::string>{"runs.log"});
  const absl::Status closed = WriteFileAtomically("/dev/fd/1000000", "x");
  EXPECT_NE(closed.message().find("the descriptor is not open"), std::string::npos) << closed;
  EXPECT_FALSE(IsReplaceableFile("/dev/stdout"));
  EXPECT_TRUE(IsReplaceableFile(log));
  EXPECT_TRUE(IsReplaceableFile(dir_ + "/new.json"));
}

TEST_F(AtomicFileTest, ADirectoryOrALinkToNothingIsAnErrorAndLeftAsItWas) {
  const absl::Status dir = WriteFileAtomically(dir_, "x");
  EXPECT_EQ(dir.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dir.message(), "cannot write '" + dir_ + "': is a directory");
  const std::string dangling = dir_ + "/dangling";
  std::filesystem::create_symlink("missing/file", dangling);
  const absl::Status link = WriteFileAtomically(dangling, "x");
  EXPECT_EQ(link.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(link.message(),
            "cannot write '" + dangling + "': is a symbolic link to a missing file");
  EXPECT_TRUE(std::filesystem::is_symlink(dangling));
  EXPECT_EQ(Names(), std::vector<std::string>{"dangling"});
}

// A file replaced by root keeps its owner and group (before: root's, and a 0640 report became
// unreadable to the user it belonged to).
TEST_F(AtomicFileTest, AFileReplacedByRootKeepsItsOwner) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root, to give a file to another user";
  const std::string path = dir_ + "/theirs.json";
  { std::ofstream(path) << "old"; }
  // A user namespace without uid 65534 mapped (a rootless container) cannot give it away.
  if (chown(path.c_str(), 65534, 65534) != 0) GTEST_SKIP() << "cannot give a file to user 65534";
  ASSERT_EQ(chmod(path.c_str(), 0640), 0);
  ASSERT_TRUE(WriteFileAtomically(path, "new").ok());
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 65534u);
  EXPECT_EQ(st.st_gid, 65534u);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  EXPECT_EQ(Read(path), "new");
}

// CheckWritable says beforehand what WriteFileAtomically would refuse, and writes nothing.
TEST_F(AtomicFileTest, CheckWritableRefusesWhatAWriteWouldAndWritesNothing) {
  const std::string file = dir_ + "/r.json";
  { std::ofstream(file) << "kept"; }
  std::filesystem::create_symlink("r.json", dir_ + "/link");
  ASSERT_EQ(mkfifo((dir_ + "/pipe").c_str(), 0600), 0);
  // A new file, a file (also through a link), a FIFO (its reader is not checked), a device.
  for (const std::string& ok :
       {dir_ + "/new.json", file, dir_ + "/link", dir_ + "/pipe", std::string("/dev/null")}) {
    EXPECT_TRUE(CheckWritable(ok).ok()) << ok << ": " << CheckWritable(ok);
  }
  EXPECT_EQ(Read(file), "kept");
  std::filesystem::create_symlink("missing/file", dir_ + "/dangling");
  const std::pair<std::string, std::string> refused[] = {
      {dir_, "is a directory"},
      {dir_ + "/dangling", "is a symbolic link to a missing file"},
      {dir_ + "/no/such/dir/r.json", "directory " + dir_ + "/no/such/dir is missing"},
      {"/dev/fd/1000000", "the descriptor is not open"}};
  for (const auto& [path, why] : refused) {
    const absl::Status s = CheckWritable(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_EQ(s.message(), why) << path;
    EXPECT_FALSE(WriteFileAtomically(path, "x").ok()) << path;  // the write refuses it too
  }
  // Written in place (a recording), a file's own permission decides, not its directory's: a
  // read-only file is refused, and an empty path.
  ASSERT_EQ(chmod(file.c_str(), 0444), 0);
  if (geteuid() != 0) {  // root writes a 0444 file
    EXPECT_EQ(CheckWritable(file, WriteMode::kInPlace).message(), "is not writable");
  }
  EXPECT_TRUE(CheckWritable(file).ok());  // replaced whole: the directory decides
  ASSERT_EQ(chmod(file.c_str(), 0644), 0);
  EXPECT_TRUE(CheckWritable(file, WriteMode::kInPlace).ok());
  EXPECT_EQ(CheckWritable("").message(), "is empty");
  // A descriptor open only for reading.
  const int fd = open(file.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  const absl::Status read_only = CheckWritable("/dev/fd/" + std::to_string(fd));
  close(fd);
  EXPECT_EQ(read_only.message(), "the descriptor is open for reading only");
  EXPECT_EQ(Names(), (std::vector<std::string>{"dangling", "link", "pipe", "r.json"}));
}

// In a sticky directory (/tmp) only a file's owner, or the directory's, may rename over it: the
// check says so beforehand (before, a run passed the check and its write failed after the work).
TEST_F(AtomicFileTest, AnotherUsersFileInAStickyDirectoryIsRefusedBeforehand) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root, to make a file another user owns";
  const std::string sticky = dir_ + "/sticky";
  std::filesystem::create_directory(sticky);
  ASSERT_EQ(chmod(dir_.c_str(), 0755), 0);
  ASSERT_EQ(chmod(sticky.c_str(), 01777), 0);
  const std::string theirs = sticky + "/theirs.json";
  { std::ofstream(theirs) << "root's"; }
  ASSERT_EQ(chmod(theirs.c_str(), 0666), 0);
  // A child process as another user (nobody): the check, then the write it predicts.
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
    const absl::Status check = CheckWritable(theirs);
    if (check.message() != "is another user's file in the sticky directory " +
                               std::filesystem::canonical(sticky).string() +
                               ", which only its owner may replace") {
      _exit(11);
    }
    if (WriteFileAtomically(theirs, "x").ok()) _exit(12);             // the rename is refused
    if (!CheckWritable(theirs, WriteMode::kInPlace).ok()) _exit(15);  // writing in place is not
    if (!CheckWritable(sticky + "/mine.json").ok()) _exit(13);        // a new file is fine
    if (!WriteFileAtomically(sticky + "/mine.json", "x").ok()) _exit(14);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  // A user namespace without uid 65534 mapped (a rootless container) cannot run the child.
  if (WEXITSTATUS(status) == 10) GTEST_SKIP() << "cannot become user 65534 here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "11: check, 12: write, 13/14: a new file, 15: in place";
  EXPECT_EQ(Read(theirs), "root's");
  EXPECT_TRUE(CheckWritable(theirs).ok());  // root may
}

}  // namespace
}  // namespace hstu
