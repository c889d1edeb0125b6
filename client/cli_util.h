// Small helpers shared by the command-line programs.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace hstu {

// absl flag names use underscores; accept the dashed spelling too (`--page-size` == `--page_size`,
// `--no-cache` == `--no_cache`). Returns storage whose c_str()s back `argv_out`.
inline std::vector<std::string> NormalizeFlagDashes(int argc, char** argv) {
  std::vector<std::string> args;
  bool flags_ended = false;  // everything after a bare "--" is positional and kept as is
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") flags_ended = true;
    if (!flags_ended && a.size() > 2 && a[0] == '-' && a[1] == '-') {
      const size_t end = a.find('=') == std::string::npos ? a.size() : a.find('=');
      for (size_t j = 2; j < end; ++j) {
        if (a[j] == '-') a[j] = '_';
      }
    }
    args.push_back(std::move(a));
  }
  return args;
}

inline std::vector<char*> ArgvOf(std::vector<std::string>& args) {
  std::vector<char*> out;
  for (auto& a : args) out.push_back(a.data());
  out.push_back(nullptr);
  return out;
}

// What absl::ParseCommandLine left besides the program name: for programs that take flags only,
// a word there is a mistake (a second file, or a bool flag's value given apart from it:
// `--warmup false` is --warmup, then "false"). Prints why and returns false when there is one.
inline bool OnlyFlagsGiven(const std::vector<char*>& rest) {
  if (rest.size() <= 1) return true;
  std::fprintf(stderr, "error: unexpected argument '%s' (flags only; a bool flag takes its value "
               "as --flag=false; see --help)\n", rest[1]);
  return false;
}

}  // namespace hstu
