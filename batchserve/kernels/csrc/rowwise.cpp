// Row-wise ops of a decoder layer in one call each, where torch takes several (each call costs
// microseconds of dispatch, most of a one-row step's time outside the products): the residual
// add with RMSNorm, silu(gate) * up, and rotary. Each row (and head) is computed by one thread
// in one fixed order, so its bits never depend on the other rows or the thread count.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <cmath>

#include "vec.h"

extern "C" {

// summed = x + residual (where residual is given), normed = summed / sqrt(mean(summed^2) + eps) * weight,
// for rows of H values (H % 8 == 0). `summed` may be null without a residual.
void bs_rms_norm(const float* x, const float* residual, const float* weight, int64_t T, int64_t H, float eps,
                 float* normed, float* summed, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; ++t) {
        const float* xr = x + t * H;
        float* s = summed != nullptr ? summed + t * H : nullptr;
        __m256 sq = _mm256_setzero_ps();
        for (int64_t c = 0; c < H; c += 8) {
            __m256 v = _mm256_loadu_ps(xr + c);
            if (residual != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + t * H + c));
            if (s != nullptr) _mm256_storeu_ps(s + c, v);
            sq = _mm256_fmadd_ps(v, v, sq);
        }
        const float inv = 1.0f / std::sqrt(hsum(sq) / static_cast<float>(H) + eps);
        const __m256 scale = _mm256_set1_ps(inv);
        const float* src = s != nullptr ? s : xr;
        for (int64_t c = 0; c < H; c += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + c), scale);
            _mm256_storeu_ps(normed + t * H + c, _mm256_mul_ps(v, _mm256_loadu_ps(weight + c)));
        }
    }
}

namespace {

// sigmoid(v) from exp(-|v|) (our polynomial), so both signs take the same path.
inline __m256 sigmoid(__m256 v) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp_nonpositive(_mm256_or_ps(v, _mm256_set1_ps(-0.0f)));  // exp(-|v|)
    const __m256 positive = _mm256_div_ps(one, _mm256_add_ps(one, e));  // sigmoid(|v|)
    const __m256 negative = _mm256_div_ps(e, _mm256_add_ps(one, e));  // sigmoid(-|v|)
    return _mm256_blendv_ps(positive, negative, v);  // by v's sign bit
}

}  // namespace

// out [T, I] = silu(gate) * up for gate|up [T, 2I] (I % 8 == 0); silu(g) = g * sigmoid(g).
void bs_silu_mul(const float* gate_up, int64_t T, int64_t I, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; ++t) {
        const float* g = gate_up + t * 2 * I;
        for (int64_t c = 0; c < I; c += 8) {
            const __m256 v = _mm256_loadu_ps(g + c);
            _mm256_storeu_ps(out + t * I + c, _mm256_mul_ps(_mm256_mul_ps(v, sigmoid(v)), _mm256_loadu_ps(g + I + c)));
        }
    }
}

// gpt-oss's experts' activation: out [T, I] = (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha g)),
// g = min(gate, limit), for gate|up [T, 2I] (I % 8 == 0), in transformers' order of operations. A
// NaN stays NaN, as through torch's clamp (min/max return their second operand on a NaN).
void bs_clamped_swiglu(const float* gate_up, int64_t T, int64_t I, float alpha, float limit, float* out,
                       int threads) {
    const __m256 a = _mm256_set1_ps(alpha), hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; ++t) {
        const float* row = gate_up + t * 2 * I;
        for (int64_t c = 0; c < I; c += 8) {
            const __m256 g = _mm256_min_ps(hi, _mm256_loadu_ps(row + c));
            const __m256 u = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(row + I + c)));
            const __m256 glu = _mm256_mul_ps(g, sigmoid(_mm256_mul_ps(g, a)));
            _mm256_storeu_ps(out + t * I + c, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
        }
    }
}

// out [heads, T, D] (contiguous) = x * cos + swap(x) * sin for x [heads, T, D] (any head and row
// strides, unit stride in a row), swap: the row's halves exchanged, sin carrying the rotation's
// sign (Rotary's tables). The same arithmetic as torch's x.roll(D/2) * sin + x * cos, so the same bits.
void bs_rotary(const float* x, int64_t heads, int64_t T, int64_t D, int64_t x_head, int64_t x_row, const float* cos,
               const float* sin, float* out, int threads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (heads * T > 8)
    for (int64_t i = 0; i < heads * T; ++i) {
        const int64_t h = i / T, t = i % T;
        const float* xr = x + h * x_head + t * x_row;
        const float* c = cos + t * D;
        const float* s = sin + t * D;
        float* o = out + i * D;
        for (int64_t d = 0; d < D; d += 8) {
            const int64_t from = d < half ? d + half : d - half;
            const __m256 swapped = _mm256_mul_ps(_mm256_loadu_ps(xr + from), _mm256_loadu_ps(s + d));
            const __m256 direct = _mm256_mul_ps(_mm256_loadu_ps(xr + d), _mm256_loadu_ps(c + d));
            _mm256_storeu_ps(o + d, _mm256_add_ps(swapped, direct));
        }
    }
}

}  // extern "C"
