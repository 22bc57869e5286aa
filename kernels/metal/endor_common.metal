// ENDOR blocks read straight from the encoded bundles (the `header` of endor_up.metal and
// endor_down.metal; the format is mlx_flash/pack/bitmap.py). `enc` holds the bundles as uint32
// words: every piece of a block starts on a 4-byte boundary. A block of an n-element row at word
// `at` is its bitmap, words at .. at + ceil(n / 32) (bit b of word i: element 32 i + b is stored;
// bits past n are ignored, as the CPU decode does), then its payload from word p = at + ceil(n / 32):
//   FMT 0 / 1 / 2  nnz float16 / bfloat16 / float32 values
//   FMT 4 / 8      nnz codes (code v at bit v * FMT of the code stream), then ceil(nnz / g) float16
//                  scales, then as many float16 biases (each piece padded to 4 bytes); stored value
//                  v decodes to half(scale_k * q + bias_k), k = v / g (the CPU decode's rounding)
// A SIMD group walks one block together: lane l takes bitmap words l, l + 32, ...; the number of
// values stored before its word is the prefix sum of the popcounts (simd_prefix_exclusive_sum)
// plus the values of the earlier 32-word chunks.

inline uint endor_words(uint bytes) {
  return (bytes + 3) / 4;
}

// Bitmap word i of the block at word `at` of an n-element row, bits past n cleared.
template <typename PE>
inline uint endor_bitmap_word(PE enc, uint at, uint n, uint i) {
  uint w = uint(enc[at + i]);
  uint left = n - 32 * i;
  return left >= 32 ? w : (w & ((1u << left) - 1u));
}

// Stored values of the block (every lane gets the SIMD group's total).
template <typename PE>
inline uint endor_count(PE enc, uint at, uint n, uint lane) {
  uint words = (n + 31) / 32;
  uint total = 0;
  for (uint i = lane; i < words; i += 32) {
    total += metal::popcount(endor_bitmap_word(enc, at, n, i));
  }
  return metal::simd_sum(total);
}

// Float payload values (FMT 0: float16, 1: bfloat16 = the top half of a float32, 2: float32).
template <int FMT>
struct EndorFloat {
  template <typename PE>
  static float load(PE enc, uint p, uint v) {
    uint half_bits = (uint(enc[p + v / 2]) >> (16 * (v & 1u))) & 0xFFFFu;
    return FMT == 0 ? float(as_type<half>(ushort(half_bits))) : as_type<float>(half_bits << 16);
  }
};
template <>
struct EndorFloat<2> {
  template <typename PE>
  static float load(PE enc, uint p, uint v) {
    return as_type<float>(uint(enc[p + v]));
  }
};

template <int FMT>
struct EndorPayload {
  // payload words of nnz stored values
  static uint words(uint nnz, uint group_size) {
    uint groups = (nnz + group_size - 1) / group_size;
    return endor_words((nnz * FMT + 7) / 8) + 2 * endor_words(2 * groups);
  }
  // stored value v of a payload at word p holding nnz values
  template <typename PE>
  static float value(PE enc, uint p, uint nnz, uint group_size, uint v) {
    uint bit = v * FMT;
    uint q = (uint(enc[p + bit / 32]) >> (bit % 32)) & ((1u << FMT) - 1u);
    uint groups = (nnz + group_size - 1) / group_size;
    uint s = p + endor_words((nnz * FMT + 7) / 8);
    uint k = v / group_size;
    float scale = EndorFloat<0>::load(enc, s, k);
    float bias = EndorFloat<0>::load(enc, s + endor_words(2 * groups), k);
    return float(half(scale * float(q) + bias));
  }
};

#define ENDOR_FLOAT_PAYLOAD(FMT_, BYTES)                                              \
  template <>                                                                         \
  struct EndorPayload<FMT_> {                                                         \
    static uint words(uint nnz, uint) {                                               \
      return endor_words(nnz * BYTES);                                                \
    }                                                                                 \
    template <typename PE>                                                            \
    static float value(PE enc, uint p, uint, uint, uint v) {                          \
      return EndorFloat<FMT_>::load(enc, p, v);                                       \
    }                                                                                 \
  };
ENDOR_FLOAT_PAYLOAD(0, 2)
ENDOR_FLOAT_PAYLOAD(1, 2)
ENDOR_FLOAT_PAYLOAD(2, 4)

// This lane's share of (block at word `at`) . x for an n-element row; moves `at` past the block.
// ok becomes false (and the result 0) when the block would pass `end`, the bundle's end word: a
// bitmap that disagrees with the stored bytes is never read past its bundle. All lanes of the
// SIMD group call it together (at, end, ok are the same on every lane).
template <int FMT, typename PE, typename PX>
inline float endor_lane_dot(PE enc, PX x, thread uint& at, uint end, uint n, uint group_size, uint lane,
                            thread bool& ok) {
  uint words = (n + 31) / 32;
  if (!ok || at + words > end) {
    ok = false;
    return 0.0f;
  }
  uint nnz = endor_count(enc, at, n, lane);
  uint p = at + words;
  uint next = p + EndorPayload<FMT>::words(nnz, group_size);
  if (next > end) {
    ok = false;
    return 0.0f;
  }
  float acc = 0.0f;
  uint done = 0;  // values stored in the earlier 32-word chunks
  for (uint c = 0; c < words; c += 32) {
    uint i = c + lane;
    uint word = i < words ? endor_bitmap_word(enc, at, n, i) : 0u;
    uint pc = metal::popcount(word);
    uint v = done + metal::simd_prefix_exclusive_sum(pc);
    done += metal::simd_sum(pc);
    while (word != 0u) {
      uint b = metal::ctz(word);
      acc += EndorPayload<FMT>::value(enc, p, nnz, group_size, v) * float(x[32 * i + b]);
      v++;
      word &= word - 1u;
    }
  }
  at = next;
  return acc;
}
