// y [T, N] = x [T, K] times a bfloat16 weight's transpose, for 1 to thousands of rows: the
// activations are rounded to bfloat16 (to nearest, ties to even, NaN to 0x7FC0: torch's
// `.to(torch.bfloat16)`), every product and sum is float32, y is float32 or rounded to bfloat16.
//
// Weight layout (`bs_bf16_pack`): C output columns form a group (C = 16 with AVX-512, else 8);
// within a group, step s holds the pair k = 2s, 2s+1 of each column, column j's pair in 32-bit
// lane j (k = 2s in the low half): [ceil(N/C), ceil(K/2), C, 2] uint16, zero where N or K runs
// out. One vector load is one step of C columns, and each lane only ever meets its own column.
//
// Paths, chosen at compile time (the packed layout follows, `bs_bf16_columns` says which):
// - AVX512-BF16: vdpbf16ps adds a lane's two products (odd k first, as the instruction defines
//   it; subnormal inputs and sums count as zero, as it also defines) to its float32 sum, against
//   the activation row's pair broadcast as one 32-bit value.
// - AVX-512F without it (Skylake-SP to Ice Lake), and AVX2 + FMA (8 columns): a lane's pair
//   widens to two float32 exactly (low half shifted up 16, high half masked) and two FMAs add
//   k = 2s, then 2s+1, against the broadcast activations (float32 already, being bfloat16's).
//   These two give the same bits; the products are exact, so each FMA rounds only the sum.
//
// Batch invariance by construction: an output element is one lane of one accumulator, zeroed,
// then stepped through s = 0 .. K/2 - 1 in order, then stored; no horizontal sum, no split of
// K. The row count, the row's place in the call, the tile shape (row tiles of up to kRowTile,
// remainders in smaller tiles; NG groups per tile, more at 1-2 rows) and the thread count (which
// splits the column groups) decide which tile computes an element, never how. One code path
// for every row count. Contraction is off: every FMA below is written out.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "kernels.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the bfloat16 product kernel needs AVX2 and FMA"
#endif
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define BS_BF16_512 1
#if defined(__AVX512BF16__)
#define BS_BF16_DP 1
#endif
#endif

namespace {

#if defined(BS_BF16_DP)
constexpr int64_t kCols = 16;  // columns a group holds: the float32 lanes of a zmm
constexpr int kRowTile = 6;    // 6 rows x 4 groups: 24 accumulators, 4 weights, 1 broadcast of 32 zmm
constexpr int kGroups = 4;
constexpr int kMidGroups = 6;     // at 3-4 rows: 4 x 6 (more weight streams in flight: they are memory-bound)
constexpr int kFewRowGroups = 8;  // at 1-2 rows: 2 x 8
using XElem = uint16_t;           // activations as bfloat16, read by pairs
#elif defined(BS_BF16_512)
constexpr int64_t kCols = 16;
constexpr int kRowTile = 4;  // 4 rows x 4 groups: 16 accumulators, 8 widened weights, 2 broadcasts of 32 zmm
constexpr int kGroups = 4;
constexpr int kMidGroups = 4;
constexpr int kFewRowGroups = 6;
using XElem = float;
#else
constexpr int64_t kCols = 8;
constexpr int kRowTile = 5;  // 5 rows x 2 groups: 10 accumulators, 4 widened weights, 2 broadcasts: the 16 ymm
constexpr int kGroups = 2;
constexpr int kMidGroups = 2;
constexpr int kFewRowGroups = 4;
using XElem = float;  // activations as bfloat16's float32 values, broadcast one at a time
#endif

// Round-to-nearest-even of 8 floats to bfloat16, each in the low half of its 32-bit lane.
inline __m256i round_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

inline uint16_t round_bf16(float f) {  // the same, one value
    if (f != f) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Two rounded vectors -> 16 bfloat16 in order (packus interleaves 128-bit halves; the permute undoes it).
inline __m256i pack_bf16(__m256i lo, __m256i hi) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}

// Row t of x [T, K] -> its activations [Kp] (Kp = K rounded up to even, the pad zero).
void round_row(const float* x, int64_t K, int64_t Kp, XElem* out) {
    int64_t k = 0;
#ifdef BS_BF16_DP
    for (; k + 16 <= K; k += 16) {
        const __m256i lo = round_bf16(_mm256_loadu_ps(x + k)), hi = round_bf16(_mm256_loadu_ps(x + k + 8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), pack_bf16(lo, hi));
    }
    for (; k < K; ++k) out[k] = round_bf16(x[k]);
    for (; k < Kp; ++k) out[k] = 0;
#else
    for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16(_mm256_loadu_ps(x + k)), 16)));
    for (; k < K; ++k) {
        const uint32_t u = static_cast<uint32_t>(round_bf16(x[k])) << 16;
        memcpy(out + k, &u, 4);
    }
    for (; k < Kp; ++k) out[k] = 0.0f;
