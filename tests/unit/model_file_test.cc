// Model files: round trips and every malformed-file case, each error naming what is wrong.
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/model_file.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace hstu {
namespace {

ModelConfig SmallConfig() {
  ModelConfig c = *PresetConfig("tiny");
  c.num_layers = 2;
  c.hidden_dim = 8;
  c.num_heads = 2;
  c.head_dim = 4;
  c.item_rows = 11;
  c.action_rows = 3;
  c.max_history_tokens = 16;
  c.position_rows = 16;
  c.head_dims = {8, 4, 3};
  return c;
}

// Splits a file into (header JSON, data) so tests can corrupt one part.
std::pair<nlohmann::json, std::string> Split(const std::string& bytes) {
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return {nlohmann::json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
}

std::string Join(const nlohmann::json& header, const std::string& data) {
  std::string h = header.dump();
  uint64_t n = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + h + data;
}

void ExpectError(const std::string& bytes, const std::string& needle) {
  auto r = ParseModelFile(bytes, "test.safetensors");
  ASSERT_FALSE(r.ok()) << "expected an error containing '" << needle << "'";
  EXPECT_NE(std::string(r.status().message()).find(needle), std::string::npos)
      << "message: " << r.status().message();
}

TEST(ModelFile, F32RoundTripIsExact) {
  const ModelWeights w = RandomModel(SmallConfig(), 7);
  auto r = ParseModelFile(SerializeModelFile(w, FileDType::kF32), "x");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.num_layers, 2);
  EXPECT_EQ(r->config.item_rows, 11);
  EXPECT_EQ(r->config.head_dims, (std::vector<int32_t>{8, 4, 3}));
  EXPECT_EQ(r->item_embedding, w.item_embedding);
  EXPECT_EQ(r->position_embedding, w.position_embedding);
  EXPECT_EQ(r->layers[1].uvqk_w, w.layers[1].uvqk_w);
  EXPECT_EQ(r->head[1].b, w.head[1].b);
}

TEST(ModelFile, AFailedWriteLeavesTheOldFileAndNoPartialOne) {
  // Before: the target was truncated first and written in place, so a full disk left a partial
  // file where a valid model had been.
  const std::string dir = ::testing::TempDir() + "/model_write_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/m.safetensors";
  const ModelWeights small = RandomModel(SmallConfig(), 7);
  ASSERT_TRUE(WriteModelFile(small, path, FileDType::kF32).ok());
  const std::string before = SerializeModelFile(small, FileDType::kF32);
  ModelConfig big_config = SmallConfig();
  big_config.item_rows = 100000;  // a file far past the size limit below
  const ModelWeights big = RandomModel(big_config, 8);
  // A file size limit stands in for a full disk (EFBIG instead of ENOSPC).
  signal(SIGXFSZ, SIG_IGN);
  rlimit old_limit{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  rlimit small_limit = old_limit;
  small_limit.rlim_cur = before.size() * 4;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small_limit), 0);
  const absl::Status s = WriteModelFile(big, path, FileDType::kF32);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old_limit), 0);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("nothing written"), std::string::npos) << s;
  auto r = ReadModelFile(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.item_rows, small.config.item_rows);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            1);  // no temporary left behind
  std::filesystem::remove_all(dir);
}

TEST(ModelFile, Bf16RoundTripRoundsToBf16) {
  const ModelWeights w = RandomModel(SmallConfig(), 8);
  auto r = ParseModelFile(SerializeModelFile(w, FileDType::kBF16), "x");
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t i = 0; i < w.layers[0].uvqk_w.size(); ++i) {
    const float a = w.layers[0].uvqk_w[i], b = r->layers[0].uvqk_w[i];
    EXPECT_NEAR(a, b, std::abs(a) * (1.0 / 256) + 1e-30);
  }
  // Written again as BF16, the values are unchanged (already representable).
  auto r2 = ParseModelFile(SerializeModelFile(*r, FileDType::kBF16), "x");
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->layers[0].uvqk_w, r->layers[0].uvqk_w);
}

TEST(ModelFile, RandomModelsAreDeterministic) {
  EXPECT_EQ(RandomModel(SmallConfig(), 5).layers[0].output_w, RandomModel(SmallConfig(), 5).layers[0].output_w);
  EXPECT_NE(RandomModel(SmallConfig(), 5).layers[0].output_w, RandomModel(SmallConfig(), 6).layers[0].output_w);
}

TEST(ModelFile, WrongMagicOrLength) {
  ExpectError("abc", "too short");
  std::string bytes = SerializeModelFile(RandomModel(SmallConfig(), 1));
  std::string bad = bytes;
  const uint64_t huge = 1ull << 40;
  std::memcpy(bad.data(), &huge, 8);
  ExpectError(bad, "header length");
}

