// Decode's products with quantized weights (weights="int8" | "int4" | "gguf"): a few rows x (r < 4)
// times a weight held as integer codes. Decode steps run them: their rows are few, so a product
// streams the codes once and is bound by reading them; each code is widened in registers and used
// by every row. float32 or bfloat16 x, scales and y; float32 sums. Built and loaded by
// engine/rank/quantized_rows.py.
//
// int8 (weights="int8", and the LM head of every mode): codes [n][k], one scale per output
// channel: y[r][n] = s[n] sum_k x[r][k] q[n][k].
//
// int4 (weights="int4" | "gguf"): GGUF's Q4 blocks, 32 inputs a group. codes [n][k/2]: a group's
// 16 bytes hold its code i in the low nibble of byte i and code i + 16 in the high one; d and m
// [n][k/32]: w = d q + m. Each row of x is rounded to int16 per group of 32 (step e = max|x| /
// 32767: an error of at most e/2, 2^-16 of the group's largest value), so a group's 32 products
// are integer multiply-adds (AVX2 vpmaddwd, AVX512-VNNI vpdpwssd); their sum is scaled by d e, and
// m multiplies the group's float sum of x. Needs AVX2 (q4_rows_supported says so).
#include <algorithm>
#include <cmath>
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


#if defined(__AVX2__)
constexpr int GROUP = 32;  // inputs per Q4 group

// x rounded to int16 per group: xq [rows][k], each group's step [rows][groups] and float sum
struct RoundedRows {
  std::vector<int16_t> xq;
  std::vector<float> step, sum;
};

template <typename T>
RoundedRows round_rows(const T* x, int64_t x_stride, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP;
  RoundedRows out{std::vector<int16_t>(rows * k), std::vector<float>(rows * groups),
                  std::vector<float>(rows * groups)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float v[GROUP], largest = 0.f, sum = 0.f;
      for (int i = 0; i < GROUP; ++i) {
        v[i] = widen(x[r * x_stride + g * GROUP + i]);
        largest = std::max(largest, std::fabs(v[i]));
        sum += v[i];
      }
      const float inverse = largest > 0.f ? 32767.f / largest : 0.f;
      for (int i = 0; i < GROUP; ++i)
        out.xq[r * k + g * GROUP + i] = static_cast<int16_t>(std::lrintf(v[i] * inverse));
      out.step[r * groups + g] = largest / 32767.f;
      out.sum[r * groups + g] = sum;
    }
  return out;
}

template <typename T>
struct Q4Problem {
  const RoundedRows* x;
  const uint8_t* codes;  // [n][k/2]
  const T *d, *m;        // [n][k/32]
  T* y;                  // [rows][n]
  int64_t n, k;
};

// One output's group scales d e into `scale` [groups]; returns sum_g m_g (sum of x over g).
template <typename T>
float output_scales(const T* d, const T* m, const float* step, const float* sum, int64_t groups,
                    float* scale) {
  vf shift = splat(0.f);
  int64_t g = 0;
  for (; g + W <= groups; g += W) {
    store(scale + g, load_widened(d + g) * load(step + g));
    shift += load_widened(m + g) * load(sum + g);
  }
  float total = hsum(shift);
  for (; g < groups; ++g) {
    scale[g] = widen(d[g]) * step[g];
    total += widen(m[g]) * sum[g];
  }
  return total;
}

// One group's 16 code bytes against R rows' 32 int16 inputs, into acc[r] (8 float lanes).
template <int R>
inline void q4_group(const uint8_t* codes, const int16_t* xq, int64_t k, const float* scale,
                     int64_t groups, __m256* acc) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
  const __m256i high = _mm256_srli_epi16(bytes, 4);
  for (int r = 0; r < R; ++r) {
    const __m256i* x = reinterpret_cast<const __m256i*>(xq + r * k);
    const __m256i x_low = _mm256_loadu_si256(x), x_high = _mm256_loadu_si256(x + 1);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i dot = _mm256_dpwssd_epi32(_mm256_madd_epi16(low, x_low), high, x_high);
#else
    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(low, x_low),
                                         _mm256_madd_epi16(high, x_high));
#endif
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[r * groups]), acc[r]);
  }
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

template <typename T, int R>
void q4_product(const Q4Problem<T>& p, int threads) {
  const int64_t groups = p.k / GROUP;
  const RoundedRows& x = *p.x;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scale(R * groups);
#pragma omp for schedule(static)
    for (int64_t o = 0; o < p.n; ++o) {
      const uint8_t* codes = p.codes + o * (p.k / 2);
      float shift[R];
      for (int r = 0; r < R; ++r)
        shift[r] = output_scales(p.d + o * groups, p.m + o * groups, &x.step[r * groups],
                                 &x.sum[r * groups], groups, &scale[r * groups]);
      // even and odd groups sum apart: two chains of adds instead of one
      __m256 even[R], odd[R];
      for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 2 <= groups; g += 2) {
        q4_group<R>(codes + g * 16, &x.xq[g * GROUP], p.k, &scale[g], groups, even);
        q4_group<R>(codes + g * 16 + 16, &x.xq[g * GROUP + GROUP], p.k, &scale[g + 1], groups, odd);
      }
      if (g < groups) q4_group<R>(codes + g * 16, &x.xq[g * GROUP], p.k, &scale[g], groups, even);
      for (int r = 0; r < R; ++r)
        narrow(sum_lanes(_mm256_add_ps(even[r], odd[r])) + shift[r], p.y + r * p.n + o);
    }
  }
}

template <typename T>
int q4_any(const T* x, int64_t x_stride, int64_t rows, const uint8_t* codes, const T* d,
           const T* m, T* y, int64_t n, int64_t k, int threads) {
  if (k % GROUP != 0) return 1;
  const RoundedRows rounded = round_rows(x, x_stride, rows, k);
  const Q4Problem<T> p{&rounded, codes, d, m, y, n, k};
  switch (rows) {
    case 1: q4_product<T, 1>(p, threads); return 0;
    case 2: q4_product<T, 2>(p, threads); return 0;
    case 3: q4_product<T, 3>(p, threads); return 0;
    case 4: q4_product<T, 4>(p, threads); return 0;
    default: return 1;
  }
}
#endif

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

// 1 where this build has the int4 product (an AVX2 CPU or better), else 0.
extern "C" int q4_rows_supported() {
#if defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// x [rows][k] (rows `x_stride` apart), codes [n][k/2], d and m [n][k/32], y [rows][n]
// contiguous, of float32 (`bfloat16` 0) or bfloat16 (1). Returns 0: done; 1: rows not in 1..4
// or k not a multiple of 32; 2: out of memory; 3: not built here (no AVX2).
extern "C" int q4_rows_product(const void* x, int64_t x_stride, int64_t rows,
                               const uint8_t* codes, const void* d, const void* m, void* y,
                               int64_t n, int64_t k, int bfloat16, int threads) {
#if defined(__AVX2__)
  try {
    if (bfloat16)
      return q4_any(static_cast<const bf16*>(x), x_stride, rows, codes,
                    static_cast<const bf16*>(d), static_cast<const bf16*>(m),
                    static_cast<bf16*>(y), n, k, threads);
    return q4_any(static_cast<const float*>(x), x_stride, rows, codes,
                  static_cast<const float*>(d), static_cast<const float*>(m),
                  static_cast<float*>(y), n, k, threads);
  } catch (const std::bad_alloc&) {
    return 2;
  }
#else
  return 3;
#endif
}
