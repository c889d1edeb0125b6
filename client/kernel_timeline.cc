// CUPTI activity records of kernels for hstu_bench timeline (kernel_timeline.h).
#include "client/kernel_timeline.h"

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace hstu::bench {
namespace {

#define HSTU_CUPTI_CHECK(expr)                                                           \
  do {                                                                                   \
    const CUptiResult r_ = (expr);                                                       \
    if (r_ != CUPTI_SUCCESS) {                                                           \
      const char* s_ = nullptr;                                                          \
      cuptiGetResultString(r_, &s_);                                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, s_ ? s_ : "?"); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

constexpr size_t kBufferBytes = size_t{8} << 20;

std::mutex g_mu;
std::vector<KernelSpan>* g_spans = nullptr;  // the recording timeline's, under g_mu

std::string Demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d != nullptr ? d : name;
  std::free(d);
  return out;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || g_spans == nullptr) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    KernelSpan s;
    s.name = Demangle(k->name);
    s.start_ns = k->start;
    s.end_ns = k->end;
    s.grid = k->gridX * k->gridY * k->gridZ;
    g_spans->push_back(std::move(s));
  }
  std::free(buffer);
}

}  // namespace

KernelTimeline::KernelTimeline() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_spans != nullptr) {
      std::fprintf(stderr, "KernelTimeline: one timeline records at a time\n");
      std::exit(1);
    }
    g_spans = new std::vector<KernelSpan>();
  }
  HSTU_CUPTI_CHECK(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted));
  HSTU_CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
}

KernelTimeline::~KernelTimeline() {
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(g_mu);
  delete g_spans;
  g_spans = nullptr;
}

void KernelTimeline::Clear() { Take(); }

std::vector<KernelSpan> KernelTimeline::Take() {
  HSTU_CUPTI_CHECK(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
  std::vector<KernelSpan> out;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    out.swap(*g_spans);
  }
  std::sort(out.begin(), out.end(),
            [](const KernelSpan& a, const KernelSpan& b) { return a.start_ns < b.start_ns; });
  return out;
}

std::string ShortKernelName(const std::string& demangled) {
  // cuBLAS kernels are plain C names (sm90_xmma_gemm_...); ours and CUTLASS's are C++ with
  // namespaces, template arguments and parameters.
  std::string s = demangled;
  // A name the demangler could not read (CUTLASS's run to thousands of characters).
  if (s.rfind("_ZN7cutlass", 0) == 0) return "cutlass::device_kernel (mangled)";
  for (const std::string anon = "(anonymous namespace)::";;) {
    const size_t at = s.find(anon);
    if (at == std::string::npos) break;
    s.erase(at, anon.size());
  }
  if (const size_t paren = s.find('('); paren != std::string::npos) s.resize(paren);
  // Drop template arguments, keeping the name before them.
  std::string flat;
  int depth = 0;
  for (char c : s) {
    if (c == '<') ++depth;
    if (depth == 0) flat.push_back(c);
    if (c == '>') --depth;
  }
  // The last component after "::" (a return type before a space goes too).
  if (const size_t colon = flat.rfind("::"); colon != std::string::npos)
    flat = flat.substr(colon + 2);
  if (const size_t space = flat.rfind(' '); space != std::string::npos)
    flat = flat.substr(space + 1);
  if (flat.empty()) flat = s;
  if (flat.size() > 48) flat.resize(48);
  return flat;
}

}  // namespace hstu::bench
