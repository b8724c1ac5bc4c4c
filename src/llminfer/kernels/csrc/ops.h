// The library's ops as C++ functions, for an op that calls others without a round trip through Python or the
// dispatcher (decode_layers.cpp). Each is defined, documented and registered in its own .cpp file.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace llminfer {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin);
void kv_cache_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slot_mapping);
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale);
at::Tensor int8_group_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& minimum, int64_t out_features, const c10::optional<at::Tensor>& bias);
at::Tensor int4_group_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& zero, int64_t out_features, const c10::optional<at::Tensor>& bias);

}  // namespace llminfer
