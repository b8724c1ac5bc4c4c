// The llminfer_cpu operator library: its definition, and what the build has (the ops themselves are defined
// with TORCH_LIBRARY_FRAGMENT in their own files; see common.h).
#include "common.h"

#include <string>

namespace llminfer {
namespace {

// The vector ISA this library was built for: 512 (AVX-512) or 256 (AVX2).
int64_t vector_bits() { return LLMINFER_KERNEL_AVX512 ? 512 : 256; }
// The activation bits of int8_linear's integer path: 14 on the VNNI build, 0 where it has none.
int64_t int8_activation_bits() { return LLMINFER_KERNEL_VNNI ? 14 : 0; }
// Whether bf16_linear runs here (the AVX-512 build with AVX-512 BF16).
bool bf16_supported() { return LLMINFER_KERNEL_BF16; }

// Which instruction the q8 path multiplies with in this build.
std::string q8_instruction() {
#if LLMINFER_Q8_512
  return "vpdpbusd zmm (AVX-512 VNNI)";
#elif LLMINFER_Q8_DP256 && defined(__AVXVNNI__)
  return "vpdpbusd ymm (AVX-VNNI)";
#elif LLMINFER_Q8_DP256
  return "vpdpbusd ymm (AVX-512 VNNI, VL)";
#else
  return "vpmaddubsw ymm (AVX2)";
#endif
}

// Turn llminfer's own kernel threads (thread_pool.h) on or off (off: torch's OpenMP team, for comparison);
// returns the previous setting.
bool use_kernel_thread_pool(bool on) { return KernelThreadPool::enabled().exchange(on); }
// Whether the kernels' loops run on llminfer's own threads now (read only).
bool kernel_thread_pool_enabled() { return KernelThreadPool::enabled().load(); }

}  // namespace
}  // namespace llminfer

TORCH_LIBRARY(llminfer_cpu, m) {
  m.def("vector_bits() -> int", &llminfer::vector_bits);
  m.def("int8_activation_bits() -> int", &llminfer::int8_activation_bits);
  m.def("bf16_supported() -> bool", &llminfer::bf16_supported);
  m.def("q8_instruction() -> str", &llminfer::q8_instruction);
  m.def("use_kernel_thread_pool(bool on) -> bool", &llminfer::use_kernel_thread_pool);
  m.def("kernel_thread_pool_enabled() -> bool", &llminfer::kernel_thread_pool_enabled);
}
