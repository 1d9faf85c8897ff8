// The vector operations block_gemm.cpp's one kernel body is written in, for two widths: V8 (one
// column group in a 256-bit register: AVX2, with AVX512-VNNI/VL where there is) and V16 (two
// groups in one 512-bit register: AVX-512 F/BW/VNNI). Each operation does the same per-lane
// arithmetic at both widths, and every integer sum is exact, so a column's output has the same bits
// whichever width, tile or machine computes it. `gs` is the byte distance between the two groups'
// records (unused by V8), which need not be neighbours.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BS_BLOCK_VNNI 1
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define BS_BLOCK_VLBW 1
#endif
#if defined(BS_BLOCK_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define BS_BLOCK_WIDE 1
#endif
#if defined(__AVX512VBMI__) && defined(__AVX512VL__)
#define BS_BLOCK_VBMI 1
#endif

namespace blockvec {

inline uint32_t u32(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

struct V8 {
    static constexpr int kCols = 8;
    using I = __m256i;
    using F = __m256;
    // Q8_0's stored q ^ 0x80 against x: vpdpbusd takes it unsigned (the kernel then subtracts
    // 128 * sum(x)); vpmaddubsw's int16 pairs could not, so AVX2 multiplies |q| by x carrying q's sign.
#ifdef BS_BLOCK_VNNI
    static constexpr int32_t kQ8Offset = 128;
#else
    static constexpr int32_t kQ8Offset = 0;
#endif
    static I load(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static F half(const uint8_t* p, int64_t) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
    // A paired type's (blocks.h) vector and d of one group (V16: of both, side by side at p; V32:
    // and of the pair gs bytes on).
    static I loadp(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static F halfp(const uint8_t* p, int64_t) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static F u8f(const uint8_t* p, int64_t) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static I i8i(const uint8_t* p, int64_t) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
    static I u8i(const uint8_t* p, int64_t) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
    static I bytes(char v) { return _mm256_set1_epi8(v); }
    // A 16-entry int8 table as Q8_0 stores values (v ^ 0x80), in both 128-bit lanes (vpshufb reads
    // each lane's own copy).
    static I table(const int8_t* v) {
        const __m128i t = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)), _mm_set1_epi8(static_cast<char>(0x80)));
        return _mm256_broadcastsi128_si256(t);
    }
    // The table's values of each byte's low and high 4-bit index (nibble planes as blocks.h stores
    // them). VBMI's vpermb reads an index's low 5 bits, and `table` holds the 16 values twice: the
    // low nibbles need no mask, the high ones a shift (vpshufb: a mask each, bit 7 zeroes).
    static void lookup_nibbles(I table, I raw, I& lo, I& hi) {
#ifdef BS_BLOCK_VBMI
        lo = _mm256_permutexvar_epi8(raw, table);
        hi = _mm256_permutexvar_epi8(_mm256_srli_epi16(raw, 4), table);
#else
        const I low = _mm256_set1_epi8(0x0F);
        lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low));
        hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
#endif
    }
    static I and32(I a, int32_t b) { return _mm256_and_si256(a, _mm256_set1_epi32(b)); }
    static I srl32(I a, int n) { return _mm256_srli_epi32(a, n); }
    static I and_(I a, I b) { return _mm256_and_si256(a, b); }
    static I or_(I a, I b) { return _mm256_or_si256(a, b); }
    static I srl16(I a, int n) { return _mm256_srli_epi16(a, n); }
    static I sll16(I a, int n) { return _mm256_slli_epi16(a, n); }
    // w + v in the bytes whose bit is set in the step's 32-bit mask at p.
    static I add_masked(I w, const uint8_t* p, int64_t, I v) {
#ifdef BS_BLOCK_VLBW
        return _mm256_mask_add_epi8(w, u32(p), w, v);
#else
        const I b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(u32(p))),
                                        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
        const I bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
        return _mm256_add_epi8(w, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit), v));
