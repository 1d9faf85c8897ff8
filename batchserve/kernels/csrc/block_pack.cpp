// Repacking a GGUF tensor's blocks (the file's bytes, rows = output features) into the kernel
// layout blocks.h describes: a permutation of the file's values, scales and mins, nothing
// converted. Parallel over column groups, each group written by one thread from its 8 rows only,
// so a multi-gigabyte file repacks at memory speed.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"

using namespace blocks;

namespace {

inline uint32_t u32(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

inline void put32(uint8_t* p, uint32_t v) { memcpy(p, &v, 4); }

// Column j's 4 nibble chunks of one block of 32 values v(0..31), where v(l) is nibble `high` of
// byte Q[l] (l < 32; a K-quant's qs): chunk p, bytes 4j..4j+3 = v(8p + r) | v(8p + 4 + r) << 4.
// Whole 4-byte words at a time: the repacking runs at memory speed, not a value at a time.
inline void chunks_k(const uint8_t* Q, bool high, uint8_t* nib, int j) {
    for (int p = 0; p < 4; ++p) {
        const uint32_t a = u32(Q + 8 * p), b = u32(Q + 8 * p + 4);
        put32(nib + 32 * p + 4 * j, high ? ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u)
                                         : (a & 0x0F0F0F0Fu) | ((b << 4) & 0xF0F0F0F0u));
    }
}

// The same for a 32-value block's 16 bytes qs: v(e) is the low nibble of qs[e] for e < 16, the high
// nibble of qs[e - 16] after.
inline void chunks_32(const uint8_t* qs, uint8_t* nib, int j) {
    for (int p = 0; p < 2; ++p) {
        const uint32_t a = u32(qs + 8 * p), b = u32(qs + 8 * p + 4);
        put32(nib + 32 * p + 4 * j, (a & 0x0F0F0F0Fu) | ((b << 4) & 0xF0F0F0F0u));
        put32(nib + 32 * (p + 2) + 4 * j, ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u));
    }
}

// 8 columns' 5th bits of a block (H[j] bit e: value e of column j) -> the 8 steps' masks.
inline void masks(const uint32_t* H, uint8_t* out) {
    for (int s = 0; s < 8; ++s) {
        uint32_t m = 0;
        for (int j = 0; j < 8; ++j) m |= ((H[j] >> (4 * s)) & 15u) << (4 * j);
        put32(out + 4 * s, m);
    }
}

// Bit b of each of 32 bytes as a 32-bit word (a K-quant's qh: bit b of byte l is value l's).
inline uint32_t bit_plane(const uint8_t* p, int b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7 - b)));
}

// Sub-block j's 6-bit scale and min from a Q4_K/Q5_K super-block's 12 scale bytes S.
inline void scale_min(const uint8_t* S, int j, uint8_t* sc, uint8_t* mn) {
    if (j < 4) {
        *sc = S[j] & 63;
        *mn = S[j + 4] & 63;
    } else {
        *sc = static_cast<uint8_t>((S[j + 4] & 0xF) | ((S[j - 4] >> 6) << 4));
        *mn = static_cast<uint8_t>((S[j + 4] >> 4) | ((S[j] >> 6) << 4));
    }
}

// Column j's 2-bit plane of one block of 32 values v(l) = (Q[l] >> 2s) & 3 (l < 32): steps 4v + i
// (v < 2, i < 4) in bits 2i, 2i + 1 of bytes 4j..4j+3 of high2's vector v.
inline void crumbs(const uint8_t* Q, int s, uint8_t* high2, int j) {
    for (int v = 0; v < 2; ++v) {
        uint32_t w = 0;
        for (int i = 0; i < 4; ++i) w |= ((u32(Q + 16 * v + 4 * i) >> (2 * s)) & 0x03030303u) << (2 * i);
        put32(high2 + 32 * v + 4 * j, w);
    }
}