#endif
}

struct Call {
    const XElem* x;     // [T, Kp] rounded activations
    const uint16_t* w;  // the packed weight
    int64_t steps;      // Kp / 2
    int64_t N;
    void* y;  // [T, N] float32 or bfloat16
    bool bf16_out;
};

// 8 sums -> y's row at `col`, `valid` of them (the last group may be partial).
inline void store8(const Call& c, __m256 v, int64_t row, int64_t col, int64_t valid) {
    if (c.bf16_out) {
        uint16_t* y = static_cast<uint16_t*>(c.y) + row * c.N + col;
        const __m128i h = _mm256_castsi256_si128(pack_bf16(round_bf16(v), _mm256_setzero_si256()));
        if (valid >= 8) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(y), h);
        } else {
            uint16_t tmp[8];
            _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), h);
            memcpy(y, tmp, static_cast<size_t>(valid) * 2);
        }
        return;
    }
    float* y = static_cast<float*>(c.y) + row * c.N + col;
    if (valid >= 8) {
        _mm256_storeu_ps(y, v);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        memcpy(y, tmp, static_cast<size_t>(valid) * 4);
    }
}

#if defined(BS_BF16_DP)
using Acc = __m512;
using W = __m512bh;
using X = __m512bh;
inline Acc zero() { return _mm512_setzero_ps(); }
inline W load_w(const uint16_t* p) { return (W)_mm512_loadu_si512(p); }
inline X load_x(const XElem* p) {
    int32_t pair;
    memcpy(&pair, p, 4);
    return (X)_mm512_set1_epi32(pair);
}
inline Acc step(Acc acc, W w, X x) { return _mm512_dpbf16_ps(acc, w, x); }
#elif defined(BS_BF16_512)
using Acc = __m512;
struct W {
    __m512 even, odd;  // k = 2s and 2s+1 of 16 columns, widened
};
struct X {
    __m512 even, odd;
};
inline Acc zero() { return _mm512_setzero_ps(); }
inline W load_w(const uint16_t* p) {
    const __m512i v = _mm512_loadu_si512(p);
    return W{_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
             _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline X load_x(const XElem* p) { return X{_mm512_set1_ps(p[0]), _mm512_set1_ps(p[1])}; }
inline Acc step(Acc acc, const W& w, const X& x) {
    acc = _mm512_fmadd_ps(w.even, x.even, acc);
    return _mm512_fmadd_ps(w.odd, x.odd, acc);
}
#else
using Acc = __m256;
struct W {
    __m256 even, odd;  // k = 2s and 2s+1 of 8 columns, widened
};
struct X {
    __m256 even, odd;
};
inline Acc zero() { return _mm256_setzero_ps(); }
inline W load_w(const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return W{_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
             _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline X load_x(const XElem* p) { return X{_mm256_broadcast_ss(p), _mm256_broadcast_ss(p + 1)}; }
inline Acc step(Acc acc, const W& w, const X& x) {
    acc = _mm256_fmadd_ps(w.even, x.even, acc);
    return _mm256_fmadd_ps(w.odd, x.odd, acc);
}
inline void keep(float* p, Acc v) { _mm256_store_ps(p, v); }
#endif
#if defined(BS_BF16_512)
inline void keep(float* p, Acc v) { _mm512_store_ps(p, v); }
#endif

// A group's C sums -> y's row at `col`, `valid` of them.
inline void emit(const Call& c, const float* v, int64_t row, int64_t col, int64_t valid) {
    for (int64_t j = 0; j < kCols && j < valid; j += 8) store8(c, _mm256_load_ps(v + j), row, col + j, valid - j);
}

// y[t0 + t, C (g0 + g) + j] for t < MT, g < NG, j < C (those inside N).
template <int MT, int NG>
void tile(const Call& c, int64_t t0, int64_t g0) {
    const int64_t steps = c.steps, stride = steps * kCols * 2;  // a group's elements
    const uint16_t* wg = c.w + g0 * stride;
    const XElem* xr = c.x + t0 * steps * 2;
    Acc acc[MT][NG];
    for (int t = 0; t < MT; ++t)
        for (int g = 0; g < NG; ++g) acc[t][g] = zero();
    for (int64_t s = 0; s < steps; ++s) {
        W w[NG];
        for (int g = 0; g < NG; ++g) w[g] = load_w(wg + g * stride + s * kCols * 2);
        for (int t = 0; t < MT; ++t) {
            const X xv = load_x(xr + t * steps * 2 + 2 * s);
            for (int g = 0; g < NG; ++g) acc[t][g] = step(acc[t][g], w[g], xv);
        }
    }
    // The sums leave through a buffer, in unrolled copies: writing y straight from acc[][] (partial
    // groups, bfloat16) made GCC store every sum to the stack on every step of the K loop.
    alignas(64) float done[MT][NG][kCols];
#pragma GCC unroll 8
    for (int t = 0; t < MT; ++t)
#pragma GCC unroll 8
        for (int g = 0; g < NG; ++g) keep(done[t][g], acc[t][g]);
    for (int t = 0; t < MT; ++t)
        for (int g = 0; g < NG; ++g) {
            const int64_t col = (g0 + g) * kCols;
            emit(c, done[t][g], t0 + t, col, c.N - col < kCols ? c.N - col : kCols);
        }
}

// Rows [0, T) of the column groups [g0, g0 + NG): tiles of MT rows, the rest in one smaller tile.
template <int MT, int NG>
void row_tiles(const Call& c, int64_t t0, int64_t T, int64_t g0) {
    for (; t0 + MT <= T; t0 += MT) tile<MT, NG>(c, t0, g0);
    if constexpr (MT > 1) {
        if (T > t0) row_tiles<MT - 1, NG>(c, t0, T, g0);
    }
}

// Column groups [g0, g1) over every row: tiles of NG groups, the rest in one narrower tile.
template <int MT, int NG>
void col_tiles(const Call& c, int64_t T, int64_t g0, int64_t g1) {
    for (; g0 + NG <= g1; g0 += NG) row_tiles<MT, NG>(c, 0, T, g0);
    if constexpr (NG > 1) {
        if (g1 > g0) col_tiles<MT, NG - 1>(c, T, g0, g1);
    }
}

}  // namespace

extern "C" {

// Output columns a group of the packed layout holds: 16 on the AVX-512 paths, 8 on AVX2.
int bs_bf16_columns() { return static_cast<int>(kCols); }

// Elements of the packed layout of a weight [N, K].
int64_t bs_bf16_packed_size(int64_t N, int64_t K) { return (N + kCols - 1) / kCols * ((K + 1) / 2) * kCols * 2; }

// A bfloat16 weight w [N, K] (row-major, as uint16) -> `packed` (bs_bf16_packed_size elements).
void bs_bf16_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed, int threads) {
    const int64_t groups = (N + kCols - 1) / kCols, steps = (K + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t s = 0; s < steps; ++s)
            for (int64_t j = 0; j < kCols; ++j)
                for (int64_t r = 0; r < 2; ++r) {
                    const int64_t n = g * kCols + j, k = 2 * s + r;
                    packed[((g * steps + s) * kCols + j) * 2 + r] = n < N && k < K ? w[n * K + k] : 0;
                }
}

// y [T, N] (float32, or bfloat16 where bf16_out) = bfloat16(x [T, K] float32) times the packed
// weight's transpose. Threads split the column groups; each computes every row of its own.
void bs_bf16_linear(const float* x, int64_t T, int64_t K, const uint16_t* packed, int64_t N, void* y, int bf16_out,
                    int threads) {
    if (T <= 0 || N <= 0) return;
    const int64_t steps = (K + 1) / 2, groups = (N + kCols - 1) / kCols;
    static thread_local std::vector<XElem> xs;
    xs.resize(static_cast<size_t>(T * steps * 2));
    // The buffer is this (calling) thread's: the team reads it through this pointer.
    XElem* xb = xs.data();
    const Call c{xb, packed, steps, N, y, bf16_out != 0};
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) round_row(x + t * K, K, steps * 2, xb + t * steps * 2);
        const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t g0 = groups * id / team, g1 = groups * (id + 1) / team;
        if (T <= 2) col_tiles<2, kFewRowGroups>(c, T, g0, g1);
        else if (T <= 4) col_tiles<4, kMidGroups>(c, T, g0, g1);
        else col_tiles<kRowTile, kGroups>(c, T, g0, g1);
    }
}

}  // extern "C"