TEST(ModelFile, HeaderWithANulByteIsRejected) {
  // The JSON parser stops at a NUL: before, whatever followed it in the header passed unread.
  const std::string bytes = SerializeModelFile(RandomModel(SmallConfig(), 1));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  std::string h = bytes.substr(8, n);
  while (!h.empty() && h.back() == ' ') h.pop_back();
  h += std::string(1, '\0') + "GARBAGE!";
  while (h.size() % 8) h += ' ';
  uint64_t m = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &m, 8);
  ExpectError(out + h + bytes.substr(8 + n), "NUL byte");
}

TEST(ModelFile, AShiftedHeaderLengthIsALayoutErrorNotANaN) {
  // A header length a few bytes short: the header still parses (it ends in padding), every
  // tensor is read a few bytes early, and the garbage values are what the layout explains.
  const std::string bytes = SerializeModelFile(RandomModel(SmallConfig(), 1));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const std::string padded = bytes.substr(8, n) + std::string(8, ' ');
  for (const uint64_t shift : {1, 2, 7}) {
    std::string bad(8, '\0');
    const uint64_t shorter = padded.size() - shift;
    std::memcpy(bad.data(), &shorter, 8);
    bad += padded + bytes.substr(8 + n);
    auto r = ParseModelFile(bad, "x");
    ASSERT_FALSE(r.ok()) << shift;
    EXPECT_NE(std::string(r.status().message()).find("trailing bytes"), std::string::npos)
        << shift << ": " << r.status();
  }
}

TEST(ModelFile, EmbeddingTablesPastTheValueLimitAreRejected) {
  // Before: hstu_model init --items 2^58 wrapped item_rows * d to 0 and wrote a file whose header
  // promised 2^58 rows and held none.
  ModelConfig c = SmallConfig();
  c.item_rows = int64_t{1} << 58;
  absl::Status s = c.Validate();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("item_rows must be at most"), std::string::npos) << s;
  c = SmallConfig();
  c.action_rows = (int64_t{1} << 44) / c.hidden_dim + 1;
  s = c.Validate();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("action_rows"), std::string::npos) << s;
  c.action_rows = (int64_t{1} << 44) / c.hidden_dim;
  EXPECT_TRUE(c.Validate().ok());
}

TEST(ModelFile, AnUnreadableFileSaysSo) {
  auto missing = ReadModelFile(::testing::TempDir() + "/no_such_model.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(missing.status().message()).find("No such file"), std::string::npos)
      << missing.status();
  if (geteuid() == 0) GTEST_SKIP() << "root reads a file of mode 000";
  const std::string path =
      ::testing::TempDir() + "/unreadable_" + std::to_string(getpid()) + ".safetensors";
  ASSERT_TRUE(WriteModelFile(RandomModel(SmallConfig(), 1), path, FileDType::kF32).ok());
  std::filesystem::permissions(path, std::filesystem::perms::none);
  auto r = ReadModelFile(path);
  std::filesystem::remove(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("Permission denied"), std::string::npos);
}

TEST(ModelFile, HeaderNotJson) {
  std::string h = "{not json!";
  while (h.size() % 8) h += ' ';
  uint64_t n = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  ExpectError(out + h, "header (the 16 bytes after its length) is not a JSON object");
  // A header length a few bytes too long takes tensor bytes into the JSON: the message points at
  // the length.
  const std::string bytes = SerializeModelFile(RandomModel(SmallConfig(), 1));
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  std::string longer = bytes;
  const uint64_t plus = len + 5;
  std::memcpy(longer.data(), &plus, 8);
  ExpectError(longer, "the file is corrupt, or its header length is wrong");
}

TEST(ModelFile, MissingTensorIsNamed) {
  auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
  h.erase("layers.1.output_norm.bias");
  ExpectError(Join(h, data), "layers.1.output_norm.bias' is missing");
}

TEST(ModelFile, ShapeWhoseByteCountWrapsIsRejected) {
  // (2^56 + 1) x 8 x 4 bytes wraps to 32 in 64 bits: a table of one real row passed as 2^56 + 1
  // rows, and the embedding gather read far past it.
  auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
  auto& item = h["embeddings.item.weight"];
  item["shape"] = {(int64_t{1} << 56) + 1, 8};
  item["data_offsets"] = {0, 32};
  ExpectError(Join(h, data), "'embeddings.item.weight' has a shape larger than the file's");
}

TEST(ModelFile, OverlappingOrTrailingTensorDataIsRejected) {
  {
    // The action table aliasing the item table's first bytes (same size as its own data).
    auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
    const auto end = h["embeddings.action.weight"]["data_offsets"][1].get<uint64_t>() -
                     h["embeddings.action.weight"]["data_offsets"][0].get<uint64_t>();
    h["embeddings.action.weight"]["data_offsets"] = {0, end};
    ExpectError(Join(h, data), "tensor data overlaps");
  }
  {
    auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
    ExpectError(Join(h, data + std::string(64, '\0')), "trailing bytes");
  }
}

TEST(ModelFile, AKeyGivenTwiceIsRejected) {
  // JSON parsers keep one of the two (nlohmann the last): the file would mean two things.
  auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
  std::string text = h.dump();
  const std::string meta = "\"__metadata__\":{";
  ASSERT_NE(text.find(meta), std::string::npos);
  text.insert(text.find(meta) + meta.size(), "\"hstu.num_layers\":\"1\",");
  uint64_t n = text.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &n, 8);
  ExpectError(bytes + text + data, "header has the key 'hstu.num_layers' twice");
}

