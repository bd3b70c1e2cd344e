// One row's RMSNorm with the residual add, one head's RoPE, one row's SiLU·mul, each rounding
// where engine/rank/ops.py's torch code rounds: the kernels of engine/rank/layer_ops.cpp's ops,
// and of the quantized decode layers (engine/rank/quantized_rows.cpp).
#pragma once
#include <cmath>
#include <cstdint>

#include "cpu_vectors.h"

// x + residual (rounded to T, as torch's add in T) into `sum`; RMSNorm of it times the weight
// into `out`: rows of d contiguous values. `sum` may be `residual` (in place).
template <typename T>
void add_rmsnorm_row(const T* x, const T* residual, const T* weight, T* out, T* sum, int64_t d,
                     float eps) {
  vf squares = splat(0.f);
  float tail = 0.f;
  int64_t j = 0;
  for (; j + W <= d; j += W) {
    const vf s = rounded_as<T>(load_widened(x + j) + load_widened(residual + j));
    store_rounded(sum + j, s);
    squares += s * s;
  }
  for (; j < d; ++j) {
    T s;
    narrow(widen(x[j]) + widen(residual[j]), &s);
    sum[j] = s;
    tail += widen(s) * widen(s);
  }
  const float inv = 1.f / std::sqrt((hsum(squares) + tail) / static_cast<float>(d) + eps);
  // torch: weight * (h * inv).to(T): the normed value rounds to T before the weight's product
  for (j = 0; j + W <= d; j += W) {
    const vf normed = rounded_as<T>(load_widened(sum + j) * inv);
    store_narrowed(out + j, load_widened(weight + j) * normed);
  }
  for (; j < d; ++j) {
    T normed;
    narrow(widen(sum[j]) * inv, &normed);
    narrow(widen(weight[j]) * widen(normed), out + j);
  }
}

// (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) of one head of d = 2 half values, c and s the
// position's cos/sin rows [half]; `out` may be `x` (in place)
template <typename T>
void rotate_head(const T* x, const float* c, const float* s, T* out, int64_t half) {
  int64_t j = 0;
  for (; j + W <= half; j += W) {
    const vf x1 = load_widened(x + j), x2 = load_widened(x + half + j);
    const vf cj = load(c + j), sj = load(s + j);
    store_narrowed(out + j, x1 * cj - x2 * sj);
    store_narrowed(out + half + j, x2 * cj + x1 * sj);
  }
  for (; j < half; ++j) {
    const float x1 = widen(x[j]), x2 = widen(x[half + j]);
    narrow(x1 * c[j] - x2 * s[j], out + j);
    narrow(x2 * c[j] + x1 * s[j], out + half + j);
  }
}

// SiLU(gate) rounded to T (torch's silu in T), times up
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vf g = load_widened(gate + j);
    const vf silu = rounded_as<T>(g / (1.f + exp_lanes(-g)));
    store_narrowed(out + j, silu * load_widened(up + j));
  }
  for (; j < n; ++j) {
    const float g = widen(gate[j]);
    T silu;
    narrow(g / (1.f + std::exp(-g)), &silu);
    narrow(widen(silu) * widen(up[j]), out + j);
  }
}
