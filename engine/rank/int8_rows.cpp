// A few rows' product with a weight held as int8 codes and one scale per output channel
// (weights="int8", and the LM head of every quantized mode): y[r][n] = s[n] sum_k x[r][k] q[n][k]
// for rows r < 4. Decode steps run it: their rows are few, so the product streams the codes once
// and is bound by reading them, and each code is widened in registers and used by every row.
// float32 or bfloat16 x, s and y; float32 sums. Built and loaded by engine/rank/int8_rows.py.
#include <cstdint>
#include <new>
#include <vector>

#include <omp.h>

#include "cpu_vectors.h"

namespace {

template <typename T>
struct RowsProblem {
  const float* x;  // [rows][k], widened
  const int8_t* codes;  // [n][k]
  const T* scales;      // [n]
  T* y;                 // [rows][n]
  int64_t n, k;
};

template <typename T, int R>
void rows_product(const RowsProblem<T>& p, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t o = 0; o < p.n; ++o) {
    const int8_t* codes = p.codes + o * p.k;
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = splat(0.f);
    for (int64_t i = 0; i < p.k; i += W) {
      const vf w = load_int8(codes + i);
      for (int r = 0; r < R; ++r) acc[r] += load(p.x + r * p.k + i) * w;
    }
    const float scale = widen(p.scales[o]);
    for (int r = 0; r < R; ++r) narrow(hsum(acc[r]) * scale, p.y + r * p.n + o);
  }
}

template <typename T>
int rows_any(const T* x, int64_t x_stride, int64_t rows, const int8_t* codes, const T* scales,
             T* y, int64_t n, int64_t k, int threads) {
  if (k % W != 0) return 1;
  std::vector<float> widened(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) widened[r * k + i] = widen(x[r * x_stride + i]);
  const RowsProblem<T> p{widened.data(), codes, scales, y, n, k};
  switch (rows) {
    case 1: rows_product<T, 1>(p, threads); return 0;
    case 2: rows_product<T, 2>(p, threads); return 0;
    case 3: rows_product<T, 3>(p, threads); return 0;
    case 4: rows_product<T, 4>(p, threads); return 0;
    default: return 1;
  }
}

}  // namespace

// x [rows][k] (rows `x_stride` apart), codes [n][k], scales [n], y [rows][n] contiguous, of
// float32 (`bfloat16` 0) or bfloat16 (1). Returns 0: done; 1: rows not in 1..4 or k not a
// multiple of the vector width; 2: out of memory.
extern "C" int int8_rows_product(const void* x, int64_t x_stride, int64_t rows,
                                 const int8_t* codes, const void* scales, void* y, int64_t n,
                                 int64_t k, int bfloat16, int threads) {
  try {
    if (bfloat16)
      return rows_any(static_cast<const bf16*>(x), x_stride, rows, codes,
                      static_cast<const bf16*>(scales), static_cast<bf16*>(y), n, k, threads);
    return rows_any(static_cast<const float*>(x), x_stride, rows, codes,
                    static_cast<const float*>(scales), static_cast<float*>(y), n, k, threads);
  } catch (const std::bad_alloc&) {
    return 2;
  }
}
