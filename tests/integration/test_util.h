// Helpers of the integration tests: loopback HTTP GET, free ports, child processes, a parser of
// the Prometheus text format. Everything binds to 127.0.0.1 only.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hstu::testing {

// A TCP connection to 127.0.0.1:`port`: its descriptor, or -1 when the connect failed.
int ConnectLoopback(int port);
// GET http://127.0.0.1:port/path; the body of a 200 answer, an error otherwise.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);
// Sends `bytes` on a fresh connection to 127.0.0.1:`port` and returns all it reads back until the
// server closes it (5 s at most); empty when it cannot connect.
std::string RawHttp(int port, const std::string& bytes);
// A port that was free a moment ago (bind to 0, read it back, close).
int FreePort();

// A child process with stdout and stderr in `log_path`. The destructor kills it (SIGKILL) if it
// still runs.
class Subprocess {
 public:
  Subprocess(const std::vector<std::string>& argv, const std::string& log_path);
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  bool started() const { return pid_ > 0; }
  void Signal(int sig);
  // Exit code (128 + signal when killed by one), or -1 when it did not exit within `timeout`.
  int Wait(std::chrono::milliseconds timeout);
  std::string Log() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  int exit_code_ = -1;
};

// Runs a shell command to completion; returns (exit code, stdout+stderr).
std::pair<int, std::string> RunCommand(const std::string& command);
// A fresh directory under $TMPDIR (or /tmp), removed with its files when the test process exits
// (HSTU_KEEP_TEST_DIRS=1 keeps it).
std::string TempDir();
// A file's bytes; "" when it cannot be read.
std::string ReadFile(const std::string& path);

struct Sample {
  std::string name;                           // with _bucket/_sum/_count suffixes
  std::map<std::string, std::string> labels;  // unescaped values
  double value = 0;
};
struct Exposition {
  std::map<std::string, std::string> types;  // family → counter|gauge|histogram
  std::map<std::string, std::string> helps;
  std::vector<Sample> samples;
  // Sum of the samples named `name` whose labels include `match`.
  double Sum(const std::string& name, const std::map<std::string, std::string>& match = {}) const;
  bool Has(const std::string& name) const;
};
// Strict parse of text format 0.0.4: every sample belongs to a declared family, every line parses.
absl::StatusOr<Exposition> ParseExposition(const std::string& text);

}  // namespace hstu::testing
