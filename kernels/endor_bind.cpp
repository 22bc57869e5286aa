// Python binding of the ENDOR decoder (kernels/endor_decode.h), registered by ext.cpp's bind_endor.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "endor_decode.h"
#include "cpu_features.h"
#include "row_copy.h"

namespace nb = nanobind;

using Bytes1 = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes2 = nb::ndarray<uint8_t, nb::ndim<2>, nb::device::cpu>;
using Index = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Crcs = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Floats = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

namespace {

// The ISA named (ValueError when unknown or when this CPU cannot run it), else the active one.
flash::Isa chosen_isa(const std::optional<std::string>& name) {
  if (!name.has_value()) return flash::active_isa();
  const flash::Isa isa = flash::parse_isa(*name);
  if (int(isa) > int(flash::best_isa()))
    throw std::invalid_argument("mlx_flash: this CPU cannot run the " + *name + " kernels");
  return isa;
}

}  // namespace

void bind_endor(nb::module_& m) {
  m.def(
      "endor_check_decode",
      [](Bytes1 flat, Index starts, Index lengths, Index slots,
         const std::vector<std::tuple<Bytes2, int64_t, int, int>>& roles, std::optional<Crcs> crcs,
         const std::optional<std::string>& isa_name, bool parallel) {
        const size_t count = starts.shape(0);
        if (lengths.shape(0) != count || slots.shape(0) != count)
          throw std::invalid_argument("endor_check_decode: starts, lengths and slots differ in length");
        if (crcs.has_value() && crcs->shape(0) != count)
          throw std::invalid_argument("endor_check_decode: one expected crc32 per bundle");
        std::vector<flash::endor::Role> rs;
        for (const auto& [dest, n, kind, group_size] : roles) {
          if (dest.stride(1) != 1) throw std::invalid_argument("endor_check_decode: destination rows not contiguous");
          if (kind < flash::endor::kRaw || kind > flash::endor::kQuant4)
            throw std::invalid_argument("endor_check_decode: unknown kind");
          if (kind >= flash::endor::kQuant8 && group_size <= 0)
            throw std::invalid_argument("endor_check_decode: group_size must be positive");
          const int64_t size = kind == flash::endor::kFloat ? 4 : 2;
          if (kind != flash::endor::kRaw && dest.shape(1) != static_cast<size_t>(n * size))
            throw std::invalid_argument("endor_check_decode: destination row size disagrees with n");
          rs.push_back({dest.data(), static_cast<int64_t>(dest.stride(0)), n, kind, group_size});
        }
        for (size_t b = 0; b < count; ++b) {
          for (const auto& [dest, n, kind, gs] : roles) {
            if (slots.data()[b] < 0 || static_cast<size_t>(slots.data()[b]) >= dest.shape(0))
              throw std::invalid_argument("endor_check_decode: slot out of range");
          }
        }
        const flash::Isa isa = chosen_isa(isa_name);
        const uint32_t* expected = crcs.has_value() ? crcs->data() : nullptr;
        flash::endor::BadBundle bad;
        {
          nb::gil_scoped_release release;
          bad = flash::endor::decode_bundles(flat.data(), static_cast<int64_t>(flat.shape(0)), starts.data(),
                                             lengths.data(), slots.data(), static_cast<int64_t>(count), rs.data(),
                                             static_cast<int>(rs.size()), isa, expected, parallel);
        }
        return std::make_tuple(bad.index, bad.fault);
      },
      nb::arg("flat"), nb::arg("starts"), nb::arg("lengths"), nb::arg("slots"), nb::arg("roles"),
      nb::arg("crcs").none() = nb::none(), nb::arg("isa").none() = nb::none(), nb::arg("parallel") = true,
      "Check and decode ENDOR bundles flat[starts[b]:starts[b]+lengths[b]] into row slots[b] of each "
      "role's destination; roles: [(uint8 dest [rows, row bytes], n, kind, group_size)], kind 0 raw, "
      "1 16-bit, 2 float32, 3 8-bit codes, 4 4-bit codes (see mlx_flash/pack/bitmap.py); crcs: "
      "uint32 expected crc32 of each bundle (checked first); isa: 'scalar', 'avx2' or 'avx512' (default "
      "the kernels' active one). One pass over the kernels' thread pool "
      "with the GIL released. Returns (first rejected bundle or -1, fault: 0 none, 1 crc32, 2 the "
      "bitmaps' popcount disagrees with the bundle's length).");
  m.def(
      "endor_check_crc32",
      [](Bytes1 flat, Index starts, Index lengths, Crcs crcs, const std::optional<std::string>& isa_name,
         bool parallel) {
        const size_t count = starts.shape(0);
        if (lengths.shape(0) != count || crcs.shape(0) != count)
          throw std::invalid_argument("endor_check_crc32: starts, lengths and crcs differ in length");
        const flash::Isa isa = chosen_isa(isa_name);
        flash::endor::BadBundle bad;
        {
          nb::gil_scoped_release release;
          bad = flash::endor::check_bundles(flat.data(), static_cast<int64_t>(flat.shape(0)), starts.data(),
                                            lengths.data(), static_cast<int64_t>(count), crcs.data(), isa, parallel);
        }
        return std::make_tuple(bad.index, bad.fault);
      },
      nb::arg("flat"), nb::arg("starts"), nb::arg("lengths"), nb::arg("crcs"), nb::arg("isa").none() = nb::none(),
      nb::arg("parallel") = true,
      "Check the crc32 of bundles flat[starts[b]:starts[b]+lengths[b]] against crcs[b] without decoding "
      "them: one pass over the kernels' thread pool with the GIL released. Returns (first rejected bundle "
      "or -1, fault: 0 none, 1 crc32, 2 outside flat).");
  m.def(
      "endor_ffn",
      [](Floats x, Bytes1 flat, Index starts, Index lengths, int n_blocks, Floats y, bool bf16, bool up_bias,
         int act, float threshold, const std::optional<std::string>& isa_name, bool parallel, int kind,
         int group_size) {
        const size_t count = starts.shape(0);
        if (lengths.shape(0) != count) throw std::invalid_argument("endor_ffn: starts and lengths differ in length");
        if (n_blocks != 2 && n_blocks != 3) throw std::invalid_argument("endor_ffn: n_blocks must be 2 or 3");
        if (act != 0 && act != 1) throw std::invalid_argument("endor_ffn: act must be 0 (silu) or 1 (relu)");
        if (up_bias && n_blocks != 2) throw std::invalid_argument("endor_ffn: up_bias needs n_blocks 2");
        if (kind != flash::endor::kHalf && kind != flash::endor::kQuant8 && kind != flash::endor::kQuant4)
          throw std::invalid_argument("endor_ffn: kind must be 1 (16-bit), 3 (8-bit) or 4 (4-bit)");
        if (kind != flash::endor::kHalf && group_size <= 0)
          throw std::invalid_argument("endor_ffn: group_size must be positive");
        if (x.shape(0) == 0 || y.shape(0) == 0 || x.shape(0) > (1u << 30) || y.shape(0) > (1u << 30))
          throw std::invalid_argument("endor_ffn: x and y must hold 1 .. 2^30 values");
        const flash::Isa isa = chosen_isa(isa_name);
        int64_t bad;
        {
          nb::gil_scoped_release release;
          bad = flash::endor::ffn_bundles(flat.data(), static_cast<int64_t>(flat.shape(0)), starts.data(),
                                          lengths.data(), static_cast<int64_t>(count), n_blocks,
                                          static_cast<int64_t>(x.shape(0)), static_cast<int64_t>(y.shape(0)), kind,
                                          group_size, bf16, up_bias, act, threshold, x.data(), y.data(), isa,
                                          parallel);
        }
        return bad;
      },
      nb::arg("x"), nb::arg("flat"), nb::arg("starts"), nb::arg("lengths"), nb::arg("n_blocks"), nb::arg("y"),
      nb::arg("bf16") = false, nb::arg("up_bias") = false, nb::arg("act") = 0, nb::arg("threshold") = 0.0f, nb::arg("isa").none() = nb::none(),
      nb::arg("parallel") = true, nb::arg("kind") = 1, nb::arg("group_size") = 0,
      "One token's FFN from ENDOR bundles of float16/bfloat16 blocks (kind 1) or 8/4-bit codes (kind 3/4) (gate, up, down or up, down): "
      "y (float32 [D], written) = sum_b act(gate_b . x) * (up_b . x) * down_b (act 0 silu, 1 relu; "
      "2 blocks: relu(up_b . x + bias_b), bias_b a raw 16-bit value after the down block when up_bias), each block decoded into an L1 row and used at once; neurons whose "
      "activation is not above threshold are skipped. Returns the first bundle whose blocks do not "
      "add up to its length, or -1.");
  m.def(
      "crc32_ranges",
      [](Bytes1 flat, Index starts, int64_t length, nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> crcs,
         const std::optional<std::string>& isa_name) {
        const size_t count = starts.shape(0);
        if (crcs.shape(0) != count) throw std::invalid_argument("crc32_ranges: starts and crcs differ in length");
        const int64_t size = static_cast<int64_t>(flat.shape(0));
        const int64_t* start = starts.data();
        for (size_t b = 0; b < count; ++b)
          if (length < 0 || start[b] < 0 || start[b] > size - length)
            throw std::invalid_argument("crc32_ranges: a range runs outside flat");
        const flash::Isa isa = chosen_isa(isa_name);
        uint32_t* crc = crcs.data();
        nb::gil_scoped_release release;
        for (size_t b = 0; b < count; ++b) crc[b] = flash::endor::crc32(crc[b], flat.data() + start[b], length, isa);
      },
      nb::arg("flat"), nb::arg("starts"), nb::arg("length"), nb::arg("crcs"), nb::arg("isa").none() = nb::none(),
      "crcs[b] = zlib.crc32(flat[starts[b]:starts[b]+length], crcs[b]) for every b, in place, GIL released: the "
      "crc32 of bundles whose components sit in separate arrays, one call per component array.");
  m.def(
      "copy_rows",
      [](Bytes1 flat, Index starts, int64_t length, Bytes2 dest, Index slots, const std::optional<std::string>& isa_name) {
        const size_t count = starts.shape(0);
        if (slots.shape(0) != count) throw std::invalid_argument("copy_rows: starts and slots differ in length");
        if (dest.stride(1) != 1) throw std::invalid_argument("copy_rows: destination rows not contiguous");
        if (length < 0 || length > static_cast<int64_t>(dest.shape(1)))
          throw std::invalid_argument("copy_rows: length exceeds the destination rows");
        const int64_t size = static_cast<int64_t>(flat.shape(0)), rows = static_cast<int64_t>(dest.shape(0));
        const int64_t* start = starts.data();
        const int64_t* slot = slots.data();
        for (size_t b = 0; b < count; ++b) {
          if (start[b] < 0 || start[b] > size - length) throw std::invalid_argument("copy_rows: a range runs outside flat");
          if (slot[b] < 0 || slot[b] >= rows) throw std::invalid_argument("copy_rows: slot out of range");
        }
        const flash::Isa isa = chosen_isa(isa_name);
        nb::gil_scoped_release release;
        flash::copy_rows(flat.data(), start, length, dest.data(), static_cast<int64_t>(dest.stride(0)), slot,
                         static_cast<int64_t>(count), isa);
      },
      nb::arg("flat"), nb::arg("starts"), nb::arg("length"), nb::arg("dest"), nb::arg("slots"),
      nb::arg("isa").none() = nb::none(),
      "dest[slots[b], :length] = flat[starts[b]:starts[b]+length] for every b, GIL released: staged reads "
      "copied out to their rows (streaming stores into aligned 64-byte lines on AVX2).");
  m.def(
      "endor_crc32",
      [](Bytes1 data, uint32_t crc, const std::optional<std::string>& isa_name) {
        const flash::Isa isa = chosen_isa(isa_name);
        nb::gil_scoped_release release;
        return flash::endor::crc32(crc, data.data(), static_cast<int64_t>(data.shape(0)), isa);
      },
      nb::arg("data"), nb::arg("crc") = 0, nb::arg("isa").none() = nb::none(),
      "zlib.crc32(data, crc) of uint8 data with the kernels' crc32 (PCLMULQDQ on AVX2 and AVX-512, else slicing by 8).");
}
