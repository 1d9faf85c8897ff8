// Vector helpers shared by our CPU kernels (AVX2 + FMA): each is a fixed sequence of operations,
// so a value's bits depend on its inputs alone, never on how a loop around it is vectorized.
#pragma once
#include <immintrin.h>

namespace {

// Horizontal reductions of 8 floats in one fixed order: halves, then pairs, then the last two.
template <__m128 (*Op)(__m128, __m128), __m128 (*Last)(__m128, __m128)>
inline float hreduce(__m256 v) {
    __m128 s = Op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = Op(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(Last(s, _mm_movehdup_ps(s)));
}
inline __m128 add4(__m128 a, __m128 b) { return _mm_add_ps(a, b); }
inline __m128 add1(__m128 a, __m128 b) { return _mm_add_ss(a, b); }
inline __m128 max4(__m128 a, __m128 b) { return _mm_max_ps(a, b); }
inline __m128 max1(__m128 a, __m128 b) { return _mm_max_ss(a, b); }
inline float hsum(__m256 v) { return hreduce<add4, add1>(v); }
inline float hmax8(__m256 v) { return hreduce<max4, max1>(v); }

// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6
// polynomial (Cephes' expf coefficients), times 2^n built in the exponent bits. Below -87 it
// returns 0, as the true value is below float32's normal range.
inline __m256 exp_nonpositive(__m256 x) {
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 low = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
    r = _mm256_fnmadd_ps(n, ln2_lo, r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

}  // namespace
