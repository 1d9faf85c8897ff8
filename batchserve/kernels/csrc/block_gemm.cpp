// Products over GGUF weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K .. Q6_K, IQ4_XS) in the kernel
// layout of blocks.h, for 1 to a few hundred rows, each weight byte read once per call and row tile.
// One call may hold several parts of different types (q|k|v, gate|up): the activations are
// quantized once per call, per row and block of 32 to int8 (d = max|x| / 127, round half to even,
// as quantize.h's quantize_block), with the block's quantized sum s_x = d_x * sum(q_x) and the exact int sums of
// each 16 values.
//
// Per block of 32, per row and column, the integer sum isum = sum(q_w * q_x) over the stored
// (unsigned) weight values is exact, then a fixed float sequence:
//   Q4_0, Q5_0, Q8_0: c = isum - off * X32 (off 8, 16, 128: the values' offset; X32 the block's
//                     int sum of x); acc = fma(float(c), d_w * d_x, acc)
//   Q4_1, Q5_1:       acc = fma(float(isum), d_w * d_x, acc); acc = fma(m_w, s_x, acc)
//   Q4_K, Q5_K:       dw = d * sc_j, mw = dmin * mn_j (both exact in float32);
//                     acc = fma(float(isum), dw * d_x, acc); acc = fnma(mw, s_x, acc)
//   Q6_K, Q3_K:       c = sc_a (S_a - o X_a) + sc_b (S_b - o X_b) over its two sub-blocks of 16
//                     (o 32, 4: the values' offset); acc = fma(float(c), d * d_x, acc)
//   Q2_K:             c = sc_a S_a + sc_b S_b; mi = mn_a X_a + mn_b X_b;
//                     acc = fma(float(c), d * d_x, acc); acc = fnma(float(mi), dmin * d_x, acc)
//   IQ4_NL, IQ4_XS:   the values from the table, then as Q8_0: c = isum - 128 X32 (VNNI; AVX2 takes
//                     them signed); acc = fma(float(c), d_w * d_x, acc), IQ4_XS's d_w = d * (ls - 32)
// Batch invariance: an output element is computed by one thread in this order from its row's
// activations and its column's weights only; row count, row position, tile and thread count
// decide which thread and tile computes it, never how. Float contraction is off (flags).
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "block_vec.h"
#include "blocks.h"
#include "quantize.h"

using namespace blocks;
using namespace blockvec;

namespace {

// Block-major: block b of every row, then block b + 1, so a tile's rows are at fixed offsets from
// one pointer and a block's reads are one sequential run (row-major, the 8 rows of a tile were 8
// streams K bytes apart and their pointers spilled the general registers).
struct Acts {           // a call's activations, quantized
    const int8_t* q;    // [K/32, T, 32]
    const float* d;     // [K/32, T] scales
    const float* s;     // [K/32, T] quantized sums d * sum(q)
    const int32_t* x16; // [K/32, T, 2] int sums of each 16 quantized values
    const int32_t* nx;  // [K/32, T] minus the int sum of the 32
    int64_t T, nb;
};

// One row's block of 32 floats -> quantize_block's int8 q, d and d * sum(q), and the int sums of
// each 16 values (the offset types' correction).
inline void quantize_block16(const float* p, int8_t* q, float* d, float* s, int32_t* x16, int32_t* nx) {
    quantize_block(p, q, d, s);
    int32_t lo = 0, hi = 0;
    for (int i = 0; i < 16; ++i) lo += q[i], hi += q[16 + i];
    x16[0] = lo;
    x16[1] = hi;
    *nx = -(lo + hi);
}

// Rows a tile computes at once: 8 in 512-bit tiles (two column groups' weights, unpacked once,
// serve 8 rows; measured faster than 4 for every type here, Q6_K and Q8_0 included), 4 in 256-bit.
template <class V, int64_t Q>
constexpr int rows_of() { return V::kCols == 8 ? 4 : 8; }

// A Q4_K/Q5_K record's 6-bit scales and mins (blocks.h) -> out: sc [8 sub][8 columns] bytes, then
// mn, for the tile's steps to read 8 at a time. Once a super-block, in byte lanes: 4 sub-blocks a
// 256-bit vector (the tile's per-step decoding cost 16-row products 5-10%).
inline void scales_k(const uint8_t* r, uint8_t* out) {
    const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + kScHigh));
    for (int h = 0; h < 2; ++h) {  // sub-blocks 4h .. 4h + 3
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + kScLow + 32 * h));
        const __m256i t = _mm256_and_si256(h ? _mm256_srli_epi16(high, 4) : high, low);
        const __m256i sc = _mm256_or_si256(_mm256_and_si256(l, low), _mm256_slli_epi16(_mm256_and_si256(t, three), 4));
        const __m256i mn = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), low),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(t, 2), three), 4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * h), sc);
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 + 32 * h), mn);
    }
}

