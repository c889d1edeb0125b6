// Reads a fuzzer's input bytes as a stream of small choices; past the end every read gives 0, so
// any input, however short, is a complete program.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hstu::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  // A value in [0, n), n > 0.
  uint32_t Below(uint32_t n) {
    const uint32_t v = static_cast<uint32_t>(Byte()) | static_cast<uint32_t>(Byte()) << 8;
    return v % n;
  }
  bool Bool() { return (Byte() & 1) != 0; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace hstu::fuzz
