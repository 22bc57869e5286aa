// Helpers of the sparse FFN kernels (the `header` of sparse_up.metal and sparse_down.metal).
//
// Weights are MLX's: float16/bfloat16 rows (BITS 0), or affine-quantized rows (BITS 4 or 8):
// w = scale * q + bias per group of `group_size` values along the row, q packed little-endian in
// uint32 words (32 / BITS values per word, value v in bits [v*BITS, (v+1)*BITS)).
// Pointers are template parameters: an input of fewer than 8 elements arrives in the `constant`
// address space, a larger one in `device`.

// Dot product of row r with x over one lane's share of the row (words lane, lane + 32, ...).
template <int BITS>
struct RowDot {
  template <typename PW, typename PS, typename PX>
  static float lane_dot(PW w, PS scales, PS biases, PX x, uint r, uint K, uint group_size, uint lane) {
    const uint per_word = 32 / BITS;
    const uint words = K / per_word;
    const uint groups = K / group_size;
    const uint mask = (1u << BITS) - 1u;
    float acc = 0.0f;
    for (uint i = lane; i < words; i += 32) {
      uint q = uint(w[r * words + i]);
      uint k0 = i * per_word;
      float qx = 0.0f;
      float xs = 0.0f;
      for (uint v = 0; v < per_word; v++) {
        float xv = float(x[k0 + v]);
        qx += float((q >> (v * BITS)) & mask) * xv;
        xs += xv;
      }
      uint g = r * groups + k0 / group_size;
      acc += float(scales[g]) * qx + float(biases[g]) * xs;
    }
    return acc;
  }
};

template <>
struct RowDot<0> {
  template <typename PW, typename PS, typename PX>
  static float lane_dot(PW w, PS, PS, PX x, uint r, uint K, uint, uint lane) {
    float acc = 0.0f;
    for (uint k = lane; k < K; k += 32) {
      acc += float(w[r * K + k]) * float(x[k]);
    }
    return acc;
  }
};

// acc[0 .. values per lane) += sum over rows j = first, first + step, ... < count of
// h[j] * row ids[j] (or row j) at this lane's columns: one uint32 word (quantized) or 4 values.
template <int BITS>
struct RowAxpy {
  template <typename PW, typename PS, typename PH, typename PI>
  static void accumulate(thread float* acc, PW w, PS scales, PS biases, PH h, PI ids, bool use_ids, uint count,
                         uint D, uint group_size, uint pack, uint first, uint step) {
    const uint per_word = 32 / BITS;
    const uint words = D / per_word;
    const uint groups = D / group_size;
    const uint mask = (1u << BITS) - 1u;
    if (pack >= words) {
      return;
    }
    for (uint j = first; j < count; j += step) {
      float hv = float(h[j]);
      if (hv == 0.0f) {
        continue;  // a masked neuron: its row is not read
      }
      uint r = use_ids ? uint(ids[j]) : j;
      uint q = uint(w[r * words + pack]);
      uint g = r * groups + (pack * per_word) / group_size;
      float sc = float(scales[g]) * hv;
      float bi = float(biases[g]) * hv;
      for (uint v = 0; v < per_word; v++) {
        acc[v] += sc * float((q >> (v * BITS)) & mask) + bi;
      }
    }
  }
};

template <>
struct RowAxpy<0> {
  template <typename PW, typename PS, typename PH, typename PI>
  static void accumulate(thread float* acc, PW w, PS, PS, PH h, PI ids, bool use_ids, uint count, uint D, uint,
                         uint pack, uint first, uint step) {
    const uint d0 = pack * 4;
    if (d0 >= D) {
      return;
    }
    for (uint j = first; j < count; j += step) {
      float hv = float(h[j]);
      if (hv == 0.0f) {
        continue;
      }
      uint r = use_ids ? uint(ids[j]) : j;
      for (uint v = 0; v < 4 && d0 + v < D; v++) {
        acc[v] += hv * float(w[r * D + d0 + v]);
      }
    }
  }
};