TEST(ModelFile, LayerCountBeyondTheTensorsIsRejectedBeforeAllocating) {
  auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
  h["__metadata__"]["hstu.num_layers"] = "2000000000";
  ExpectError(Join(h, data), "'hstu.num_layers' = 2000000000 but the file holds only");
}

TEST(ModelFile, AbsurdHistoryLengthIsRejected) {
  ModelConfig c = SmallConfig();
  c.max_history_tokens = 1 << 30;
  EXPECT_NE(std::string(c.Validate().message()).find("hstu.max_history_tokens must be at most"),
            std::string::npos)
      << c.Validate();
}

TEST(ModelFile, ADirectoryIsNotAModelFile) {
  auto r = ReadModelFile(::testing::TempDir());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.status().message()).find("is not a regular file"), std::string::npos)
      << r.status();
}

TEST(ModelFile, MisShapedTensorIsNamed) {
  auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
  h["layers.0.uvqk.weight"]["shape"] = {16, 16};  // same byte count, wrong shape
  ExpectError(Join(h, data), "'layers.0.uvqk.weight' has shape [16, 16], expected [8, 32]");
}

TEST(ModelFile, ShapeAndByteCountDisagree) {
  auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
  h["layers.0.uvqk.bias"]["shape"] = {33};
  ExpectError(Join(h, data), "'layers.0.uvqk.bias' holds");
}

TEST(ModelFile, DataPastTheEndIsDetected) {
  const std::string bytes = SerializeModelFile(RandomModel(SmallConfig(), 1));
  ExpectError(bytes.substr(0, bytes.size() - 10), "runs past the end of the file");
}

TEST(ModelFile, UnsupportedDtypeIsNamed) {
  auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
  h["head.0.bias"]["dtype"] = "F16";
  ExpectError(Join(h, data), "'head.0.bias' has dtype 'F16'");
}

TEST(ModelFile, InconsistentMetadata) {
  {
    auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
    h["__metadata__"]["hstu.num_tasks"] = "4";  // head outputs 3
    ExpectError(Join(h, data), "hstu.num_tasks is 4");
  }
  {
    auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
    h["__metadata__"].erase("hstu.head_dim");
    ExpectError(Join(h, data), "'hstu.head_dim' is missing");
  }
  {
    auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
    h["__metadata__"]["hstu.num_heads"] = "two";
    ExpectError(Join(h, data), "'hstu.num_heads' = 'two' is not an integer");
  }
  {
    auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
    h["__metadata__"]["hstu.num_layers"] = "3";  // file has 2 layers
    ExpectError(Join(h, data), "'layers.2.input_norm.weight' is missing");
  }
  {
    // A misspelt optional key (before: ignored, and the default scored in its place); a key of
    // another writer's is not ours to judge.
    auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
    h["__metadata__"]["hstu.attention_norm_length"] = "64";
    ExpectError(Join(h, data), "unknown metadata key 'hstu.attention_norm_length' (the hstu.* keys: "
                               "hstu.model_name, hstu.num_layers");
    h["__metadata__"].erase("hstu.attention_norm_length");
    // Ours but for the case or the separator: the loader would have scored the default instead.
    for (const char* key :
         {"HSTU.max_attn_len", "hstu_max_attn_len", "Hstu-Max_Attn_Len", "hstu.max-attn-len"}) {
      h["__metadata__"][key] = "16";
      ExpectError(Join(h, data), absl::StrCat("unknown metadata key '", key,
                                              "' (did you mean 'hstu.max_attn_len'? metadata keys "
                                              "are case-sensitive)"));
      h["__metadata__"].erase(key);
    }
    h["__metadata__"]["hstu\u00e9"] = "1";  // what tools/hstu_reference.py refuses too
    ExpectError(Join(h, data), "unknown metadata key 'hstu\u00e9' (the hstu.* keys: ");
    h["__metadata__"].erase("hstu\u00e9");
    h["__metadata__"]["HSTU_WINDOW"] = "16";
    ExpectError(Join(h, data), "unknown metadata key 'HSTU_WINDOW' (the hstu.* keys: ");
    h["__metadata__"].erase("HSTU_WINDOW");
    // Keys that only begin with the letters, and other writers' keys, are not ours.
    h["__metadata__"]["hstuff"] = "x";
    h["__metadata__"]["format"] = "pt";
    EXPECT_TRUE(ParseModelFile(Join(h, data), "x").ok());
  }
  {
    auto [h, data] = Split(SerializeModelFile(RandomModel(SmallConfig(), 1)));
    h["__metadata__"]["hstu.hidden_dim"] = "16";
    ExpectError(Join(h, data), "embeddings.item.weight' has shape [11, 8], expected [rows > 0, 16]");
  }
}

