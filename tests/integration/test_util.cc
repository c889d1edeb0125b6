#include "tests/integration/test_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace hstu::testing {

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
  close(fd);
  return -1;
}

std::string RawHttp(int port, const std::string& bytes) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  std::string reply;
  if (send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size())) {
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[4096];
    ssize_t n;
    while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) reply.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return reply;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("connect to 127.0.0.1:", port, " failed"));
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const std::string req =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::UnavailableError("write failed");
  }
  std::string resp;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t header_end = resp.find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::DataLossError("no HTTP header");
  const std::string status_line = resp.substr(0, resp.find("\r\n"));
  if (status_line.find(" 200 ") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("HTTP status: ", status_line));
  }
  return resp.substr(header_end + 4);
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

Subprocess::Subprocess(const std::vector<std::string>& argv, const std::string& log_path)
    : log_path_(log_path) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_ = fork();
  if (pid_ == 0) {
    const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    // The test binary may block signals in threads; the child starts with a clean mask, and with
    // SIGPIPE's default action (an ignored signal stays ignored across exec).
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    execv(args[0], args.data());
    _exit(127);
  }
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && exit_code_ < 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0 && exit_code_ < 0) kill(pid_, sig);
}

int Subprocess::Wait(std::chrono::milliseconds timeout) {
  if (exit_code_ >= 0) return exit_code_;
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (std::chrono::steady_clock::now() >= end) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string Subprocess::Log() const {
  std::ifstream f(log_path_);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::pair<int, std::string> RunCommand(const std::string& command) {
  std::string out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

namespace {

// The directories TempDir made, removed when the test process exits (each CTest test is its own
// process), unless HSTU_KEEP_TEST_DIRS=1 keeps them for a look at a failure's files.
struct TempDirRegistry {
  std::mutex mu;
  std::vector<std::string> dirs;
  ~TempDirRegistry() {
    const char* keep = std::getenv("HSTU_KEEP_TEST_DIRS");
    if (keep != nullptr && std::string(keep) == "1") return;
    for (const std::string& d : dirs) {
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    }
  }
};

TempDirRegistry& TempDirs() {
  static TempDirRegistry registry;
  return registry;
}

}  // namespace

std::string TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat(base ? base : "/tmp", "/hstu_it_XXXXXX");
  char* d = mkdtemp(tmpl.data());
  if (d == nullptr) return std::string("/tmp");
  TempDirRegistry& registry = TempDirs();
  std::lock_guard<std::mutex> lock(registry.mu);
  registry.dirs.emplace_back(d);
  return registry.dirs.back();
}

namespace {

// Parses `{a="x",b="y"}` starting at s[0] == '{'; returns the index after '}'.
absl::StatusOr<size_t> ParseLabels(const std::string& s, std::map<std::string, std::string>* out) {
  size_t i = 1;
  while (i < s.size() && s[i] != '}') {
    const size_t eq = s.find('=', i);
    if (eq == std::string::npos || eq + 1 >= s.size() || s[eq + 1] != '"') {
      return absl::InvalidArgumentError("bad label");
    }
    const std::string name = s.substr(i, eq - i);
    std::string value;
    size_t j = eq + 2;
    for (; j < s.size() && s[j] != '"'; ++j) {
      if (s[j] == '\\' && j + 1 < s.size()) {
        ++j;
        value += s[j] == 'n' ? '\n' : s[j];
      } else {
        value += s[j];
      }
    }
    if (j >= s.size()) return absl::InvalidArgumentError("unterminated label value");
    (*out)[name] = value;
    i = j + 1;
    if (i < s.size() && s[i] == ',') ++i;
  }
  if (i >= s.size()) return absl::InvalidArgumentError("unterminated label set");
  return i + 1;
}

}  // namespace

absl::StatusOr<Exposition> ParseExposition(const std::string& text) {
  Exposition e;
  int line_no = 0;
  for (absl::string_view line_view : absl::StrSplit(text, '\n')) {
    ++line_no;
    const std::string line(line_view);
    if (line.empty()) continue;
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": ", why, ": ", line));
    };
    if (line[0] == '#') {
      std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (parts.size() < 4) return bad("short comment");
      if (parts[1] == "TYPE") {
        e.types[parts[2]] = parts[3];
      } else if (parts[1] == "HELP") {
        e.helps[parts[2]] = parts[3];
      }
      continue;
    }
    Sample s;
    size_t i = line.find_first_of("{ ");
    if (i == std::string::npos) return bad("no value");
    s.name = line.substr(0, i);
    if (line[i] == '{') {
      auto end = ParseLabels(line.substr(i), &s.labels);
      if (!end.ok()) return bad(std::string(end.status().message()));
      i += *end;
    }
    const std::string value(absl::StripAsciiWhitespace(line.substr(i)));
    if (value == "+Inf") {
      s.value = INFINITY;
    } else if (!absl::SimpleAtod(value, &s.value)) {
      return bad("bad value");
    }
    std::string family = s.name;
    if (!e.types.contains(family)) {
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        if (absl::EndsWith(family, suffix)) {
          const std::string base = family.substr(0, family.size() - std::strlen(suffix));
          if (e.types.contains(base) && e.types[base] == "histogram") family = base;
        }
      }
    }
    if (!e.types.contains(family)) return bad("sample without # TYPE");
    e.samples.push_back(std::move(s));
  }
  return e;
}

double Exposition::Sum(const std::string& name,
                       const std::map<std::string, std::string>& match) const {
  double total = 0;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool ok = true;
    for (const auto& [k, v] : match) {
      auto it = s.labels.find(k);
      if (it == s.labels.end() || it->second != v) ok = false;
    }
    if (ok) total += s.value;
  }
  return total;
}

bool Exposition::Has(const std::string& name) const {
  for (const Sample& s : samples) {
    if (s.name == name) return true;
  }
  return false;
}

}  // namespace hstu::testing
