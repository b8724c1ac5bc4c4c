// decode_layers_q8: every decoder layer of a Llama-family model for one all-decode step, in one call.
//
// Why: at batch 1 the eager decoder loop (llminfer/backends/decoder_loop.py) spends about as long in Python
// between the ops of a layer (about 15 op calls, their argument checks and the module lookups) as the small
// model's norms, rotation and attention take; this op makes the same calls from C++. It calls the same
// functions with the same arguments in the same order as the Python loop does on its fastest path (fused q/k/v
// and gate/up products on the q8 kernels, llminfer's RMSNorm and rotary ops, the paged decode attention), so its
// outputs have the Python loop's bits; llminfer/backends/decode_stack.py decides when that path applies.
//
// Per layer i, the lists hold (P = 14 tensors, B = 4 optional biases, N = 11 ints, F = 3 floats):
//   params[P*i ...]  input norm weight [D]; q/k/v codes, scale, zero; o codes, scale, zero; post-attention norm
//                    weight [D]; gate/up codes, scale, zero; down codes, scale, zero (the q8 layouts of
//                    int8_group_linear_q8.cpp; "zero" is int8-wo's minimum or int4-wo's zero point)
//   biases[B*i ...]  q/k/v, o, gate/up, down (None where the projection has none)
//   ints[N*i ...]    cache layer, head_dim, q size, k/v size (each), o out, intermediate size, down out, and the
//                    code bits (8 or 4) of q/k/v, o, gate/up and down
//   floats[F*i ...]  input norm eps, post-attention norm eps, attention scale
// hidden [1, T, D] float32 (the embeddings), cos/sin [1, T, head_dim] float32, k_caches/v_caches the pool's
// per-layer [H_kv, blocks, block_size, head_dim] tensors, slot_mapping [T] int64, block_tables [T, W] int64,
// ctx_lens [T] int64 (one decode token per sequence).
// -> (hidden, delta) [1, T, D] float32 each: the residual stream and the last MLP's output, not yet added (the
// caller adds them with the final norm, as the Python loop does).
#include "common.h"
#include "ops.h"

namespace llminfer {
namespace {

constexpr int64_t kParams = 14, kBiases = 4, kInts = 11, kFloats = 3;

at::Tensor q8_product(int64_t bits, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const at::Tensor& zero, int64_t out_features, const c10::optional<at::Tensor>& bias) {
  return bits == 8 ? int8_group_linear_q8(x, codes, scale, zero, out_features, bias)
                   : int4_group_linear_q8(x, codes, scale, zero, out_features, bias);
}

// The parts of a fused product [T, sum(sizes)] as contiguous [1, T, size] tensors (FusedProjection.__call__).
std::vector<at::Tensor> split_parts(const at::Tensor& out, at::IntArrayRef sizes) {
  std::vector<at::Tensor> parts;
  for (const at::Tensor& part : out.split_with_sizes(sizes, 1)) parts.push_back(part.contiguous().view({1, -1, part.size(1)}));
  return parts;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layers_q8(
    const at::Tensor& embeddings, const at::Tensor& cos, const at::Tensor& sin, at::TensorList params,
    const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef ints, at::ArrayRef<double> floats,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& ctx_lens) {
  const char* op = "decode_layers_q8";
  const int64_t layers = static_cast<int64_t>(params.size()) / kParams;
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(params.size()) == layers * kParams &&
                  static_cast<int64_t>(biases.size()) == layers * kBiases &&
                  static_cast<int64_t>(ints.size()) == layers * kInts &&
                  static_cast<int64_t>(floats.size()) == layers * kFloats,
              op, ": per-layer lists of unequal lengths");
  TORCH_CHECK(embeddings.dim() == 3 && embeddings.size(0) == 1 && embeddings.scalar_type() == at::kFloat, op,
              ": hidden must be float32 [1, T, D]");
  TORCH_CHECK(k_caches.size() == v_caches.size(), op, ": k_caches and v_caches differ in length");
  const int64_t T = embeddings.size(1), D = embeddings.size(2);
  at::Tensor hidden = embeddings.contiguous();  // an embedding wrapper may return a view
  at::Tensor delta;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* p = params.data() + kParams * i;
    const int64_t* n = ints.data() + kInts * i;
    const double* f = floats.data() + kFloats * i;
    const auto bias = [&](int64_t j) { return biases.get(kBiases * i + j); };
    const int64_t cache_layer = n[0], head_dim = n[1], q_size = n[2], kv_size = n[3], o_out = n[4], inter = n[5],
                  down_out = n[6];
    TORCH_CHECK(cache_layer >= 0 && cache_layer < static_cast<int64_t>(k_caches.size()), op, ": cache layer ",
                cache_layer, " out of range");
    TORCH_CHECK(o_out == D && down_out == D, op, ": layer ", i, " does not map the hidden size to itself");
    at::Tensor x;
    if (i == 0) {
      x = rms_norm(hidden, p[0], f[0]);
    } else {
      std::tie(hidden, x) = add_rms_norm(hidden, delta, p[0], f[0]);
    }
    const std::vector<at::Tensor> qkv = split_parts(
        q8_product(n[7], x.view({-1, D}), p[1], p[2], p[3], q_size + 2 * kv_size, bias(0)), {q_size, kv_size, kv_size});
    at::Tensor q = qkv[0].view({1, T, -1, head_dim}).transpose(1, 2);
    at::Tensor k = qkv[1].view({1, T, -1, head_dim}).transpose(1, 2);
    const at::Tensor v = qkv[2].view({1, T, -1, head_dim}).transpose(1, 2);
    std::tie(q, k) = rotary_qk(q, k, cos, sin);
    const at::Tensor& k_cache = k_caches[cache_layer];
    const at::Tensor& v_cache = v_caches[cache_layer];
    kv_cache_write(k_cache, v_cache, k[0], v[0], slot_mapping);
    const at::Tensor attended =
        paged_decode_attention(q[0].transpose(0, 1), k_cache, v_cache, block_tables, ctx_lens, f[2]).unsqueeze(0);
    const at::Tensor o_in = attended.reshape({1, T, -1}).contiguous();
    const at::Tensor o = q8_product(n[8], o_in.view({-1, o_in.size(-1)}), p[4], p[5], p[6], o_out, bias(1))
                             .view({1, -1, o_out});
    std::tie(hidden, x) = add_rms_norm(hidden, o, p[7], f[1]);
    const std::vector<at::Tensor> gate_up =
        split_parts(q8_product(n[9], x.view({-1, D}), p[8], p[9], p[10], 2 * inter, bias(2)), {inter, inter});
    const at::Tensor act = at::silu(gate_up[0]) * gate_up[1];
    delta = q8_product(n[10], act.view({-1, inter}), p[11], p[12], p[13], down_out, bias(3)).view({1, -1, down_out});
  }
  return {hidden, delta};
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("decode_layers_q8(Tensor hidden, Tensor cos, Tensor sin, Tensor[] params, Tensor?[] biases, int[] ints, "
        "float[] floats, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor ctx_lens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("decode_layers_q8", &llminfer::decode_layers_q8); }
