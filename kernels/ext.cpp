// mlx_flash._ext: the Python bindings of the CPU kernels' MLX primitives (matvec_op.h, layer_ops.h,
// fused_ops.h) and of the ISA / thread hooks. Bindings only: the ops and their checks live there.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "arg_checks.h"
#include "cpu_features.h"
#include "dtype.h"
#include "fused_ops.h"
#include "layer_ops.h"
#include "matvec_op.h"
#include "moe_experts.h"
#include "sparse_ffn.h"
#include "mlx/array.h"
#include "thread_pool.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

using namespace flash_ext;

// A projection from Python: (w, scales, biases, bias), the last three None where absent.
using Proj = std::tuple<mx::array, std::optional<mx::array>, std::optional<mx::array>, std::optional<mx::array>>;
// A row set from Python: (up, gate or None, down_t, n, neuron ids or None).
using SetArg = std::tuple<mx::array, std::optional<mx::array>, mx::array, int, std::optional<mx::array>>;

flash_ext::Linear linear(const Proj& p) {
  return {std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p)};
}

}  // namespace

void bind_endor(nb::module_& m);  // endor_bind.cpp
void bind_io(nb::module_& m);     // io_bind.cpp
void bind_cache(nb::module_& m);  // cache_bind.cpp
void bind_decode(nb::module_& m); // decode_bind.cpp

