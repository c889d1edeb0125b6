// Small helpers shared by the command-line programs.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"

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

// absl::ParseCommandLine, except that a help asked for (--help, --helpfull, --helpon=...) exits
// with status 0, as a help does elsewhere: this abseil (Debian 12's 20220623) exits 1 after it,
// which made `hstu_server --help` look like a failure to scripts. absl's own parse, with the
// usage flags handled here instead of inside it (its internal entry points of that version).
// --version prints "PROGRAM VERSION" (absl's default printed "Debug build (NDEBUG not #defined)",
// of its own build).
inline std::vector<char*> ParseFlags(std::vector<char*>& argv) {
  absl::FlagsUsageConfig usage = absl::flags_internal::GetUsageConfig();  // the program's, if set
  usage.version_string = [] {
    return absl::flags_internal::ShortProgramInvocationName() + " " + HSTU_VERSION + "\n";
  };
  absl::SetFlagsUsageConfig(usage);
  std::vector<char*> rest = absl::flags_internal::ParseCommandLineImpl(
      static_cast<int>(argv.size()) - 1, argv.data(),
      absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  // -1: no usage flag; 0: --version or --only_check_args; 1: a help printed.
  if (absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) >= 0) {
    std::cout.flush();
    std::exit(0);
  }
  return rest;
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
