// Products over a GGUF file's own quantized blocks for 1 to a few hundred rows, reading each
// weight block once per call: Q4_1 (d, m and 32 4-bit values per block) for the layers and
// Q8_0 (d and 32 int8 values) for the LM head. Activations are quantized per row and per block
// of 32 to int8 (scale = max |x| / 127), as llama.cpp does for these formats.
//
// Batch invariance: an output element is computed by one thread, in one fixed order of
// operations, from its row's activations and its column's weights only. The row count, the
// row's place in the call and the thread count decide which thread and which tile computes
// it, never how. Float contraction is off: every FMA below is written out.
//
// Weight layout (a permutation of the file's bytes; the values, scales and mins are the file's):
// 8 output columns form a group; within a group and block, step s (k = 4s .. 4s+3 of the
// block) is 32 bytes, byte 4j + r holding column j's value at k = 4s + r. That is the operand
// layout of vpmaddubsw against 4 bytes of one activation row broadcast to every lane, so a
// column's partial sums stay in their own lane and no horizontal sum is ever needed.
//   Q4_1: nibbles [N/8, K/32, 4, 32]: byte i of chunk p is step 2p's value | step 2p+1's << 4;
//         d, m [N/8, K/32, 8] float16.
//   Q8_0: values [N/8, K/32, 8, 32] int8; d [N/8, K/32, 8] float16.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <vector>

#include "quantize.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the quantized-product kernels need AVX2, FMA and F16C"
#endif
// With AVX512-VNNI, vpdpbusd sums 4 byte products into int32 lanes in one instruction where AVX2
// takes vpmaddubsw and vpmaddwd. The integer sums are exact either way, so both paths give every
// output the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BS_VNNI 1
#endif
// With AVX-512 (F, BW, VNNI) a tile spans two column groups in one 512-bit register, and 8 rows (4 for Q8_0):
// each unpacked weight and each broadcast activation serve twice the columns, and twice the rows
// share each unpacked weight, so an extra row costs about half the instructions. Every lane does
// the 256-bit path's operations in its order (exact integer sums, then the same float steps), so a
// column has the same bits whichever path or tile computes it.
#if defined(BS_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define BS_WIDE 1
#endif

namespace {

constexpr int64_t QK = 32;   // values per block
constexpr int kRowTile = 4;  // rows a tile computes at once
constexpr int kGroups = 1;   // column groups (of 8) a tile computes at once

struct Rows {         // a call's activations, quantized
    const int8_t* q;  // [T, K]
    const float* d;   // [T, K/32] scales
    const float* s;   // [T, K/32] quantized sums d * sum(q) (Q4_1's min term)
    int64_t K;
};

struct Weights {
    const uint8_t* q;   // Q4_1 nibbles or Q8_0 values, grouped as above
    const uint16_t* d;  // [N/8, K/32, 8] float16
    const uint16_t* m;  // [N/8, K/32, 8] float16 (Q4_1 only)
};

// y[t0 + t, 8 (g0 + g) + j] for t < MT, g < NG: Q4_1 weights.
template <int MT, int NG>
void tile_q4_1(const Rows& x, const Weights& w, int64_t N, float* y, int64_t t0, int64_t g0) {
    const int64_t nb = x.K / QK;
    [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[MT][NG];
    for (int t = 0; t < MT; ++t)
        for (int g = 0; g < NG; ++g) acc[t][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        // Per column: sums of 16 products of at most 15 * 127 fit int16 (30,480 < 32,767).
        __m256i isum[MT][NG];
        for (int t = 0; t < MT; ++t)
            for (int g = 0; g < NG; ++g) isum[t][g] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
            __m256i w0[NG], w1[NG];
            for (int g = 0; g < NG; ++g) {
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + (((g0 + g) * nb + b) * 4 + p) * 32));
                w0[g] = _mm256_and_si256(raw, low);
                w1[g] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            }
            for (int t = 0; t < MT; ++t) {
                const int32_t* xr = reinterpret_cast<const int32_t*>(x.q + (t0 + t) * x.K + b * QK + p * 8);
                const __m256i x0 = _mm256_set1_epi32(xr[0]), x1 = _mm256_set1_epi32(xr[1]);
                for (int g = 0; g < NG; ++g) {
#ifdef BS_VNNI
                    isum[t][g] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(isum[t][g], w0[g], x0), w1[g], x1);
#else
                    const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(w0[g], x0), _mm256_maddubs_epi16(w1[g], x1));
                    isum[t][g] = _mm256_add_epi16(isum[t][g], pair);
#endif
                }
            }
        }
        __m256 dw[NG], mw[NG];
        for (int g = 0; g < NG; ++g) {
            const int64_t o = ((g0 + g) * nb + b) * 8;
            dw[g] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + o)));
            mw[g] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + o)));
        }
        for (int t = 0; t < MT; ++t) {
            const __m256 dx = _mm256_broadcast_ss(x.d + (t0 + t) * nb + b);
            const __m256 sx = _mm256_broadcast_ss(x.s + (t0 + t) * nb + b);
            for (int g = 0; g < NG; ++g) {  // d_w d_x sum(q_w q_x) + m_w sum(x)
#ifdef BS_VNNI
                const __m256 dot = _mm256_cvtepi32_ps(isum[t][g]);
#else
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[t][g], ones));
#endif
                acc[t][g] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw[g], dx), acc[t][g]);
                acc[t][g] = _mm256_fmadd_ps(mw[g], sx, acc[t][g]);
            }
        }
    }
    for (int t = 0; t < MT; ++t)
        for (int g = 0; g < NG; ++g) _mm256_storeu_ps(y + (t0 + t) * N + (g0 + g) * 8, acc[t][g]);
}

