// safetensors model files (DESIGN §3): read (F32 or BF16), write (F32 or BF16), random presets.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "engine/atomic_file.h"  // WriteFileAtomically, which WriteModelFile uses
#include "engine/model.h"

namespace hstu {

enum class FileDType { kF32, kBF16 };

// Reads and checks a model file. Errors name the tensor or metadata key and what is wrong.
absl::StatusOr<ModelWeights> ReadModelFile(const std::string& path);
// Same, from the file's bytes (used by tests for malformed inputs).
absl::StatusOr<ModelWeights> ParseModelFile(const std::string& bytes, const std::string& name);

absl::Status WriteModelFile(const ModelWeights& weights, const std::string& path,
                            FileDType dtype = FileDType::kF32);
std::string SerializeModelFile(const ModelWeights& weights, FileDType dtype = FileDType::kF32);

// Preset hyper-parameters: "tiny" (CPU tests) or "base" (DESIGN §2 reference configuration).
absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset);

// Deterministic random weights for `config`, scaled so activations stay O(1) through all layers.
ModelWeights RandomModel(const ModelConfig& config, uint64_t seed);

// "random:PRESET" (seeded by `seed`) or a file path.
absl::StatusOr<ModelWeights> LoadModel(const std::string& spec, uint64_t seed = 1);

}  // namespace hstu
