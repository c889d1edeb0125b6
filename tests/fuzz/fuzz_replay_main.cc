// Runs a fuzz target (LLVMFuzzerTestOneInput, linked in) over files and folders of inputs: the
// checked-in corpus as a regression test under any compiler, without libFuzzer. Exit 1 when a path
// cannot be read or holds no input, or the target's HstuFuzzReplayCheck fails; a failing input
// aborts, naming itself first.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
// Optional, defined by a target whose corpus must keep reaching given paths: nonzero fails.
extern "C" __attribute__((weak)) int HstuFuzzReplayCheck();

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    std::error_code ec;
    if (fs::is_directory(argv[i], ec)) {
      for (const auto& e : fs::directory_iterator(argv[i])) {
        if (e.is_regular_file()) inputs.push_back(e.path());
      }
    } else if (fs::is_regular_file(argv[i], ec)) {
      inputs.push_back(argv[i]);
    } else {
      std::fprintf(stderr, "fuzz replay: cannot read %s\n", argv[i]);
      return 1;
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "fuzz replay: no inputs (usage: %s FILE_OR_DIR...)\n", argv[0]);
    return 1;
  }
  std::sort(inputs.begin(), inputs.end());
  for (const fs::path& p : inputs) {
    std::fprintf(stderr, "fuzz replay: %s\n", p.c_str());
    std::ifstream f(p, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("fuzz replay: %zu inputs passed\n", inputs.size());
  if (HstuFuzzReplayCheck != nullptr && HstuFuzzReplayCheck() != 0) return 1;
  return 0;
}
