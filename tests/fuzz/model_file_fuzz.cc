// Fuzz target: a model file's bytes. ParseModelFile must return a model or an error, never crash,
// hang or read out of bounds (run under ASan + UBSan); a model it accepts must be self-consistent:
// written back and read again, it gives the same configuration and tensors.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/model_file.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "model_file_fuzz: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto weights = hstu::ParseModelFile(bytes, "fuzz.safetensors");
  if (!weights.ok()) {
    if (weights.status().message().empty()) Fail("an error without a message");
    return 0;
  }
  // The tables hold what the configuration says they hold: the engine indexes them by it.
  const hstu::ModelConfig& c = weights->config;
  if (weights->item_embedding.size() != static_cast<size_t>(c.item_rows) * c.hidden_dim ||
      weights->action_embedding.size() != static_cast<size_t>(c.action_rows) * c.hidden_dim ||
      weights->position_embedding.size() != static_cast<size_t>(c.position_rows) * c.hidden_dim ||
      weights->layers.size() != static_cast<size_t>(c.num_layers)) {
    Fail("an accepted model's tables do not match its configuration");
  }
  const std::string again = hstu::SerializeModelFile(*weights);
  auto reread = hstu::ParseModelFile(again, "rewritten.safetensors");
  if (!reread.ok()) Fail("an accepted model, written back, does not read again");
  if (hstu::SerializeModelFile(*reread) != again) Fail("an accepted model does not round-trip");
  return 0;
}
