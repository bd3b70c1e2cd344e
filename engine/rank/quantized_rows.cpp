// Decode's products with quantized weights (weights="int8" | "int4" | "gguf"): a few rows x (r < 4)
// times a weight held as integer codes. Decode steps run them: their rows are few, so a product
// streams the codes once and is bound by reading them; each code is widened in registers and used
// by every row. float32 or bfloat16 x, scales and y; float32 sums. Built against torch and loaded
// by engine/rank/quantized_rows.py, which declares the ops prefill::int8_rows and
// prefill::q4_rows; register_ops() gives them these CPU kernels. Called straight from torch's
// dispatcher, eagerly or from a compiled graph: through ctypes and a Python op each call cost
// several us more, and a decode step makes ~120 of them.
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
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include "cpu_vectors.h"
#include "torch_ops.h"

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
void rows_any(const T* x, int64_t x_stride, int64_t rows, const int8_t* codes, const T* scales,
              T* y, int64_t n, int64_t k, int threads) {
  std::vector<float> widened(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) widened[r * k + i] = widen(x[r * x_stride + i]);
  const RowsProblem<T> p{widened.data(), codes, scales, y, n, k};
  switch (rows) {
    case 1: return rows_product<T, 1>(p, threads);
    case 2: return rows_product<T, 2>(p, threads);
    case 3: return rows_product<T, 3>(p, threads);
    default: return rows_product<T, 4>(p, threads);
  }
}


#if defined(__AVX2__)
constexpr int GROUP = 32;  // inputs per Q4 group

// x rounded to int16 per group: xq [rows][k], each group's step [rows][groups] and float sum
struct RoundedRows {
  std::vector<int16_t> xq;
  std::vector<float> step, sum;
};

// 8 values widened to float32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
}

inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// One group of 32 inputs rounded to int16 (nearest, ties to even) on the step max|x| / 32767;
// returns (step, sum). A NaN or infinite input makes the step NaN, so the outputs it feeds are
// NaN, as a float product's would be, never a silently finite number.
template <typename T>
inline void round_group(const T* x, int16_t* xq, float* step, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], largest = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  const float most = lanes_max(largest);
  *sum = lanes_sum(total);
  *step = std::isfinite(most) && !std::isnan(*sum) ? most / 32767.f : NAN;
  // 32767 / most overflows for a group below ~1e-34: such values are scaled up by 2^64 first
  const float lift = most < 1e-30f ? 0x1p64f : 1.f;
  const float inverse = most > 0.f && std::isfinite(most) ? 32767.f / (most * lift) : 0.f;
  const __m256 up = _mm256_set1_ps(lift), by = _mm256_set1_ps(inverse);
  for (int i = 0; i < 4; i += 2) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[i], up), by));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[i + 1], up), by));
    // packs interleaves 128-bit halves (a0-3 b0-3 a4-7 b4-7): the permute puts them in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 8 * i), packed);
  }
}

// The caller thread's buffers, kept from call to call: a decode step makes ~120 calls, each
// too short to pay for fresh allocations.
template <typename T>
const RoundedRows& round_rows(const T* x, int64_t x_stride, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP;
  thread_local RoundedRows out;
  out.xq.resize(rows * k);
  out.step.resize(rows * groups);
  out.sum.resize(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      round_group(x + r * x_stride + g * GROUP, &out.xq[r * k + g * GROUP],
                  &out.step[r * groups + g], &out.sum[r * groups + g]);
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
    const __m256i dot = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), low, x_low), high, x_high);
#else
    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(low, x_low),
                                         _mm256_madd_epi16(high, x_high));
#endif
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[r * groups]), acc[r]);
  }
}

template <typename T, int R>
void q4_product(const Q4Problem<T>& p, int threads) {
  const int64_t n = p.n, k = p.k, groups = k / GROUP;
  const int16_t* const xq = p.x->xq.data();
  const float *const step = p.x->step.data(), *const sum = p.x->sum.data();
#pragma omp parallel num_threads(threads)
  {
    thread_local std::vector<float> buffer;
    buffer.resize(R * groups);
    float* const scale = buffer.data();  // a thread_local is found through a call, once
#pragma omp for schedule(static)
    for (int64_t o = 0; o < n; ++o) {
      const uint8_t* codes = p.codes + o * (k / 2);
      float shift[R];
      for (int r = 0; r < R; ++r)
        shift[r] = output_scales(p.d + o * groups, p.m + o * groups, step + r * groups,
                                 sum + r * groups, groups, scale + r * groups);
      // even and odd groups sum apart: two chains of adds instead of one
      __m256 even[R], odd[R];
      for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 2 <= groups; g += 2) {
        q4_group<R>(codes + g * 16, xq + g * GROUP, k, scale + g, groups, even);
        q4_group<R>(codes + g * 16 + 16, xq + g * GROUP + GROUP, k, scale + g + 1, groups, odd);
      }
      if (g < groups) q4_group<R>(codes + g * 16, xq + g * GROUP, k, scale + g, groups, even);
      for (int r = 0; r < R; ++r)
        narrow(lanes_sum(_mm256_add_ps(even[r], odd[r])) + shift[r], p.y + r * n + o);
    }
  }
}