// The same for Q8_0 weights: signed values, so vpmaddubsw takes |w| and x carrying w's sign;
// a pair's sum can reach 32,512, so each step widens to int32 at once.
template <int MT, int NG>
void tile_q8_0(const Rows& x, const Weights& w, int64_t N, float* y, int64_t t0, int64_t g0) {
    const int64_t nb = x.K / QK;
    [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MT][NG];
    for (int t = 0; t < MT; ++t)
        for (int g = 0; g < NG; ++g) acc[t][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i isum[MT][NG];
        for (int t = 0; t < MT; ++t)
            for (int g = 0; g < NG; ++g) isum[t][g] = _mm256_setzero_si256();
        for (int s = 0; s < 8; ++s) {
            __m256i wv[NG], wa[NG];
            for (int g = 0; g < NG; ++g) {
                wv[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + (((g0 + g) * nb + b) * 8 + s) * 32));
                wa[g] = _mm256_sign_epi8(wv[g], wv[g]);
            }
            for (int t = 0; t < MT; ++t) {
                const int32_t* xr = reinterpret_cast<const int32_t*>(x.q + (t0 + t) * x.K + b * QK + s * 4);
                const __m256i xv = _mm256_set1_epi32(xr[0]);
                for (int g = 0; g < NG; ++g) {
#ifdef BS_VNNI
                    isum[t][g] = _mm256_dpbusd_epi32(isum[t][g], wa[g], _mm256_sign_epi8(xv, wv[g]));
#else
                    const __m256i prod = _mm256_maddubs_epi16(wa[g], _mm256_sign_epi8(xv, wv[g]));
                    isum[t][g] = _mm256_add_epi32(isum[t][g], _mm256_madd_epi16(prod, ones));
#endif
                }
            }
        }
        __m256 dw[NG];
        for (int g = 0; g < NG; ++g)
            dw[g] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + ((g0 + g) * nb + b) * 8)));
        for (int t = 0; t < MT; ++t) {
            const __m256 dx = _mm256_broadcast_ss(x.d + (t0 + t) * nb + b);
            for (int g = 0; g < NG; ++g)
                acc[t][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][g]), _mm256_mul_ps(dw[g], dx), acc[t][g]);
        }
    }
    for (int t = 0; t < MT; ++t)
        for (int g = 0; g < NG; ++g) _mm256_storeu_ps(y + (t0 + t) * N + (g0 + g) * 8, acc[t][g]);
}

template <int MT, int NG>
struct Q41 {
    static void f(const Rows& x, const Weights& w, int64_t N, float* y, int64_t t0, int64_t g0) {
        tile_q4_1<MT, NG>(x, w, N, y, t0, g0);
    }
};
template <int MT, int NG>
struct Q80 {
    static void f(const Rows& x, const Weights& w, int64_t N, float* y, int64_t t0, int64_t g0) {
        tile_q8_0<MT, NG>(x, w, N, y, t0, g0);
    }
};

