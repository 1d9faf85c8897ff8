// The activations' quantization our quantized products share: one row's block of 32 floats ->
// 32 int8 in [-127, 127] (d = max |x| / 127, rounded to nearest even, as llama.cpp quantizes them
// for these formats) and the block's sum as quantized, d * sum(q) (llama.cpp's Q8_1 `s`, Q8_K's
// bsums): a weight's min then multiplies the same activations its scaled values do, so the
// quantization errors of a centred block cancel (with the float sum of x instead, a Q4_1 file's
// perplexity was 1.8% above its exact products', llama.cpp's 0.3%). One fixed sequence of
// operations: a block's bits depend on its values alone, so every part of a product (block_gemm.cpp)
// sees the same.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "vec.h"

namespace {

// One row's block of 32 floats -> 32 int8 in [-127, 127], the scale d and d * sum(q).
inline void quantize_block(const float* p, int8_t* q, float* d, float* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
    const __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    const float mx = hmax8(a);
    *d = mx / 127.0f;
    const __m256 mul = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
    __m256i r = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    r = _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo packs' lane interleave
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), r);
    int32_t sum = 0;  // exact
    for (int i = 0; i < 32; ++i) sum += q[i];
    *s = *d * static_cast<float>(sum);
}

}  // namespace