NB_MODULE(_ext, m) {
  m.doc() = "mlx_flash CPU matvec kernels as MLX primitives";
  nb::module_::import_("mlx.core");

  m.def("quantized_matvec", &flash_ext::quantized_matvec, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::arg("q8_activations") = false,
        nb::arg("add").none() = nb::none(),
        "y = x @ dequantize(w).T [+ add] for MLX affine-quantized w [N, K]; x [..., K]. q8_activations: x "
        "rounded to int8 per 32-element block (scale max|x|/127) and integer dot products. add: a residual "
        "of y's shape, added after y is rounded to its dtype.");
  m.def("half_matvec", &flash_ext::half_matvec, nb::arg("x"), nb::arg("w"), nb::arg("add").none() = nb::none(),
        "y = x @ w.T [+ add] for float16/bfloat16 w [N, K]; x [..., K].");
  m.def("gather_matvec", &flash_ext::gather_matvec, nb::arg("x"), nb::arg("w"),
        nb::arg("scales").none() = nb::none(), nb::arg("biases").none() = nb::none(),
        nb::arg("rows").none() = nb::none(), nb::arg("n").none() = nb::none(), nb::arg("group_size") = 64,
        nb::arg("bits").none() = nb::none(), nb::arg("q8_activations") = false,
        "y[..., i] = dot(W[rows[i]], x) (or W[:n]; pass exactly one); bits=None for float16/bfloat16 W. Rows "
        "outside [0, N) give NaN outputs.");
  m.def("gather_matvec_t", &flash_ext::gather_matvec_t, nb::arg("h"), nb::arg("w"),
        nb::arg("scales").none() = nb::none(), nb::arg("biases").none() = nb::none(),
        nb::arg("rows").none() = nb::none(), nb::arg("n").none() = nb::none(), nb::arg("group_size") = 64,
        nb::arg("bits").none() = nb::none(),
        "y[..., :] = sum_i h[..., i] * W[rows[i], :] (or W[:n]; pass exactly one); bits=None for "
        "float16/bfloat16 W. A row outside [0, N) makes every output NaN.");
  m.def("quantized_embedding", &flash_ext::quantized_embedding, nb::arg("ids"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "mx.dequantize(w[ids], scales[ids], biases[ids]) (mlx-lm's QuantizedEmbedding lookup) as one CPU primitive.");
  m.def(
      "rms_norm",
      [](const mx::array& x, std::optional<mx::array> weight, float eps) { return flash_ext::rms_norm(x, weight, eps); },
      nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"),
      "mx.fast.rms_norm as one CPU primitive: x * rsqrt(mean(x^2, -1) + eps) * weight.");
  m.def(
      "layer_norm",
      [](const mx::array& x, std::optional<mx::array> weight, std::optional<mx::array> bias, float eps) {
        return flash_ext::layer_norm(x, weight, bias, eps);
      },
      nb::arg("x"), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("eps"),
      "mx.fast.layer_norm as one CPU primitive: (x - mean) * rsqrt(var + eps) * weight + bias.");
  m.def(
      "rope",
      [](const mx::array& x, int dims, bool traditional, float base, float scale, int offset,
         std::optional<mx::array> freqs) { return flash_ext::rope(x, dims, traditional, base, scale, offset, freqs); },
      nb::arg("x"), nb::arg("dims"), nb::arg("traditional"), nb::arg("base"), nb::arg("scale"), nb::arg("offset"),
      nb::arg("freqs").none() = nb::none(),
      "mx.fast.rope (integer offset) as one CPU primitive; base is ignored when freqs is given.");
  m.def(
      "attention",
      [](const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal, bool heads_last,
         std::optional<int> n_keys) {
        return flash_ext::attention(q, k, v, scale, causal, heads_last, n_keys);
      },
      nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"), nb::arg("causal") = false,
      nb::arg("heads_last") = false, nb::arg("n_keys").none() = nb::none(),
      "mx.fast.scaled_dot_product_attention without a mask or with a causal one, as one CPU primitive; "
      "heads_last: output [B, L, H * Dv] instead of [B, H, L, Dv]; n_keys: attend to the first n_keys "
      "keys and values only (a KV cache buffer filled that far).");
  m.def(
      "norm_qkv_rope",
      [](const mx::array& x, std::optional<mx::array> norm_weight, float eps, const Proj& q, const Proj& k,
         const Proj& v, int group_size, std::optional<int> bits, int n_heads, int n_kv_heads, int rope_dims,
         bool traditional, float base, float scale, int offset, std::optional<mx::array> freqs,
         bool q8_activations, std::optional<mx::array> k_cache, std::optional<mx::array> v_cache) {
        auto out = flash_ext::norm_qkv_rope(x, norm_weight, eps, {linear(q), linear(k), linear(v)}, group_size, bits,
                                            n_heads, n_kv_heads, rope_dims, traditional, base, scale, offset, freqs,
                                            q8_activations, k_cache, v_cache);
        return std::make_tuple(out[0], out[1], out[2]);
      },
      nb::arg("x"), nb::arg("norm_weight").none(), nb::arg("eps"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
      nb::arg("group_size"), nb::arg("bits").none(), nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("rope_dims"),
      nb::arg("traditional"), nb::arg("base"), nb::arg("scale"), nb::arg("offset"), nb::arg("freqs").none(),
      nb::arg("q8_activations") = false, nb::arg("k_cache").none() = nb::none(), nb::arg("v_cache").none() = nb::none(),
      "(q, k, v) of a llama-family attention block from x [B, L, D] as one CPU primitive: rms_norm, the three "
      "projections (each (w, scales, biases, bias)), heads [B, H, L, head_dim] and RoPE on q and k. With "
      "k_cache / v_cache [B, Hkv, S, head_dim]: k and v are written into them at positions offset.. and the "
      "updated caches are returned in their place (in place when MLX can donate the buffers).");
  m.def(
      "norm_swiglu",
      [](const mx::array& x, std::optional<mx::array> norm_weight, float eps, const Proj& gate, const Proj& up,
         int group_size, std::optional<int> bits, bool q8_activations, std::optional<Proj> down,
         int down_group_size, std::optional<int> down_bits) {
        std::optional<flash_ext::Linear> d;
        if (down) d = linear(*down);
        return flash_ext::norm_swiglu(x, norm_weight, eps, linear(gate), linear(up), group_size, bits, q8_activations,
                                      d, down_group_size, down_bits);
      },
      nb::arg("x"), nb::arg("norm_weight").none(), nb::arg("eps"), nb::arg("gate"), nb::arg("up"),
      nb::arg("group_size"), nb::arg("bits").none(), nb::arg("q8_activations") = false,
      nb::arg("down").none() = nb::none(), nb::arg("down_group_size") = 64, nb::arg("down_bits").none() = nb::none(),
      "silu(h @ Wg.T) * (h @ Wu.T), h = rms_norm(x) (skipped when norm_weight is None), as one CPU primitive; "
      "gate / up are (w, scales, biases, bias) with bias None. With down ((w, scales, biases, None) in its own "
      "format down_group_size / down_bits): x + down(that), the MLP block with its residual.");
  m.def(
      "attention_o_proj",
      [](const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
         std::optional<int> n_keys, const Proj& o, int group_size, std::optional<int> bits, const mx::array& residual,
         bool q8_activations) {
        return flash_ext::attention_o_proj(q, k, v, scale, causal, n_keys, linear(o), group_size, bits, residual,
                                           q8_activations);
      },
      nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"), nb::arg("causal"),
      nb::arg("n_keys").none(), nb::arg("o"), nb::arg("group_size"), nb::arg("bits").none(), nb::arg("residual"),
      nb::arg("q8_activations") = false,
      "residual + o(attention(q, k, v) in heads-last layout) as one CPU primitive: the attention block's output "
      "with its residual; o is (w, scales, biases, None); n_keys as in attention.");
  m.def(
      "experts_swiglu",
      [](const mx::array& x, const mx::array& slots, const Proj& gate, const Proj& up, const Proj& down,
         int group_size, int bits, int down_group_size, int down_bits, bool q8_activations) {
        return flash_ext::experts_swiglu(x, slots, linear(gate), linear(up), linear(down), group_size, bits,
                                         down_group_size, down_bits, q8_activations);
      },
      nb::arg("x"), nb::arg("slots"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("group_size"),
      nb::arg("bits"), nb::arg("down_group_size"), nb::arg("down_bits"), nb::arg("q8_activations") = false,
      "y [T, k, D] of an MoE layer's routed experts as one CPU primitive: y[t, j] = down(silu(gate(x[t])) * "
      "up(x[t])) with the expert in bank slot slots[t, j]; x [T, D], slots integer [T, k]; gate / up / down are "
      "(w, scales, biases, None) banks [S, rows, columns] (MLX affine, 4 or 8 bits). Slots outside [0, S) give "
      "NaN rows.");
  m.def(
      "sparse_ffn",
      [](const mx::array& x, const std::vector<SetArg>& sets, std::optional<mx::array> gate_values, int act,
         float threshold, std::optional<mx::array> add) {
        std::vector<flash_ext::RowSet> rs;
        for (const auto& s : sets) rs.push_back({std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s), std::get<4>(s)});
        return flash_ext::sparse_ffn(x, rs, gate_values, act, threshold, add);
      },
      nb::arg("x"), nb::arg("sets"), nb::arg("gate_values").none() = nb::none(), nb::arg("act") = 0,
      nb::arg("threshold") = 0.f, nb::arg("add").none() = nb::none(),
      "A flash layer's FFN on its current rows as one CPU primitive: y = [add +] the sum over `sets` of "
      "down_t[:n].T-weighted act(gate, up) rows, each part and partial sum rounded to the output dtype as "
      "`y = y + part` rounds it. sets: (up, gate or None, down_t, n, ids or None), rows [R, K] float16 / "
      "bfloat16; a set without gate rows takes gate_values[..., ids] (or [..., :n]). act 0: silu(g) * u "
      "where |silu(g)| > threshold; 1: g * u where g > threshold; 2 (no gate): u where u > threshold. "
      "Neuron ids outside gate_values give NaN.");
  m.def("active_mask", &flash_ext::active_mask, nb::arg("g"), nb::arg("act"), nb::arg("act_threshold"),
        nb::arg("threshold"),
        "bool [N]: any over g's leading rows of |a| > threshold, a = silu(g) (act 0) or g where g > "
        "act_threshold else 0 (act 1), the thresholds compared in g's dtype; g [..., N] (a gate's output).");
  m.def("set_simd", &flash::set_simd_enabled, nb::arg("enabled"),
        "Use the best instruction set this CPU has (True) or force the portable scalar path (False).");
  m.def("isa", [] { return std::string(flash::isa_name(flash::active_isa())); },
        "The instruction set the kernels run now: 'avx512', 'avx2' or 'scalar' (importing mlx_flash.cpu.ops "
        "applies MLX_FLASH_ISA).");
  m.def("best_isa", [] { return std::string(flash::isa_name(flash::best_isa())); },
        "The fastest instruction set this CPU runs the kernels with.");
  m.def("set_isa", [](const std::string& name) { flash::set_isa(flash::parse_isa(name)); }, nb::arg("name"),
        "Run the kernels with this instruction set ('scalar', 'avx2' or 'avx512'); ValueError if the CPU lacks it.");
  m.def("set_vnni_allowed", &flash::set_vnni_allowed, nb::arg("allowed"),
        "Tests: false makes the kernels act as on an avx512 CPU without AVX512_VNNI (the int8-activation "
        "forward runs its avx2 kernel); true (the default) uses VNNI when the CPU has it.");
  m.def("cpu_features", &flash::cpu_features,
        "CPU features the kernels detect (avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512vbmi2, vpclmulqdq, "
        "avx512vnni).");
  m.def(
      "round_floats",
      [](std::vector<float> v, mx::Dtype dtype) {
        flash::round_floats(scalar_type(dtype), v.data(), int64_t(v.size()));
        return v;
      },
      nb::arg("values"), nb::arg("dtype"),
      "Test hook: float32 values rounded to dtype (float16 / bfloat16) and back, as the fused ops round "
      "their intermediates.");
  m.def("simd_active", &flash::simd_active);
  m.def("num_threads", &flash::num_threads, "Threads the kernels run on (the caller included).");
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1 || n > 256) throw std::invalid_argument("mlx_flash: threads must be in 1..256");
        flash::set_num_threads(n);
      },
      nb::arg("n"),
      "Threads the kernels run on (1..256); before the first kernel call, or it only caps the chunks "
      "(importing mlx_flash.cpu.ops applies MLX_FLASH_THREADS).");
  bind_endor(m);
  bind_io(m);
  bind_cache(m);
  bind_decode(m);
  m.attr("built_with_mlx") = MLX_FLASH_BUILT_MLX_VERSION;
}