// Software prefetch of the weights a block of 32 ahead: a few records ahead (3-5 KB a stream), this
// block's share of the record's bytes, for each group the tile reads. Without it the 1-row products,
// which do little work a byte, stalled on DRAM (Q6_K streamed at half the rate of the others). A
// thread's groups are consecutive in each stream (`part`), so reaching past a group's last record
// prefetches the group the stream reads next. Into L2, not L1: a long row's activations (14 KB at
// K = 14336) and two streams' prefetched records did not fit L1 together (Q6_K's 1-row products of
// that width ran 1.3-1.6x faster prefetched into L2).
// A paired type's records (blocks.h) are one stream a pair: at 1 or 2 rows the hardware's prefetch
// alone streamed them faster (1.1-1.4x from memory, one thread), software prefetch into L2 slowed it;
// the 4- and 8-row tiles, which do more work a byte, ran 0.7-0.8x without it. A 256-bit tile of a
// pair's second group reads the records its first group's tile brought in.
template <class V, int64_t Q, int MT>
inline void prefetch(const uint8_t* r, int64_t gs, int jb) {
    if constexpr (paired(Q) && MT < 4) return;
    constexpr int64_t rec = record_bytes(Q), per = kquant(Q) ? 8 : 1, ahead = kquant(Q) ? 4 : 12, share = rec / per;
    const int64_t streams = !paired(Q) ? V::kCols / 8 : V::kCols == 8 && gs ? 0 : 1;
    const uint8_t* p = r + ahead * rec + jb * share;
    for (int g = 0; g < streams; ++g)
        for (int64_t o = 0; o < share; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + g * gs + o), _MM_HINT_T1);
}