#endif
    }
    static I x4(int32_t v) { return _mm256_set1_epi32(v); }
    static I shl_bcast(const int32_t* p, int n) { return _mm256_slli_epi32(_mm256_set1_epi32(*p), n); }  // *p << n, every lane
    // acc + the sums of 4 products (w unsigned, at most 63 here; x signed) in each int32 lane.
    static I dot(I acc, I w, I x) {
#ifdef BS_BLOCK_VNNI
        return _mm256_dpbusd_epi32(acc, w, x);
#else
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
    }
    // dot and dot_q8 against 4 bytes of x broadcast (V16: vpdpbusd's embedded broadcast).
    static I dotm(I acc, I w, const int32_t* x) { return dot(acc, w, x4(*x)); }
    static I dotm_q8(I acc, I w, const int32_t* x) { return dot_q8(acc, w, x4(*x)); }
    static I dot_q8(I acc, I w, I x) {
#ifdef BS_BLOCK_VNNI
        return _mm256_dpbusd_epi32(acc, w, x);
#else
        const I q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
        const I prod = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
#endif
    }
    static I zero() { return _mm256_setzero_si256(); }
    static I sub32(I a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
    static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
    static I mul32(I a, I b) { return _mm256_mullo_epi32(a, b); }
    static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
    static F fzero() { return _mm256_setzero_ps(); }
    static F splat(float v) { return _mm256_set1_ps(v); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
    static void store(float* y, int64_t, F v, int valid) {  // (y's offset of a second group: V16's)
        if (valid >= kCols) {
            _mm256_storeu_ps(y, v);
        } else {
            alignas(32) float tmp[kCols];
            _mm256_store_ps(tmp, v);
            memcpy(y, tmp, sizeof(float) * static_cast<size_t>(valid));
        }
    }
};

// A paired type's (blocks.h) two groups in two 256-bit registers: V8's arithmetic lane for lane,
// for one row without AVX-512, where V8 tiles of each group would read every cache line of the
// pair's records twice (Q8_0's one-row product ran 0.77x).
struct V8x2 {
    static constexpr int kCols = 16;
    static constexpr int32_t kQ8Offset = V8::kQ8Offset;
    struct I {
        __m256i a, b;
    };
    struct F {
        __m256 a, b;
    };
    static I two(__m256i v) { return {v, v}; }
    static I bytes(char v) { return two(V8::bytes(v)); }
    static I table(const int8_t* v) { return two(V8::table(v)); }
    static I zero() { return two(V8::zero()); }
    static F fzero() { return {V8::fzero(), V8::fzero()}; }
    static I shl_bcast(const int32_t* p, int n) { return two(V8::shl_bcast(p, n)); }
    static I load(const uint8_t* p, int64_t gs) { return {V8::load(p, 0), V8::load(p + gs, 0)}; }
    static I loadp(const uint8_t* p, int64_t) { return {V8::loadp(p, 0), V8::loadp(p + 32, 0)}; }
    static F halfp(const uint8_t* p, int64_t) { return {V8::halfp(p, 0), V8::halfp(p + 16, 0)}; }
    static I and_(I x, I y) { return {V8::and_(x.a, y.a), V8::and_(x.b, y.b)}; }
    static I srl16(I x, int n) { return {V8::srl16(x.a, n), V8::srl16(x.b, n)}; }
    static void lookup_nibbles(I table, I raw, I& lo, I& hi) {
        V8::lookup_nibbles(table.a, raw.a, lo.a, hi.a);
        V8::lookup_nibbles(table.b, raw.b, lo.b, hi.b);
    }
    static I dotm(I acc, I w, const int32_t* x) {
#ifdef BS_BLOCK_VNNI
        return {V8::dotm(acc.a, w.a, x), V8::dotm(acc.b, w.b, x)};
#else
        const __m256i xv = V8::x4(*x);
        return {V8::dot(acc.a, w.a, xv), V8::dot(acc.b, w.b, xv)};
#endif
    }
    static I dotm_q8(I acc, I w, const int32_t* x) {
#ifdef BS_BLOCK_VNNI
        return {V8::dotm_q8(acc.a, w.a, x), V8::dotm_q8(acc.b, w.b, x)};
#else
        const __m256i xv = V8::x4(*x);
        return {V8::dot_q8(acc.a, w.a, xv), V8::dot_q8(acc.b, w.b, xv)};
#endif
    }
    static F cvt(I x) { return {V8::cvt(x.a), V8::cvt(x.b)}; }
    static F splat(float v) { return {V8::splat(v), V8::splat(v)}; }
    static F mul(F x, F y) { return {V8::mul(x.a, y.a), V8::mul(x.b, y.b)}; }
    static F fma(F x, F y, F z) { return {V8::fma(x.a, y.a, z.a), V8::fma(x.b, y.b, z.b)}; }
    // The first group's 8 lanes at y, the second's at y + yo: the first `valid` of the 16.
    static void store(float* y, int64_t yo, F v, int valid) {
        V8::store(y, 0, v.a, valid < 8 ? valid : 8);
        if (valid > 8) V8::store(y + yo, 0, v.b, valid - 8);
    }
};

#ifdef BS_BLOCK_WIDE
struct V16 {
    static constexpr int kCols = 16;
    using I = __m512i;
    using F = __m512;
    static constexpr int32_t kQ8Offset = 128;
    static __m128i two8(const uint8_t* p, int64_t gs) {
        return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + gs)));
    }
    static I load(const uint8_t* p, int64_t gs) {
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + gs)), 1);
    }
    static F half(const uint8_t* p, int64_t gs) {
        return _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + gs)), 1));
    }
    static I loadp(const uint8_t* p, int64_t) { return _mm512_loadu_si512(p); }
    static F halfp(const uint8_t* p, int64_t) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static F u8f(const uint8_t* p, int64_t gs) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(two8(p, gs))); }
    static I i8i(const uint8_t* p, int64_t gs) { return _mm512_cvtepi8_epi32(two8(p, gs)); }
    static I u8i(const uint8_t* p, int64_t gs) { return _mm512_cvtepu8_epi32(two8(p, gs)); }
    static I bytes(char v) { return _mm512_set1_epi8(v); }
    static I table(const int8_t* v) {
        const __m128i t = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)), _mm_set1_epi8(static_cast<char>(0x80)));
        return _mm512_broadcast_i32x4(t);
    }
    static void lookup_nibbles(I table, I raw, I& lo, I& hi) {  // V8's (the table 4 times: 6 index bits)
#ifdef BS_BLOCK_VBMI
        lo = _mm512_permutexvar_epi8(raw, table);
        hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(raw, 4), table);