TEST(ModelFile, AttentionNormLenDefaultsToHistoryPlusCandidates) {
  // DESIGN §2.2: N defaults to max history tokens + max candidates. Before, a file without the
  // key was rejected as missing it.
  ModelConfig c = SmallConfig();
  c.max_candidates = 5;
  c.attention_norm_len = 7;
  auto [h, data] = Split(SerializeModelFile(RandomModel(c, 1)));
  auto given = ParseModelFile(Join(h, data), "x");
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->config.attention_norm_len, 7);
  h["__metadata__"].erase("hstu.attention_norm_len");
  auto defaulted = ParseModelFile(Join(h, data), "x");
  ASSERT_TRUE(defaulted.ok()) << defaulted.status();
  EXPECT_EQ(defaulted->config.attention_norm_len, 16 + 5);
  for (const char* spelled_default : {"", "0"}) {
    auto [h2, data2] = Split(SerializeModelFile(RandomModel(c, 1)));
    h2["__metadata__"]["hstu.attention_norm_len"] = spelled_default;
    auto d = ParseModelFile(Join(h2, data2), "x");
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->config.attention_norm_len, 16 + 5) << "'" << spelled_default << "'";
  }
  // Without hstu.max_candidates either: its own default, 256.
  h["__metadata__"].erase("hstu.max_candidates");
  auto both = ParseModelFile(Join(h, data), "x");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->config.max_candidates, 256);
  EXPECT_EQ(both->config.attention_norm_len, 16 + 256);
  // A bad history length is named as itself, not as the length derived from it.
  h["__metadata__"]["hstu.max_history_tokens"] = "-4";
  ExpectError(Join(h, data), "'hstu.max_history_tokens' must be > 0, got -4");
  h["__metadata__"]["hstu.max_history_tokens"] = "16";
  h["__metadata__"]["hstu.max_candidates"] = "2000000000";
  ExpectError(Join(h, data), "hstu.max_candidates must be at most 1048576");
}

TEST(ModelFile, TruncationStrideRoundTripsAndIsChecked) {
  ModelConfig c = SmallConfig();  // M = 16: the default stride is 4
  ASSERT_EQ(c.truncation_stride(), 4);
  {
    // Not written when it is the default, so files stay as they were.
    auto [h, data] = Split(SerializeModelFile(RandomModel(c, 1)));
    EXPECT_FALSE(h["__metadata__"].contains("hstu.truncation_stride"));
  }
  c.truncation_stride_tokens = 6;
  auto r = ParseModelFile(SerializeModelFile(RandomModel(c, 1)), "x");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.truncation_stride(), 6);
  for (const char* bad : {"5", "18", "-2"}) {  // odd, past M, negative
    auto [h, data] = Split(SerializeModelFile(RandomModel(c, 1)));
    h["__metadata__"]["hstu.truncation_stride"] = bad;
    ExpectError(Join(h, data), std::string("hstu.truncation_stride must be even and in [2, "
                                           "hstu.max_history_tokens = 16] (whole events), got ") + bad);
  }
  // "0" spells the default.
  auto [h, data] = Split(SerializeModelFile(RandomModel(c, 1)));
  h["__metadata__"]["hstu.truncation_stride"] = "0";
  auto z = ParseModelFile(Join(h, data), "x");
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_EQ(z->config.truncation_stride(), 4);
}

TEST(ModelFile, NanWeightsAreRejected) {
  ModelWeights w = RandomModel(SmallConfig(), 1);
  w.layers[0].output_w[3] = NAN;
  ExpectError(SerializeModelFile(w), "'layers.0.output.weight' contains NaN");
}

TEST(ModelFile, PresetsAndUnknownPreset) {
  auto base = PresetConfig("base");
  ASSERT_TRUE(base.ok());
  EXPECT_EQ(base->num_layers, 8);
  EXPECT_EQ(base->hd(), 1024);
  EXPECT_EQ(base->attention_norm_len, 4352);
  EXPECT_TRUE(base->Validate().ok());
  EXPECT_FALSE(PresetConfig("huge").ok());
  EXPECT_FALSE(ReadModelFile("/nonexistent/model.safetensors").ok());
}

}  // namespace
}  // namespace hstu
