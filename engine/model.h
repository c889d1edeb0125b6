// The model: hyper-parameters (DESIGN §2) and fp32 host weights (DESIGN §3 names).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace hstu {

struct ModelConfig {
  std::string model_name = "hstu";
  int32_t num_layers = 0;
  int32_t hidden_dim = 0;           // d
  int32_t num_heads = 0;            // H
  int32_t head_dim = 0;             // D (q, k, u, v alike)
  int32_t attention_norm_len = 0;   // N of p = SiLU(s) / N
  int32_t max_history_tokens = 0;   // M (2 tokens per event)
  int32_t max_candidates = 0;       // candidates per forward (larger requests are chunked)
  int32_t max_attn_len = 0;         // sliding window W, 0 = none
  bool position_encoding = false;
  int32_t num_tasks = 0;
  int64_t item_rows = 0;
  int64_t action_rows = 0;
  int64_t position_rows = 0;        // 0 without position encoding
  std::vector<int32_t> head_dims;   // MLP sizes, e.g. {1024, 512, 4}: head.j maps [j] -> [j+1]
  int32_t truncation_stride_tokens = 0;  // hstu.truncation_stride: even, in [2, M]; 0 = the default

  int64_t hd() const { return static_cast<int64_t>(num_heads) * head_dim; }
  // History tokens kept in truncation steps of this many (DESIGN §4): the model file's
  // hstu.truncation_stride, by default M/4 rounded down to even (at least 2).
  int32_t truncation_stride() const {
    return truncation_stride_tokens > 0 ? truncation_stride_tokens
                                        : std::max(2, (max_history_tokens / 4) & ~1);
  }
  // Checks internal consistency; the message names the field.
  absl::Status Validate() const;
};

struct LayerWeights {
  std::vector<float> input_norm_w, input_norm_b;    // [d]
  std::vector<float> uvqk_w;                        // [d, 4*H*D]
  std::vector<float> uvqk_b;                        // [4*H*D]
  std::vector<float> output_norm_w, output_norm_b;  // [H*D]
  std::vector<float> output_w;                      // [H*D, d]
};

struct HeadLayerWeights {
  int32_t in = 0, out = 0;
  std::vector<float> w;  // [in, out]
  std::vector<float> b;  // [out]
};

struct ModelWeights {
  ModelConfig config;
  std::vector<float> item_embedding;      // [item_rows, d]
  std::vector<float> action_embedding;    // [action_rows, d]
  std::vector<float> position_embedding;  // [position_rows, d] or empty
  std::vector<LayerWeights> layers;
  std::vector<HeadLayerWeights> head;
};

}  // namespace hstu