#ifdef BS_WIDE

// Two column groups' 32 bytes (g0's low, g0 + 1's high) as one 512-bit register.
inline __m512i pair_of(const uint8_t* lo, const uint8_t* hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

// Two column groups' 8 float16 scales as 16 floats.
inline __m512 scales_of(const uint16_t* lo, const uint16_t* hi) {
    const __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
    return _mm512_cvtph_ps(h);
}

// y[t0 + t, 8 g0 + j] for t < MT, j < 16: Q4_1 weights, the column groups g0 and g0 + 1.
template <int MT>
void wide_q4_1(const Rows& x, const Weights& w, int64_t N, float* y, int64_t t0, int64_t g0) {
    const int64_t nb = x.K / QK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    const uint8_t* w0p = w.q + g0 * nb * 128;
    const uint8_t* w1p = w0p + nb * 128;  // the next group's blocks
    for (int64_t b = 0; b < nb; ++b) {
        __m512i isum[MT];
        for (int t = 0; t < MT; ++t) isum[t] = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) {
            const __m512i raw = pair_of(w0p + (b * 4 + p) * 32, w1p + (b * 4 + p) * 32);
            const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            for (int t = 0; t < MT; ++t) {
                const int32_t* xr = reinterpret_cast<const int32_t*>(x.q + (t0 + t) * x.K + b * QK + p * 8);
                isum[t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[t], lo, _mm512_set1_epi32(xr[0])), hi,
                                              _mm512_set1_epi32(xr[1]));
            }
        }
        const int64_t o0 = (g0 * nb + b) * 8, o1 = o0 + nb * 8;
        const __m512 dw = scales_of(w.d + o0, w.d + o1), mw = scales_of(w.m + o0, w.m + o1);
        for (int t = 0; t < MT; ++t) {  // d_w d_x sum(q_w q_x) + m_w sum(x), as the 256-bit path
            const __m512 dx = _mm512_set1_ps(x.d[(t0 + t) * nb + b]), sx = _mm512_set1_ps(x.s[(t0 + t) * nb + b]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(dw, dx), acc[t]);
            acc[t] = _mm512_fmadd_ps(mw, sx, acc[t]);
        }
    }
    for (int t = 0; t < MT; ++t) _mm512_storeu_ps(y + (t0 + t) * N + g0 * 8, acc[t]);
}

// The same for Q8_0: |w| against x carrying w's sign (x negated where w < 0; where w is 0, |w| is).
template <int MT>
void wide_q8_0(const Rows& x, const Weights& w, int64_t N, float* y, int64_t t0, int64_t g0) {
    const int64_t nb = x.K / QK;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    const uint8_t* w0p = w.q + g0 * nb * 256;
    const uint8_t* w1p = w0p + nb * 256;
    for (int64_t b = 0; b < nb; ++b) {
        __m512i isum[MT];
        for (int t = 0; t < MT; ++t) isum[t] = _mm512_setzero_si512();
        for (int s = 0; s < 8; ++s) {
            const __m512i wv = pair_of(w0p + (b * 8 + s) * 32, w1p + (b * 8 + s) * 32);
            const __m512i wa = _mm512_abs_epi8(wv);
            const __mmask64 negative = _mm512_movepi8_mask(wv);
            for (int t = 0; t < MT; ++t) {
                const int32_t* xr = reinterpret_cast<const int32_t*>(x.q + (t0 + t) * x.K + b * QK + s * 4);
                const __m512i xv = _mm512_set1_epi32(xr[0]);
                isum[t] = _mm512_dpbusd_epi32(isum[t], wa, _mm512_mask_sub_epi8(xv, negative, zero, xv));
            }
        }
        const int64_t o0 = (g0 * nb + b) * 8;
        const __m512 dw = scales_of(w.d + o0, w.d + o0 + nb * 8);
        for (int t = 0; t < MT; ++t)
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(t0 + t) * nb + b])),
                                     acc[t]);
    }
    for (int t = 0; t < MT; ++t) _mm512_storeu_ps(y + (t0 + t) * N + g0 * 8, acc[t]);
}