// Sub-block i's 6-bit scale (with its bias of 32) from a Q3_K super-block's 12 scale bytes S.
inline uint8_t scale3(const uint8_t* S, int i) {
    const int low = i < 8 ? S[i] & 0xF : S[i - 8] >> 4;
    return static_cast<uint8_t>(low | ((S[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
}

// Q2_K and Q3_K: value n = 128h + 32s + l of a super-block is (qs[32h + l] >> 2s) & 3, in block
// 4h + s; Q3_K's third bit is bit 4h + s of hmask[l] (its stored value then is 0..7, offset 4).
void pack_low_bits(int64_t t, const uint8_t* const* src, uint8_t* rec) {
    const int64_t qs = t == Q2_K ? 16 : 32, planes = t == Q2_K ? kCrumbs2 : kCrumbs3;
    if (t == Q3_K) memset(rec + kScHigh, 0, 32);  // or-ed into below
    for (int j = 0; j < 8; ++j) {
        if (t == Q2_K) {
            memcpy(rec + kD + 2 * j, src[j] + 80, 2);
            memcpy(rec + kDmin + 2 * j, src[j] + 82, 2);
            for (int i = 0; i < 16; ++i) rec[kScMn2 + 8 * i + j] = src[j][i];
        } else {
            memcpy(rec + kD + 2 * j, src[j] + 108, 2);
            for (int i = 0; i < 8; ++i) {  // as Q4_K's sc (scales 0..7) and mn (scales 8..15)
                const uint8_t sc = scale3(src[j] + 96, i), mn = scale3(src[j] + 96, i + 8);
                rec[kScLow + 8 * i + j] = static_cast<uint8_t>((sc & 15) | (mn & 15) << 4);
                rec[kScHigh + 8 * (i % 4) + j] |= static_cast<uint8_t>(((sc >> 4) | (mn >> 4) << 2) << (4 * (i / 4)));
            }
        }
    }
    for (int b = 0; b < 8; ++b) {
        const int h = b / 4, s = b % 4;
        uint32_t H[8];
        for (int j = 0; j < 8; ++j) {
            crumbs(src[j] + qs + 32 * h, s, rec + planes + 64 * b, j);
            if (t == Q3_K) H[j] = bit_plane(src[j], 4 * h + s);
        }
        if (t == Q3_K) masks(H, rec + kMasks3 + 32 * b);
    }
}

// The float16 bits of 2^(e - 128) (MXFP4's scale as ggml applies it to its doubled values): a
// normal float16 for e in 113..143, a subnormal (still exact: a power of two) for 104..112, zero
// for the all-zero padding; other exponents never reach here (`mxfp4_fits` in Python refuses them).
uint16_t e8m0_half(uint8_t e) {
    const int p = static_cast<int>(e) - 128;
    if (p >= -14) return static_cast<uint16_t>((p + 15) << 10);
    return p >= -24 ? static_cast<uint16_t>(1u << (p + 24)) : 0;
}

void put16(uint8_t* at, uint16_t v) { memcpy(at, &v, 2); }

// Group g's record of unit u; rows past N (the padding) are zero blocks.
void pack_unit(int64_t t, const uint8_t* raw, int64_t N, int64_t row_stride, int64_t g, int64_t u, uint8_t* rec) {
    static const uint8_t zero[256] = {0};
    const uint8_t* src[8];
    for (int j = 0; j < 8; ++j) {
        const int64_t n = 8 * g + j;
        src[j] = n < N ? raw + n * row_stride + u * file_bytes(t) : zero;
    }
    uint32_t H[8];
    if (!kquant(t)) {
        for (int j = 0; j < 8; ++j) {
            if (t == MXFP4) {  // d = 2^(e - 128) as float16: exact for e in 104..143 (`mxfp4_fits`)
                put16(rec + d32(t) + 2 * j, e8m0_half(src[j][0]));
                chunks_32(src[j] + 1, rec + kNibbles, j);
                continue;
            }
            memcpy(rec + d32(t) + 2 * j, src[j], 2);                                    // d
            if (t == Q4_1 || t == Q5_1) memcpy(rec + m32(t) + 2 * j, src[j] + 2, 2);    // m
            if (t == Q8_0) {  // step s, bytes 4j..4j+3: values 4s..4s+3, made unsigned
                for (int s = 0; s < 8; ++s) put32(rec + 32 * s + 4 * j, u32(src[j] + 2 + 4 * s) ^ 0x80808080u);
                continue;
            }
            chunks_32(src[j] + (t == Q4_0 || t == IQ4_NL ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8), rec + kNibbles, j);
            if (t == Q5_0 || t == Q5_1) H[j] = u32(src[j] + (t == Q5_0 ? 2 : 4));
        }
        if (t == Q5_0 || t == Q5_1) masks(H, rec + kMasks32);
        return;
    }
    if (t == Q2_K || t == Q3_K) {
        pack_low_bits(t, src, rec);
        return;
    }
    if (t == IQ4_XS) {
        for (int j = 0; j < 8; ++j) {
            memcpy(rec + kD + 2 * j, src[j], 2);
            const uint16_t sh = static_cast<uint16_t>(src[j][2] | src[j][3] << 8);
            for (int i = 0; i < 8; ++i) {  // the 6-bit scale of sub-block i, less its bias of 32
                const int ls = ((src[j][4 + i / 2] >> (4 * (i % 2))) & 0xF) | (((sh >> (2 * i)) & 3) << 4);
                rec[kScalesXS + 8 * i + j] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
            }
            for (int b = 0; b < 8; ++b) chunks_32(src[j] + 8 + 16 * b, rec + nibblesK(t) + 128 * b, j);
        }
        return;
    }
    if (t != Q6_K) memset(rec + kScHigh, 0, 32);  // or-ed into below
    for (int j = 0; j < 8; ++j) {
        if (t == Q6_K) {
            memcpy(rec + kD + 2 * j, src[j] + 208, 2);
            for (int i = 0; i < 16; ++i) rec[kScales6 + 8 * i + j] = src[j][192 + i];
        } else {
            memcpy(rec + kD + 2 * j, src[j], 2);
            memcpy(rec + kDmin + 2 * j, src[j] + 2, 2);
            for (int i = 0; i < 8; ++i) {
                uint8_t sc, mn;
                scale_min(src[j] + 4, i, &sc, &mn);
                rec[kScLow + 8 * i + j] = static_cast<uint8_t>((sc & 15) | (mn & 15) << 4);
                rec[kScHigh + 8 * (i % 4) + j] |= static_cast<uint8_t>(((sc >> 4) | (mn >> 4) << 2) << (4 * (i / 4)));
            }
        }
    }
    for (int b = 0; b < 8; ++b) {
        uint8_t* nib = rec + nibblesK(t) + 128 * b;
        if (t == Q6_K) {  // value n = 128h + 32s + l of the super-block
            const int h = b / 4, s = b % 4;
            uint8_t* high2 = rec + kHigh2 + 64 * b;
            for (int j = 0; j < 8; ++j) {
                chunks_k(src[j] + 64 * h + 32 * (s & 1), s >= 2, nib, j);
                crumbs(src[j] + 128 + 32 * h, s, high2, j);  // value l's top bits: (qh[l] >> 2s) & 3
            }
            continue;
        }
        const int qs = t == Q4_K ? 16 : 48;  // value n = 64c + 32t + l: nibble t of qs[32c + l]
        for (int j = 0; j < 8; ++j) {
            chunks_k(src[j] + qs + 32 * (b / 2), b % 2, nib, j);
            if (t == Q5_K) H[j] = bit_plane(src[j] + 16, b);
        }
        if (t == Q5_K) masks(H, rec + kMasksK + 32 * b);
    }
}

// A paired type's (blocks.h) record of pair j, unit u: groups 2j and 2j + 1's records as pack_unit
// writes them, interleaved 32 bytes at a time, then their d.
void pack_pair(int64_t t, const uint8_t* raw, int64_t N, int64_t row_stride, int64_t j, int64_t u, uint8_t* rec) {
    alignas(64) uint8_t group[2][272];  // an 8-column record: vectors then d (Q8_0's the longest)
    const int64_t vectors = d32(t) / 32;
    for (int h = 0; h < 2; ++h) {
        pack_unit(t, raw, N, row_stride, 2 * j + h, u, group[h]);
        for (int64_t i = 0; i < vectors; ++i) memcpy(rec + 64 * i + 32 * h, group[h] + 32 * i, 32);
        memcpy(rec + 2 * d32(t) + 16 * h, group[h] + d32(t), 16);
    }
}

}  // namespace

extern "C" {

// Bytes of the kernel layout of a [N, K] weight of type t (0 where t or K does not fit).
int64_t bs_block_packed_size(int64_t t, int64_t N, int64_t K) {
    if (!known(t) || K <= 0 || K % unit_values(t) || N <= 0) return 0;
    return (N + record_cols(t) - 1) / record_cols(t) * (K / unit_values(t)) * record_bytes(t);
}

// raw: the file's [N, K] blocks of type t, row n at raw + n * row_stride -> out (bs_block_packed_size bytes).
void bs_block_pack(int64_t t, const uint8_t* raw, int64_t N, int64_t K, int64_t row_stride, uint8_t* out,
                   int threads) {
    const int64_t groups = (N + record_cols(t) - 1) / record_cols(t), units = K / unit_values(t), rec = record_bytes(t);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t u = 0; u < units; ++u) {
            uint8_t* r = out + (g * units + u) * rec;
            if (paired(t)) pack_pair(t, raw, N, row_stride, g, u, r);
            else pack_unit(t, raw, N, row_stride, g, u, r);
        }
}

}  // extern "C"