// y[t0 + t, c] for t < MT and the V::kCols columns of the group(s) at w (`valid` of them kept): the
// first group's at y, a 512-bit tile's second group (gs bytes after the first) at y + yo. A paired
// type's w is its pair's records: a 512-bit tile reads both groups (gs unused), a 256-bit one
// group gs (0 or 1) of the two.
template <class V, int64_t Q, int MT>
void tile(const Acts& x, const uint8_t* w, int64_t gs, float* y, int64_t yo, int64_t ys, int64_t t0, int valid) {
    using I = typename V::I;
    using F = typename V::F;
    constexpr bool kq = kquant(Q), five = Q == Q5_0 || Q == Q5_1 || Q == Q5_K;
    constexpr bool table = Q == IQ4_NL || Q == IQ4_XS || Q == MXFP4, crumbed = Q == Q2_K || Q == Q3_K;
    [[maybe_unused]] constexpr bool halves = Q == Q6_K || crumbed;  // a scale for each 16 values
    constexpr int per = kq ? 8 : 1;  // blocks of 32 a record
    const I low = V::bytes(0x0F), sixteen = V::bytes(16), top = V::bytes(0x30), three = V::bytes(3);
    [[maybe_unused]] const I values = V::table(Q == MXFP4 ? kMXFP4Values : kIQ4Values);
    // A paired type's vector i (of 32 bytes a group) at 64 i + vh, its d at 2 d32 + dh (blocks.h).
    constexpr bool pr = paired(Q);
    [[maybe_unused]] const int64_t vh = pr && V::kCols == 8 ? 32 * gs : 0, dh = pr && V::kCols == 8 ? 16 * gs : 0;
    F acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = V::fzero();
    const int64_t units = x.nb / per;
    for (int64_t u = 0; u < units; ++u) {
        const uint8_t* r = w + u * record_bytes(Q);
        [[maybe_unused]] F dsup, dmin;
        [[maybe_unused]] alignas(32) uint8_t scm[V::kCols / 8 * 128];
        if constexpr (kq) dsup = V::half(r + kD, gs);
        if constexpr (Q == Q4_K || Q == Q5_K || Q == Q2_K) dmin = V::half(r + kDmin, gs);
        if constexpr (Q == Q4_K || Q == Q5_K || Q == Q3_K) {
            for (int g = 0; g < V::kCols / 8; ++g) scales_k(r + g * gs, scm + 128 * g);
        }
        for (int jb = 0; jb < per; ++jb) {
            const int64_t b = u * per + jb, rb = b * x.T + t0;  // row t0's entry of block b
            const int8_t* xb = x.q + rb * 32;
            prefetch<V, Q, MT>(r, gs, jb);
            I is[MT], is2[MT];  // is2: Q6_K's second sub-block of 16
            // The offset types' sums start at - off * X32 (exact int32 adds: the same isum - off X32).
            constexpr int32_t off = Q == Q4_0 ? 8 : Q == Q5_0 ? 16 : Q == Q8_0 || table ? V::kQ8Offset : 0;
            for (int t = 0; t < MT; ++t) {
                is[t] = is2[t] = V::zero();
                if constexpr (off != 0) is[t] = V::shl_bcast(x.nx + rb + t, off == 8 ? 3 : off == 16 ? 4 : 7);
            }
            if constexpr (Q == Q8_0) {
                for (int st = 0; st < 8; ++st) {
                    const I wv = pr ? V::loadp(r + 64 * st + vh, gs) : V::load(r + st * 32, gs);
                    for (int t = 0; t < MT; ++t) {
                        const int32_t* xr = reinterpret_cast<const int32_t*>(xb + t * 32);
                        is[t] = V::dotm_q8(is[t], wv, xr + st);
                    }
                }
            } else if constexpr (crumbed) {  // 2-bit planes (+ Q3_K's third bit as a mask)
                const uint8_t* planes = r + (Q == Q2_K ? kCrumbs2 : kCrumbs3) + 64 * jb;
                #pragma GCC unroll 4
                for (int p = 0; p < 4; ++p) {  // steps 2p, 2p + 1: bit pairs 2p % 4, 2p % 4 + 1 of vector p / 2
                    const I hv = V::load(planes + 32 * (p / 2), gs);
                    I w0 = V::and_(V::srl16(hv, 4 * (p % 2)), three), w1 = V::and_(V::srl16(hv, 4 * (p % 2) + 2), three);
                    if constexpr (Q == Q3_K) {
                        const uint8_t* m = r + kMasks3 + 32 * jb + 8 * p;
                        w0 = V::add_masked(w0, m, gs, V::bytes(4));
                        w1 = V::add_masked(w1, m + 4, gs, V::bytes(4));
                    }
                    for (int t = 0; t < MT; ++t) {
                        const int32_t* xr = reinterpret_cast<const int32_t*>(xb + t * 32 + 8 * p);
                        if (p >= 2) is2[t] = V::dotm(V::dotm(is2[t], w0, xr), w1, xr + 1);
                        else is[t] = V::dotm(V::dotm(is[t], w0, xr), w1, xr + 1);
                    }
                }
            } else {
                const uint8_t* nib = r + (kq ? nibblesK(Q) + 128 * jb : kNibbles);
                [[maybe_unused]] I hv;
                #pragma GCC unroll 4
                for (int p = 0; p < 4; ++p) {
                    const I raw = pr ? V::loadp(r + 64 * p + vh, gs) : V::load(nib + 32 * p, gs);
                    I w0, w1;
                    if constexpr (table) {  // the indices' int8 values, stored as Q8_0's (q ^ 0x80)
                        V::lookup_nibbles(values, raw, w0, w1);
                    } else {
                        w0 = V::and_(raw, low), w1 = V::and_(V::srl16(raw, 4), low);
                    }
                    if constexpr (five) {
                        const uint8_t* m = r + (kq ? kMasksK + 32 * jb : kMasks32) + 8 * p;
                        w0 = V::add_masked(w0, m, gs, sixteen);
                        w1 = V::add_masked(w1, m + 4, gs, sixteen);
                    }
                    if constexpr (Q == Q6_K) {  // steps 2p, 2p + 1 are bit pairs (2p % 4), (2p % 4) + 1 of vector p / 2
                        if (p % 2 == 0) {
                            hv = V::load(r + kHigh2 + 64 * jb + 16 * p, gs);
                            w0 = V::or_(w0, V::and_(V::sll16(hv, 4), top));
                            w1 = V::or_(w1, V::and_(V::sll16(hv, 2), top));
                        } else {
                            w0 = V::or_(w0, V::and_(hv, top));
                            w1 = V::or_(w1, V::and_(V::srl16(hv, 2), top));
                        }
                    }
                    for (int t = 0; t < MT; ++t) {
                        const int32_t* xr = reinterpret_cast<const int32_t*>(xb + t * 32 + 8 * p);
                        if constexpr (table) is[t] = V::dotm_q8(V::dotm_q8(is[t], w0, xr), w1, xr + 1);
                        else if (Q == Q6_K && p >= 2) is2[t] = V::dotm(V::dotm(is2[t], w0, xr), w1, xr + 1);
                        else is[t] = V::dotm(V::dotm(is[t], w0, xr), w1, xr + 1);
                    }
                }
            }
            if constexpr (Q == Q4_0 || Q == Q5_0 || Q == Q8_0 || table) {
                F dw;
                if constexpr (Q == IQ4_XS) dw = V::mul(dsup, V::cvt(V::i8i(r + kScalesXS + 8 * jb, gs)));
                else if constexpr (pr) dw = V::halfp(r + 2 * d32(Q) + dh, gs);
                else dw = V::half(r + d32(Q), gs);
                for (int t = 0; t < MT; ++t) {
                    const int64_t row = rb + t;
                    acc[t] = V::fma(V::cvt(is[t]), V::mul(dw, V::splat(x.d[row])), acc[t]);
                }
            } else if constexpr (Q == Q4_1 || Q == Q5_1) {
                const F dw = V::half(r + d32(Q), gs), mw = V::half(r + m32(Q), gs);
                for (int t = 0; t < MT; ++t) {
                    const int64_t row = rb + t;
                    acc[t] = V::fma(V::cvt(is[t]), V::mul(dw, V::splat(x.d[row])), acc[t]);
                    acc[t] = V::fma(mw, V::splat(x.s[row]), acc[t]);
                }
            } else if constexpr (Q == Q4_K || Q == Q5_K) {
                const F dw = V::mul(dsup, V::u8f(scm + 8 * jb, 128)), mw = V::mul(dmin, V::u8f(scm + 64 + 8 * jb, 128));
                for (int t = 0; t < MT; ++t) {
                    const int64_t row = rb + t;
                    acc[t] = V::fma(V::cvt(is[t]), V::mul(dw, V::splat(x.d[row])), acc[t]);
                    acc[t] = V::fnma(mw, V::splat(x.s[row]), acc[t]);
                }
            } else if constexpr (Q == Q2_K) {
                const I sa = V::u8i(r + kScMn2 + 16 * jb, gs), sb = V::u8i(r + kScMn2 + 16 * jb + 8, gs);
                const I ca = V::and32(sa, 15), cb = V::and32(sb, 15), ma = V::srl32(sa, 4), mb = V::srl32(sb, 4);
                for (int t = 0; t < MT; ++t) {
                    const int64_t row = rb + t;
                    const I c = V::add32(V::mul32(ca, is[t]), V::mul32(cb, is2[t]));
                    const I mi = V::add32(V::mul32(ma, V::x4(x.x16[2 * row])), V::mul32(mb, V::x4(x.x16[2 * row + 1])));
                    acc[t] = V::fma(V::cvt(c), V::mul(dsup, V::splat(x.d[row])), acc[t]);
                    acc[t] = V::fnma(V::cvt(mi), V::mul(dmin, V::splat(x.d[row])), acc[t]);
                }
            } else {  // Q6_K, Q3_K
                static_assert(halves);
                constexpr int32_t off = Q == Q6_K ? 32 : 4;
                I sa, sb;
                if constexpr (Q == Q6_K) {
                    sa = V::i8i(r + kScales6 + 16 * jb, gs), sb = V::i8i(r + kScales6 + 16 * jb + 8, gs);
                } else {  // the 6-bit scales unpacked per super-block, less their bias
                    sa = V::sub32(V::u8i(scm + 16 * jb, 128), 32), sb = V::sub32(V::u8i(scm + 16 * jb + 8, 128), 32);
                }
                for (int t = 0; t < MT; ++t) {
                    const int64_t row = rb + t;
                    const I c = V::add32(V::mul32(sa, V::sub32(is[t], off * x.x16[2 * row])),
                                         V::mul32(sb, V::sub32(is2[t], off * x.x16[2 * row + 1])));
                    acc[t] = V::fma(V::cvt(c), V::mul(dsup, V::splat(x.d[row])), acc[t]);
                }
            }
        }
    }
    for (int t = 0; t < MT; ++t) V::store(y + (t0 + t) * ys, yo, acc[t], valid);
}

