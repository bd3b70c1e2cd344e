// engine/rank/cpu_vectors.h's vector helpers, exported one array at a time for
// tests/test_cpu_vectors.py (n: a multiple of W, the floats per vector register).
#include "../engine/rank/cpu_vectors.h"

extern "C" int lanes_per_vector() { return W; }

// out[i] = e^x[i], W lanes at a time
extern "C" int exp_of(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) store(out + i, exp_lanes(load(x + i)));
  return 0;
}

// rounded[i]: x[i] rounded to bf16's precision, as a float; stored[i]: its bf16 bits
extern "C" int bf16_of(const float* x, float* rounded, uint16_t* stored, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) {
    store(rounded + i, rounded_as<bf16>(load(x + i)));
    store_narrowed(reinterpret_cast<bf16*>(stored + i), load(x + i));
  }
  return 0;
}