template <typename T>
void q4_any(const T* x, int64_t x_stride, int64_t rows, const uint8_t* codes, const T* d,
            const T* m, T* y, int64_t n, int64_t k, int threads) {
  const RoundedRows& rounded = round_rows(x, x_stride, rows, k);
  const Q4Problem<T> p{&rounded, codes, d, m, y, n, k};
  switch (rows) {
    case 1: return q4_product<T, 1>(p, threads);
    case 2: return q4_product<T, 2>(p, threads);
    case 3: return q4_product<T, 3>(p, threads);
    default: return q4_product<T, 4>(p, threads);
  }
}
#endif

constexpr int64_t MOST_ROWS = 4;

// x as the kernels read it: rows of the weight's dtype, each row's inputs contiguous
at::Tensor rows_of(const at::Tensor& x, at::ScalarType dtype, int64_t k, int64_t multiple,
                   const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) <= MOST_ROWS && x.size(1) == k && k % multiple == 0,
                    op, ": x ", x.sizes(), " for a weight of ", k, " inputs; it takes 1-",
                    MOST_ROWS, " rows of a multiple of ", multiple);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16 "
              "scales, got ", dtype);
  return x.scalar_type() == dtype && x.stride(1) == 1 ? x : x.to(dtype).contiguous();
}

at::Tensor int8_rows(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar &&
              scales.is_contiguous() && scales.numel() == codes.size(0),
              "int8_rows: codes [n, k] int8 and scales [n], contiguous");
  const int64_t n = codes.size(0), k = codes.size(1);
  const at::Tensor x = rows_of(x_in, scales.scalar_type(), k, W, "int8_rows");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const int threads = at::get_num_threads();
  if (x.scalar_type() == at::kBFloat16)
    rows_any(static_cast<const bf16*>(x.data_ptr()), x.stride(0), x.size(0),
             codes.const_data_ptr<int8_t>(), static_cast<const bf16*>(scales.data_ptr()),
             static_cast<bf16*>(y.data_ptr()), n, k, threads);
  else
    rows_any(x.const_data_ptr<float>(), x.stride(0), x.size(0), codes.const_data_ptr<int8_t>(),
             scales.const_data_ptr<float>(), y.mutable_data_ptr<float>(), n, k, threads);
  return y;
}

at::Tensor q4_rows(const at::Tensor& x_in, const at::Tensor& nibbles, const at::Tensor& steps) {
  const int64_t n = nibbles.size(0), k = 2 * nibbles.size(1);
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.is_contiguous() &&
              nibbles.scalar_type() == at::kByte && steps.is_contiguous() &&
              steps.numel() == 2 * n * (k / 32),
              "q4_rows: nibbles [n, k/2] uint8 and steps [2, n, k/32, 1], contiguous");
#if defined(__AVX2__)
  const at::Tensor x = rows_of(x_in, steps.scalar_type(), k, GROUP, "q4_rows");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const int threads = at::get_num_threads();
  const int64_t half = n * (k / GROUP);  // steps[1]: each group's m, after every d
  if (x.scalar_type() == at::kBFloat16) {
    const bf16* d = static_cast<const bf16*>(steps.data_ptr());
    q4_any(static_cast<const bf16*>(x.data_ptr()), x.stride(0), x.size(0),
           nibbles.const_data_ptr<uint8_t>(), d, d + half, static_cast<bf16*>(y.data_ptr()), n,
           k, threads);
  } else {
    const float* d = steps.const_data_ptr<float>();
    q4_any(x.const_data_ptr<float>(), x.stride(0), x.size(0), nibbles.const_data_ptr<uint8_t>(),
           d, d + half, y.mutable_data_ptr<float>(), n, k, threads);
  }
  return y;
#else
  TORCH_CHECK_NOT_IMPLEMENTED(false, "q4_rows: not built for this CPU (it needs AVX2)");
#endif
}

}  // namespace

// 1 where this build has the int4 product (an AVX2 CPU or better), else 0.
extern "C" int q4_rows_supported() {
#if defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// The ops' CPU kernels (engine/rank/quantized_rows.py calls this after loading the library; a
// build loaded only to be looked at registers nothing). 0: done; 1: registering threw.
extern "C" int register_ops() {
  return register_cpu_kernels([](torch::Library& library) {
    library.impl("int8_rows", TORCH_FN(int8_rows));
    library.impl("q4_rows", TORCH_FN(q4_rows));
  });
}
