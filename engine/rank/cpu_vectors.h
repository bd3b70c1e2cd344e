// Vectors of floats in the machine's widest registers (GCC vector extensions: AVX512, AVX2, or
// whatever gcc vectorizes), and the bf16 <-> float32 conversions, for the engine's C++ kernels
// (engine/rank/*.cpp, built by engine/rank/cpp_library.py with this folder on the include path).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector register
#else
constexpr int W = 8;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf splat(float x) { return vf{} + x; }

// bfloat16 is float32's upper half: widening appends zeros; narrowing rounds to nearest even
struct bf16 { uint16_t bits; };
inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, bf16* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  out->bits = std::isnan(x) ? 0x7FC0 : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
// W values widened to float32
inline vf load_widened(const float* p) { return load(p); }
inline vf load_widened(const bf16* p) {
#if defined(__AVX512F__)
  // one widening of all 16 (gcc's generic conversion widened two halves and joined them)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#else
  typedef uint16_t vh __attribute__((vector_size(W * 2)));
  vh halves;
  std::memcpy(&halves, p, sizeof halves);
  const vi bits = __builtin_convertvector(halves, vi) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline float hmax(vf x) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)x);
#else
  float m = x[0];
  for (int w = 1; w < W; ++w) m = std::max(m, x[w]);
  return m;
#endif
}

inline float hsum(vf x) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)x);
#else
  float s = 0.f;
  for (int w = 0; w < W; ++w) s += x[w];
  return s;
#endif
}

// W int8 values widened to float32 (gcc's generic conversion of a byte vector ran ~10x slower)
inline vf load_int8(const int8_t* p) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const __m128i* bytes = reinterpret_cast<const __m128i*>(p);
#endif
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(bytes)));
#else
  typedef int8_t vq __attribute__((vector_size(W)));
  vq q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(q, vf);
#endif
}

// e^x in each lane: 2^n p(r) for r = x - n ln2, n = x / ln2 rounded, p Cephes' expf polynomial
// (within ~2 float ulps of e^x); x is clamped to +-88, past which e^x is no float (or 0)
inline vf exp_lanes(vf x) {
#if defined(__AVX512F__)
  // min(88, x), max(-88, x): one instruction each, and a NaN x (the second operand) stays NaN
  x = (vf)_mm512_max_ps(_mm512_set1_ps(-88.f), _mm512_min_ps(_mm512_set1_ps(88.f), (__m512)x));
#else
  x = x > 88.f ? splat(88.f) : x;
  x = x < -88.f ? splat(-88.f) : x;
#endif
  const vf shifter = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + shifter) - shifter;
  const vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
#if defined(__AVX512F__)
  return (vf)_mm512_scalef_ps((__m512)p, (__m512)n);  // p 2^n in one instruction
#endif
  // 2^n as a float's exponent field, in two factors so that n = -127 (x near -88) stays finite
  const vi half = __builtin_convertvector(n, vi) >> 1;
  const vi low = (half + 127) << 23, high = (__builtin_convertvector(n, vi) - half + 127) << 23;
  vf a, b;
  std::memcpy(&a, &low, sizeof a);
  std::memcpy(&b, &high, sizeof b);
  return p * a * b;
}

// Each lane rounded to T's precision (bf16: to nearest even, a NaN stays a NaN), as a float
template <typename T>
inline vf rounded_as(vf v);
template <>
inline vf rounded_as<float>(vf v) { return v; }
template <>
inline vf rounded_as<bf16>(vf v) {
  typedef uint32_t vu __attribute__((vector_size(W * 4)));
  vu bits;
  std::memcpy(&bits, &v, sizeof bits);
  const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  vf out;
  std::memcpy(&out, &rounded, sizeof out);
  // a NaN as torch rounds it (0x7FC0): the NaN itself could lose its payload's bits to the
  // truncation in store_rounded and read as an infinity
  return v != v ? splat(NAN) : out;
}

// W floats already rounded to T's precision (rounded_as<T>) stored as T: a bf16 is the upper half
inline void store_rounded(float* p, vf v) { store(p, v); }
inline void store_rounded(bf16* p, vf v) {
  typedef uint32_t vu __attribute__((vector_size(W * 4)));
  typedef uint16_t vh __attribute__((vector_size(W * 2)));
  vu bits;
  std::memcpy(&bits, &v, sizeof bits);
  const vh halves = __builtin_convertvector(bits >> 16, vh);
  std::memcpy(p, &halves, sizeof halves);
}

// W floats stored as T (bf16: rounded to nearest even)
inline void store_narrowed(float* p, vf v) { store(p, v); }
inline void store_narrowed(bf16* p, vf v) { store_rounded(p, rounded_as<bf16>(v)); }