// Rows [t0, T) in tiles of MT, the rest in tiles of MT / 2, MT / 4, .. 1 (at most one each): fewer
// tile sizes to compile than every count below MT (8 types x 2 widths of them), each a few rows
// the group's weights, then in L1, serve again.
template <class V, int64_t Q, int MT>
void row_tiles(const Acts& x, int64_t t0, int64_t T, const uint8_t* w, int64_t gs, float* y, int64_t yo, int64_t ys,
               int valid) {
    for (; t0 + MT <= T; t0 += MT) tile<V, Q, MT>(x, w, gs, y, yo, ys, t0, valid);
    if constexpr (MT > 1) {
        if (T > t0) row_tiles<V, Q, MT / 2>(x, t0, T, w, gs, y, yo, ys, valid);
    }
}

// Tiles a thread takes at a time from a loop of n: a quarter of its share. A thread takes its next
// chunk when it finishes one, so a thread slowed (the machine's other processes, its memory) does
// less, where a fixed split had the other wait for its half at the end (llama.cpp's products work
// in chunks so, 4 a thread). Which thread computes a tile never changes how: the same bits.
inline int64_t chunk(int64_t n) {
    const int64_t pieces = 4 * omp_get_num_threads();
    return std::max<int64_t>(1, (n + pieces - 1) / pieces);
}

