// The kernel layout of GGUF weight blocks (block_pack.cpp writes it, block_gemm.cpp reads it).
//
// A weight [N, K] is cut into groups of 8 output columns (N padded with zero columns) and, along K,
// into units: a block of 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) or a super-block of 256
// (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS). A group's units are consecutive records of kRecord[type] bytes: [N/8, K/unit, record].
// Paired types (Q4_0, Q8_0, IQ4_NL) take groups two at a time (N padded to 16): a pair's record
// holds both groups' 8-column records interleaved, each 32-byte vector of group 2i followed by the
// same vector of group 2i + 1, then the two groups' d (8 each): [N/16, K/32, 2 x record]. A 512-bit
// register loads both groups' vector at once, and a thread's groups are one stream.
// Inside a record every block of 32 values is 8 "steps" of 4 values, and a step is 32 bytes, byte
// 4j + r holding column j's value 4s + r: the operand layout of vpdpbusd / vpmaddubsw against
// 4 bytes of one activation row broadcast to every lane, so a column's sums stay in its lane.
//   nibbles  (4-bit planes): 4 chunks of 32 bytes a block, chunk p = step 2p | step 2p+1 << 4.
//   masks    (5th bits): a uint32 a step, bit 4j + r = the 5th bit of column j's value 4s + r.
//   high2    (2-bit planes: Q6_K's top 2 bits, Q2_K's and Q3_K's low 2): 2 vectors of 32 bytes a
//            block, vector h holding steps 4h + i in bits 2i, 2i + 1 of byte 4j + r.
//   fp16 fields (d, m, dmin) as the file's bits, 8 a group (one a column).
//   sc/mn (Q4_K, Q5_K: sub-block i's 6-bit scale and min, as many bits as the file's):
//            low[8 sub][8] byte (i, j) = sc low 4 bits | mn low 4 bits << 4;
//            high[4][8] byte (i % 4, j), nibble i / 4 = sc top 2 bits | mn top 2 bits << 2
//            (so 32 bytes of low and 32 of high decode 4 sub-blocks in byte lanes). Q3_K's 16 6-bit
//            scales take the same bytes: scale i < 8 in sc's place i, scale i >= 8 in mn's i - 8.
// IQ4_NL and IQ4_XS keep the file's 4-bit indices in nibbles; the kernel looks each up in the
// 16-entry table of int8 values (a byte shuffle) and takes it as Q8_0 takes its values.
// Record layouts (byte offsets), per group and unit:
//   Q4_0: nibbles[128] d[8]                                   144 (18 B per 32 values, the file's)
//   Q4_1: nibbles[128] d[8] m[8]                              160 (20)
//   Q5_0: nibbles[128] masks[8] d[8]                          176 (22)
//   Q5_1: nibbles[128] masks[8] d[8] m[8]                     192 (24)
//   Q8_0: values[8 steps][32] (q ^ 0x80, so unsigned) d[8]    272 (34)
//   IQ4_NL: as Q4_0                                           144 (18)
//   paired (Q4_0, Q8_0, IQ4_NL): vectors[4 or 8][2 groups][32] d[2 groups][8]  288, 544
//   Q4_K: d[8] dmin[8] low[8][8] high[4][8] nibbles[8 blocks][128]                   1152 (144 per 256, the file's)
//   Q5_K: d[8] dmin[8] low[8][8] high[4][8] masks[8 blocks][8] nibbles[8][128]       1408 (176, the file's)
//   Q6_K: d[8] sc[16 sub][8] (int8) high2[8 blocks][64] nibbles[8][128]              1680 (210, the file's)
//   Q2_K: d[8] dmin[8] scmn[16 sub][8] (the file's byte: sc | mn << 4) high2[8][64]  672 (84, the file's)
//   Q3_K: d[8] (16 unused) low[8][8] high[4][8] high2[8][64] masks[8][32]            896 (112; the file's 110)
//   IQ4_XS: d[8] sc[8 sub][8] (int8, the 6-bit scale - 32) nibbles[8][128]           1104 (138; the file's 136)
#pragma once
#include <stdint.h>