// Rows a 512-bit tile computes at once: 8 for Q4_1 (2 x 8 of the 32 registers accumulate); 4 for
// the Q8_0 head, whose sums take twice the instructions a block and which measured faster so.
template <int MT, int NG>
struct Q41Wide {
    static constexpr int kRows = 8;
    static void f(const Rows& x, const Weights& w, int64_t N, float* y, int64_t t0, int64_t g0) {
        wide_q4_1<MT>(x, w, N, y, t0, g0);
    }
};
template <int MT, int NG>
struct Q80Wide {
    static constexpr int kRows = 4;
    static void f(const Rows& x, const Weights& w, int64_t N, float* y, int64_t t0, int64_t g0) {
        wide_q8_0<MT>(x, w, N, y, t0, g0);
    }
};
#endif

// Rows [t0, T) for the column groups [g0, g0 + NG): tiles of MT rows, the rest in one smaller tile.
template <template <int, int> class K, int MT, int NG>
void row_tiles(const Rows& x, int64_t t0, int64_t T, const Weights& w, int64_t N, float* y, int64_t g0) {
    for (; t0 + MT <= T; t0 += MT) K<MT, NG>::f(x, w, N, y, t0, g0);
    if constexpr (MT > 1) {
        if (T > t0) row_tiles<K, MT - 1, NG>(x, t0, T, w, N, y, g0);
    }
}

// Each thread's share of the column groups: pairs of groups in 512-bit tiles where there are, the
// rest (or all, without AVX-512) in 256-bit tiles of kGroups.
template <template <int, int> class K, template <int, int> class Wide>
void columns(const Rows& rows, int64_t T, const Weights& w, int64_t N, float* y) {
    const int64_t groups = N / 8;
    int64_t first = 0;  // the first group the 256-bit tiles take
#ifdef BS_WIDE
    first = groups / 2 * 2;
#pragma omp for schedule(static) nowait
    for (int64_t j = 0; j < groups / 2; ++j) row_tiles<Wide, Wide<1, 1>::kRows, 1>(rows, 0, T, w, N, y, 2 * j);
#endif
    const int64_t rest = groups - first, tiles = rest / kGroups;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < tiles + (rest - tiles * kGroups); ++j) {
        if (j < tiles) row_tiles<K, kRowTile, kGroups>(rows, 0, T, w, N, y, first + j * kGroups);
        else row_tiles<K, kRowTile, 1>(rows, 0, T, w, N, y, first + tiles * kGroups + (j - tiles));
    }
}

template <template <int, int> class K, template <int, int> class Wide>
void linear(const float* x, int64_t T, int64_t K_, const Weights& w, int64_t N, float* y, int threads) {
    const int64_t nb = K_ / QK;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> xds;
    xq.resize(static_cast<size_t>(T * K_));
    xds.resize(static_cast<size_t>(2 * T * nb));
    // The buffers are this (calling) thread's: the team reads them through these pointers.
    int8_t* q = xq.data();
    float* d = xds.data();
    float* s = d + T * nb;
    const Rows rows{q, d, s, K_};
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t b = 0; b < nb; ++b)
                quantize_block(x + t * K_ + b * QK, q + t * K_ + b * QK, d + t * nb + b, s + t * nb + b);
        columns<K, Wide>(rows, T, w, N, y);
    }
}

}  // namespace

#ifdef BS_WIDE
#define WIDE(k) k##Wide
#else
#define WIDE(k) k  // unused without AVX-512: every group takes the 256-bit tiles
#endif

extern "C" {

// y [T, N] float32 = x [T, K] float32 times the Q4_1 weight's transpose. K % 32 == 0, N % 8 == 0.
void bs_q4_1_linear(const float* x, int64_t T, int64_t K, const uint8_t* wq, const uint16_t* wd,
                    const uint16_t* wm, int64_t N, float* y, int threads) {
    linear<Q41, WIDE(Q41)>(x, T, K, Weights{wq, wd, wm}, N, y, threads);
}

// The same over Q8_0 weights.
void bs_q8_0_linear(const float* x, int64_t T, int64_t K, const int8_t* wq, const uint16_t* wd, int64_t N,
                    float* y, int threads) {
    linear<Q80, WIDE(Q80)>(x, T, K, Weights{reinterpret_cast<const uint8_t*>(wq), wd, nullptr}, N, y, threads);
}

int bs_abi_version() { return 5; }

}  // extern "C"