#else
        const I low = _mm512_set1_epi8(0x0F);
        lo = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, low));
        hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
#endif
    }
    static I and32(I a, int32_t b) { return _mm512_and_si512(a, _mm512_set1_epi32(b)); }
    static I srl32(I a, int n) { return _mm512_srli_epi32(a, static_cast<unsigned>(n)); }
    static I and_(I a, I b) { return _mm512_and_si512(a, b); }
    static I or_(I a, I b) { return _mm512_or_si512(a, b); }
    static I srl16(I a, int n) { return _mm512_srli_epi16(a, static_cast<unsigned>(n)); }
    static I sll16(I a, int n) { return _mm512_slli_epi16(a, static_cast<unsigned>(n)); }
    static I add_masked(I w, const uint8_t* p, int64_t gs, I v) {
        return _mm512_mask_add_epi8(w, u32(p) | static_cast<uint64_t>(u32(p + gs)) << 32, w, v);
    }
    static I x4(int32_t v) { return _mm512_set1_epi32(v); }
    static I shl_bcast(const int32_t* p, int n) { return _mm512_slli_epi32(_mm512_set1_epi32(*p), static_cast<unsigned>(n)); }
    static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
    // GCC does not fold a broadcast load into vpdpbusd's {1to16} operand: a separate vpbroadcastd
    // for each of a tile's 16 dot products a step measured 5-15% slower.
    static I dotm(I acc, I w, const int32_t* x) {
        asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
        return acc;
    }
    static I dotm_q8(I acc, I w, const int32_t* x) { return dotm(acc, w, x); }
    static I dot_q8(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
    static I zero() { return _mm512_setzero_si512(); }
    static I sub32(I a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
    static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
    static I mul32(I a, I b) { return _mm512_mullo_epi32(a, b); }
    static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
    static F fzero() { return _mm512_setzero_ps(); }
    static F splat(float v) { return _mm512_set1_ps(v); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
    // The first group's 8 lanes at y, the second's at y + yo: the first `valid` of the 16.
    static void store(float* y, int64_t yo, F v, int valid) {
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        if (valid >= kCols) {
            _mm256_storeu_ps(y, _mm512_castps512_ps256(v));
            _mm256_storeu_ps(y + yo, hi);
            return;
        }
        const uint32_t keep = (1u << valid) - 1;
        _mm256_mask_storeu_ps(y, __mmask8(keep), _mm512_castps512_ps256(v));
        _mm256_mask_storeu_ps(y + yo, __mmask8(keep >> 8), hi);
    }
};

// Two of a paired type's pairs (blocks.h), gs bytes apart, in two 512-bit registers: V16's
// arithmetic lane for lane, for one row: two streams a thread (from memory, one thread, a pair a
// tile streamed 0.9-1.0x as fast).
struct V32 {
    static constexpr int kCols = 32;
    static constexpr int32_t kQ8Offset = V16::kQ8Offset;
    struct I {
        __m512i a, b;
    };
    struct F {
        __m512 a, b;
    };
    static I two(__m512i v) { return {v, v}; }
    static I bytes(char v) { return two(V16::bytes(v)); }
    static I table(const int8_t* v) { return two(V16::table(v)); }
    static I zero() { return two(V16::zero()); }
    static F fzero() { return {V16::fzero(), V16::fzero()}; }
    static I shl_bcast(const int32_t* p, int n) { return two(V16::shl_bcast(p, n)); }
    static I load(const uint8_t* p, int64_t gs) { return {V16::load(p, 0), V16::load(p + gs, 0)}; }
    static I loadp(const uint8_t* p, int64_t gs) { return {V16::loadp(p, 0), V16::loadp(p + gs, 0)}; }
    static F halfp(const uint8_t* p, int64_t gs) { return {V16::halfp(p, 0), V16::halfp(p + gs, 0)}; }
    static I and_(I x, I y) { return {V16::and_(x.a, y.a), V16::and_(x.b, y.b)}; }
    static I srl16(I x, int n) { return {V16::srl16(x.a, n), V16::srl16(x.b, n)}; }
    static void lookup_nibbles(I table, I raw, I& lo, I& hi) {
        V16::lookup_nibbles(table.a, raw.a, lo.a, hi.a);
        V16::lookup_nibbles(table.b, raw.b, lo.b, hi.b);
    }
    static I dotm(I acc, I w, const int32_t* x) { return {V16::dotm(acc.a, w.a, x), V16::dotm(acc.b, w.b, x)}; }
    static I dotm_q8(I acc, I w, const int32_t* x) { return dotm(acc, w, x); }
    static F cvt(I x) { return {V16::cvt(x.a), V16::cvt(x.b)}; }
    static F splat(float v) { return {V16::splat(v), V16::splat(v)}; }
    static F mul(F x, F y) { return {V16::mul(x.a, y.a), V16::mul(x.b, y.b)}; }
    static F fma(F x, F y, F z) { return {V16::fma(x.a, y.a, z.a), V16::fma(x.b, y.b, z.b)}; }
    // The first pair's 16 columns at y and y + 8, the second's at y + yo and y + yo + 8: the
    // first `valid` of the 32.
    static void store(float* y, int64_t yo, F v, int valid) {
        V16::store(y, 8, v.a, valid < 16 ? valid : 16);
        if (valid > 16) V16::store(y + yo, 8, v.b, valid - 16);
    }
};
#endif

}  // namespace blockvec