// One part's columns (its `rows` weight rows) into y's columns [0, rows). In 512-bit tiles a tile
// reads group j with group j + P (P = half the groups, rounded down), and a thread's tiles take
// consecutive j: each of its two streams runs through consecutive groups, however short a group's
// records (a pair of neighbours made short rows, K = 1536, two streams restarting every few KB, read
// at two thirds of long rows' rate). Then the group left over (or all, without AVX-512). A paired
// type's tiles take its pairs (blocks.h), both groups of a pair in one 512-bit tile and one stream.
template <int64_t Q>
void part(const Acts& x, int64_t T, const uint8_t* w, int64_t rows, float* y, int64_t ys) {
    if constexpr (paired(Q)) {  // a pair's two groups are one stream of records
        const int64_t pairs = (rows + 15) / 16, ps = x.nb * record_bytes(Q);
#ifdef BS_BLOCK_WIDE
        if (T == 1) {  // pair j with pair j + H (H = half the pairs): two streams a thread
            const int64_t half = pairs / 2;
#pragma omp for schedule(dynamic, chunk(half)) nowait
            for (int64_t j = 0; j < half; ++j) {
                const int valid = 16 + static_cast<int>(std::min<int64_t>(16, rows - 16 * (j + half)));
                tile<V32, Q, 1>(x, w + j * ps, half * ps, y + 16 * j, 16 * half, ys, 0, valid);
            }
#pragma omp for schedule(dynamic, chunk(pairs - 2 * half)) nowait
            for (int64_t j = 2 * half; j < pairs; ++j)  // the pair left over
                tile<V16, Q, 1>(x, w + j * ps, 0, y + 16 * j, 8, ys, 0, static_cast<int>(rows - 16 * j));
        } else {
#pragma omp for schedule(dynamic, chunk(pairs)) nowait
            for (int64_t j = 0; j < pairs; ++j) {
                const int valid = static_cast<int>(std::min<int64_t>(16, rows - 16 * j));
                row_tiles<V16, Q, rows_of<V16, Q>()>(x, 0, T, w + j * ps, 0, y + 16 * j, 8, ys, valid);
            }
        }
#else
        if (T < 4) {  // both groups a tile of 2 or 1 rows, each record read once
#pragma omp for schedule(dynamic, chunk(pairs)) nowait
            for (int64_t j = 0; j < pairs; ++j) {
                const int valid = static_cast<int>(std::min<int64_t>(16, rows - 16 * j));
                row_tiles<V8x2, Q, 2>(x, 0, T, w + j * ps, 0, y + 16 * j, 8, ys, valid);
            }
        } else {  // a group a tile, 4 rows (8 columns' weights serving more rows)
            const int64_t groups = (rows + 7) / 8;
#pragma omp for schedule(dynamic, chunk(groups)) nowait
            for (int64_t g = 0; g < groups; ++g) {
                const int valid = static_cast<int>(std::min<int64_t>(8, rows - 8 * g));
                row_tiles<V8, Q, rows_of<V8, Q>()>(x, 0, T, w + g / 2 * ps, g % 2, y + 8 * g, 0, ys, valid);
            }
        }
#endif
        return;
    }
    const int64_t groups = (rows + 7) / 8, pairs = groups / 2, gs = x.nb / (kquant(Q) ? 8 : 1) * record_bytes(Q);
    int64_t first = 0;
#ifdef BS_BLOCK_WIDE
    first = 2 * pairs;
#pragma omp for schedule(dynamic, chunk(pairs)) nowait
    for (int64_t j = 0; j < pairs; ++j) {
        const int valid = 8 + static_cast<int>(std::min<int64_t>(8, rows - 8 * (j + pairs)));
        row_tiles<V16, Q, rows_of<V16, Q>()>(x, 0, T, w + j * gs, pairs * gs, y + 8 * j, 8 * pairs, ys, valid);
    }
#endif
#pragma omp for schedule(dynamic, chunk(groups - first)) nowait
    for (int64_t g = first; g < groups; ++g) {
        const int valid = static_cast<int>(std::min<int64_t>(8, rows - 8 * g));
        row_tiles<V8, Q, rows_of<V8, Q>()>(x, 0, T, w + g * gs, gs, y + 8 * g, 0, ys, valid);
    }
}