namespace blocks {

// GGMLQuantizationType values.
enum Type : int64_t {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39,
};

// One row per type: its unit of values, its bytes a unit in the file and in a group's record, and
// the columns a record holds (16: a paired type's two groups).
struct Traits {
    int64_t type, values, file, record, cols;
};
constexpr Traits kTraits[] = {
    {Q4_0, 32, 18, 288, 16},    {Q4_1, 32, 20, 160, 8},     {Q5_0, 32, 22, 176, 8},    {Q5_1, 32, 24, 192, 8},
    {Q8_0, 32, 34, 544, 16},    {IQ4_NL, 32, 18, 288, 16},  {Q2_K, 256, 84, 672, 8},   {Q3_K, 256, 110, 896, 8},
    {Q4_K, 256, 144, 1152, 8},  {Q5_K, 256, 176, 1408, 8},  {Q6_K, 256, 210, 1680, 8}, {IQ4_XS, 256, 136, 1104, 8},
    {MXFP4, 32, 17, 288, 16},
};
constexpr Traits traits(int64_t t) {
    for (const Traits& r : kTraits)
        if (r.type == t) return r;
    return {t, 0, 0, 0, 8};
}
constexpr bool known(int64_t t) { return traits(t).values != 0; }
constexpr bool kquant(int64_t t) { return traits(t).values == 256; }
constexpr int64_t unit_values(int64_t t) { return traits(t).values; }
// Bytes of one unit of one row in the file.
constexpr int64_t file_bytes(int64_t t) { return traits(t).file; }
// Bytes of one group's (a paired type's: one pair's) record of one unit in the kernel layout.
constexpr int64_t record_bytes(int64_t t) { return traits(t).record; }
// Output columns a record holds: 8, or 16 for a paired type.
constexpr int64_t record_cols(int64_t t) { return traits(t).cols; }
constexpr bool paired(int64_t t) { return record_cols(t) == 16; }
// MXFP4's E2M1 values times two (ggml's kvalues_mxfp4: its scale is 2^(e - 128), half of OCP's
// 2^(e - 127)), looked up as IQ4_NL's are.
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// The 4-bit index -> int8 value table of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Offsets inside a 32-value group's record (a paired type's: in each group's record before the
// interleaving; in the pair's, vector i of group h is at 64 i + 32 h and its d at 2 d32 + 16 h).
constexpr int64_t kNibbles = 0, kMasks32 = 128;
constexpr int64_t d32(int64_t t) { return t == Q8_0 ? 256 : (t == Q5_0 || t == Q5_1) ? 160 : 128; }
constexpr int64_t m32(int64_t t) { return d32(t) + 16; }
// Offsets inside a super-block record.
constexpr int64_t kD = 0, kDmin = 16, kScLow = 32, kScHigh = 96;
constexpr int64_t kMasksK = 128;                                // Q5_K
constexpr int64_t nibblesK(int64_t t) { return t == Q5_K ? 384 : t == Q4_K ? 128 : t == IQ4_XS ? 80 : 656; }
constexpr int64_t kScales6 = 16, kHigh2 = 144;                  // Q6_K
constexpr int64_t kScMn2 = 32, kCrumbs2 = 160;                  // Q2_K
constexpr int64_t kCrumbs3 = 128, kMasks3 = 640;                // Q3_K (its scales at kScLow, kScHigh)
constexpr int64_t kScalesXS = 16;                               // IQ4_XS

}  // namespace blocks

extern "C" {
// A product's descriptor (an int64 array the Python layer builds once): K, N (the output's
// columns), the part count P, then for each part its type, rows and packed weights' address.
// Parts write output columns in order: part i's rows are columns [sum of earlier rows, + rows).
enum : int64_t { kDescK = 0, kDescN = 1, kDescParts = 2, kDescHead = 3 };
}