void run_part(int64_t t, const Acts& x, int64_t T, const uint8_t* w, int64_t rows, float* y, int64_t ys) {
    switch (t) {
        case Q4_0: part<Q4_0>(x, T, w, rows, y, ys); break;
        case Q4_1: part<Q4_1>(x, T, w, rows, y, ys); break;
        case Q5_0: part<Q5_0>(x, T, w, rows, y, ys); break;
        case Q5_1: part<Q5_1>(x, T, w, rows, y, ys); break;
        case Q8_0: part<Q8_0>(x, T, w, rows, y, ys); break;
        case Q4_K: part<Q4_K>(x, T, w, rows, y, ys); break;
        case Q5_K: part<Q5_K>(x, T, w, rows, y, ys); break;
        case Q6_K: part<Q6_K>(x, T, w, rows, y, ys); break;
        case Q2_K: part<Q2_K>(x, T, w, rows, y, ys); break;
        case Q3_K: part<Q3_K>(x, T, w, rows, y, ys); break;
        case IQ4_NL: part<IQ4_NL>(x, T, w, rows, y, ys); break;
        case MXFP4: part<MXFP4>(x, T, w, rows, y, ys); break;
        case IQ4_XS: part<IQ4_XS>(x, T, w, rows, y, ys); break;
        default: break;
    }
}

}  // namespace

extern "C" {

// y [T, N] float32 = x [T, K] float32 times the transposed weight rows of the product `desc`
// describes (blocks.h): every part's columns, in order, from one quantization of x.
void bs_block_linear(const float* x, int64_t T, const int64_t* desc, float* y, int threads) {
    const int64_t K = desc[kDescK], N = desc[kDescN], parts = desc[kDescParts], nb = K / 32;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> xf;
    static thread_local std::vector<int32_t> xi;
    xq.resize(static_cast<size_t>(T * K));
    xf.resize(static_cast<size_t>(2 * T * nb));
    xi.resize(static_cast<size_t>(3 * T * nb));
    // The buffers are this (calling) thread's: the team reads them through these pointers.
    int8_t* q = xq.data();
    float* d = xf.data();
    float* s = d + T * nb;
    int32_t* x16 = xi.data();
    int32_t* nx = x16 + 2 * T * nb;
    const Acts acts{q, d, s, x16, nx, T, nb};
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * nb; ++i) {  // row t's block b, each alone (one row's blocks split too)
            const int64_t t = i / nb, b = i % nb;
            quantize_block16(x + t * K + b * 32, q + (b * T + t) * 32, d + b * T + t, s + b * T + t,
                             x16 + 2 * (b * T + t), nx + b * T + t);
        }
        int64_t col = 0;
        for (int64_t i = 0; i < parts; ++i) {
            const int64_t* p = desc + kDescHead + 3 * i;
            run_part(p[0], acts, T, reinterpret_cast<const uint8_t*>(static_cast<intptr_t>(p[2])), p[1], y + col, N);
            col += p[1];
        }
    }
}

int bs_block_wide() {
#ifdef BS_BLOCK_WIDE
    return 1;
#else
    return 0;
#endif
}

}  // extern "C"
