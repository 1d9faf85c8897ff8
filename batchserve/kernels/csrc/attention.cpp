// Paged attention over the KV pool for a packed ragged step, float32, on CPU: a step's new keys
// and values are written to their pool slots, then every row attends over the keys it may see.
//
// A row's visible keys are given as a list of pool slots in logical (position) order: a prefix
// of its request's slots (the committed keys, the chunk rows before it, or for a draft node the
// whole chunk), then a tail (a draft node's ancestors and itself). Its output is a function of
// its query and that list alone, computed by one thread in one fixed order: scores key after key
// (each a dot product over the head dim in one fixed order), their max, exp elementwise (our own
// polynomial, not libm's, so the bits do not depend on how the loop is vectorized), the
// denominator summed key after key, and the weighted values summed key after key. A draft node
// therefore gets the bits it gets when its token is decoded alone, whatever rows share the step,
// wherever its keys sit in the pool and however many threads run. A head's sink (gpt-oss's: a
// learned logit with no value) enters the max and the denominator only, first in each.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <cmath>
#include <vector>

#include "vec.h"

namespace {

// One key's score: the dot product of q and k over D (a multiple of 8), chunk after chunk into
// one accumulator, then its 8 lanes summed as hsum does: ((0+4) + (2+6)) + ((1+5) + (3+7)).
inline float dot(const float* q, const float* k, int64_t D) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    for (int64_t c = 8; c < D; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), acc);
    return hsum(acc);
}

struct Step {
    const float* q;  // [Hq, T, D], unit stride in a row
    int64_t q_head, q_row;
    int64_t T, Hq, Hkv, D;
    const float* keys;  // the layer's pool [Hkv, S, D]
    const float* values;
    int64_t S;
    const int32_t* slots;        // every request's slots, in logical order, back to back
    const int32_t* prefix_at;    // [T] where row t's prefix starts in `slots`
    const int32_t* prefix_len;   // [T]
    const int32_t* tails;        // draft nodes' ancestors-and-self slots, by depth, back to back
    const int32_t* tail_at;      // [T]
    const int32_t* tail_len;     // [T]
    float scale;
    float softcap;  // > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2's)
    const float* sinks;  // [Hq] each head's sink logit, or null for none
    float* out;  // [T, Hq, D]
};

inline int32_t slot_of(const Step& s, int64_t t, int64_t j) {
    const int64_t p = s.prefix_len[t];
    return j < p ? s.slots[s.prefix_at[t] + j] : s.tails[s.tail_at[t] + (j - p)];
}

// Four keys' scores for NG query heads at once, each with exactly `dot`'s operations: per head four
// independent FMA chains (where one chain waits on each FMA's latency), their lanes summed in
// hsum's order through a 4x4 transpose; every key vector is loaded once for all NG heads.
template <int NG>
inline void dot4_heads(const float* const* q, const float* k0, const float* k1, const float* k2, const float* k3,
                       int64_t D, __m128* out) {
    __m256 a[NG][4];
    {
        const __m256 v0 = _mm256_loadu_ps(k0), v1 = _mm256_loadu_ps(k1), v2 = _mm256_loadu_ps(k2),
                     v3 = _mm256_loadu_ps(k3);
        for (int g = 0; g < NG; ++g) {
            const __m256 q0 = _mm256_loadu_ps(q[g]);
            a[g][0] = _mm256_mul_ps(q0, v0), a[g][1] = _mm256_mul_ps(q0, v1);
            a[g][2] = _mm256_mul_ps(q0, v2), a[g][3] = _mm256_mul_ps(q0, v3);
        }
    }
    for (int64_t c = 8; c < D; c += 8) {
        const __m256 v0 = _mm256_loadu_ps(k0 + c), v1 = _mm256_loadu_ps(k1 + c), v2 = _mm256_loadu_ps(k2 + c),
                     v3 = _mm256_loadu_ps(k3 + c);
        for (int g = 0; g < NG; ++g) {
            const __m256 qc = _mm256_loadu_ps(q[g] + c);
            a[g][0] = _mm256_fmadd_ps(qc, v0, a[g][0]), a[g][1] = _mm256_fmadd_ps(qc, v1, a[g][1]);
            a[g][2] = _mm256_fmadd_ps(qc, v2, a[g][2]), a[g][3] = _mm256_fmadd_ps(qc, v3, a[g][3]);
        }
    }
    for (int g = 0; g < NG; ++g) {  // per key [v0+v4, v1+v5, v2+v6, v3+v7], as hsum's first add, then the rest
        __m128 h0 = _mm_add_ps(_mm256_castps256_ps128(a[g][0]), _mm256_extractf128_ps(a[g][0], 1));
        __m128 h1 = _mm_add_ps(_mm256_castps256_ps128(a[g][1]), _mm256_extractf128_ps(a[g][1], 1));
        __m128 h2 = _mm_add_ps(_mm256_castps256_ps128(a[g][2]), _mm256_extractf128_ps(a[g][2], 1));
        __m128 h3 = _mm_add_ps(_mm256_castps256_ps128(a[g][3]), _mm256_extractf128_ps(a[g][3], 1));
        _MM_TRANSPOSE4_PS(h0, h1, h2, h3);
        out[g] = _mm_add_ps(_mm_add_ps(h0, h2), _mm_add_ps(h1, h3));
    }
}

// Row t, the NG query heads from qh0 (all of KV head h): each head's scores into its `w` (length n,
// padded to a multiple of 8), then its output. Per head the operations and their order are those
// of one head alone (keys in order, `dot`'s sums, the max, exp, the denominator, then values key
// after key into each output lane); grouping only shares the loads of each key and value.
template <int NG>
void attend_heads(const Step& s, int64_t t, int64_t qh0, std::vector<float>& scratch, const int64_t* at) {
    const int64_t D = s.D, n = s.prefix_len[t] + s.tail_len[t], padded = (n + 7) / 8 * 8;
    const int64_t h = qh0 / (s.Hq / s.Hkv);
    const float* q[NG];
    for (int g = 0; g < NG; ++g) q[g] = s.q + (qh0 + g) * s.q_head + t * s.q_row;
    const float* kh = s.keys + h * s.S * D;
    const float* vh = s.values + h * s.S * D;
    scratch.resize(static_cast<size_t>(NG * padded));
    float* w[NG];
    for (int g = 0; g < NG; ++g) w[g] = scratch.data() + g * padded;
    const __m128 scale = _mm_set1_ps(s.scale);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        __m128 d4[NG];
        dot4_heads<NG>(q, kh + at[j], kh + at[j + 1], kh + at[j + 2], kh + at[j + 3], D, d4);
        for (int g = 0; g < NG; ++g) _mm_storeu_ps(&w[g][j], _mm_mul_ps(d4[g], scale));
    }
    for (; j < n; ++j) {
        for (int g = 0; g < NG; ++g) w[g][j] = dot(q[g], kh + at[j], D) * s.scale;
    }
    if (s.softcap > 0.0f) {  // elementwise, scalar libm: a score's bits depend on it alone
        for (int g = 0; g < NG; ++g)
            for (j = 0; j < n; ++j) w[g][j] = s.softcap * std::tanh(w[g][j] / s.softcap);
    }
    // The max and the denominator head by head in key order, the heads' chains interleaved.
    float mx[NG], den[NG];
    for (int g = 0; g < NG; ++g) mx[g] = s.sinks != nullptr ? s.sinks[qh0 + g] : -INFINITY, den[g] = 0.0f;
    for (j = 0; j < n; ++j)
        for (int g = 0; g < NG; ++g) mx[g] = w[g][j] > mx[g] ? w[g][j] : mx[g];
    for (int g = 0; g < NG; ++g) {
        for (j = n; j < padded; ++j) w[g][j] = mx[g];  // padding: exp(0), unused
        const __m256 m = _mm256_set1_ps(mx[g]);
        for (j = 0; j < n; j += 8) _mm256_storeu_ps(&w[g][j], exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&w[g][j]), m)));
        if (s.sinks != nullptr)  // the sink's share of the denominator, before the keys'
            den[g] = _mm256_cvtss_f32(exp_nonpositive(_mm256_set1_ps(s.sinks[qh0 + g] - mx[g])));
    }
    for (j = 0; j < n; ++j)
        for (int g = 0; g < NG; ++g) den[g] += w[g][j];
    for (int g = 0; g < NG; ++g) {
        float* o = s.out + (t * s.Hq + qh0 + g) * D;
        for (int64_t c = 0; c < D; c += 64) {  // 8 independent accumulators at a time, keys in order for each
            const int64_t width = D - c < 64 ? D - c : 64;
            __m256 acc[8];
            for (int a = 0; a < 8; ++a) acc[a] = _mm256_setzero_ps();
            for (j = 0; j < n; ++j) {
                const float* v = vh + at[j] + c;
                const __m256 p = _mm256_set1_ps(w[g][j]);
                for (int64_t a = 0; a < width / 8; ++a) acc[a] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * a), acc[a]);
            }
            const __m256 d = _mm256_set1_ps(den[g]);
            for (int64_t a = 0; a < width / 8; ++a) _mm256_storeu_ps(o + c + 8 * a, _mm256_div_ps(acc[a], d));
        }
    }
}

// Every query head of KV head h for row t, three at a time (registers for 3 x 4 chains); `at`
// holds the offsets of the row's keys in a head's pool (slot x D), looked up once for them all.
void attend_group(const Step& s, int64_t t, int64_t h, std::vector<float>& scratch, std::vector<int64_t>& at) {
    const int64_t G = s.Hq / s.Hkv, n = s.prefix_len[t] + s.tail_len[t];
    at.resize(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) at[j] = static_cast<int64_t>(slot_of(s, t, j)) * s.D;
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) attend_heads<3>(s, t, h * G + g, scratch, at.data());
    if (G - g == 2) attend_heads<2>(s, t, h * G + g, scratch, at.data());
    else if (G - g == 1) attend_heads<1>(s, t, h * G + g, scratch, at.data());
}

}  // namespace

extern "C" {

// Write the step's k and v ([Hkv, T, D]) to their pool slots, then attend every row of q
// ([Hq, T, D]) (see Step). q, k and v: any head and row strides, unit stride inside a row; D % 8 == 0.
// sinks: [Hq] or null.
void bs_attention(const float* q, int64_t q_head, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                  const float* k, int64_t k_head,
                  int64_t k_row, const float* v, int64_t v_head, int64_t v_row, const int64_t* slot_mapping,
                  float* keys, float* values, int64_t S, const int32_t* slots, const int32_t* prefix_at,
                  const int32_t* prefix_len, const int32_t* tails, const int32_t* tail_at, const int32_t* tail_len,
                  float scale, float softcap, const float* sinks, float* out, int threads) {
    const Step s{q,     q_head,     q_row, T,       Hq,      Hkv,      D,     keys,    values, S,
                 slots, prefix_at, prefix_len, tails, tail_at, tail_len, scale, softcap, sinks, out};
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < Hkv * T; ++i) {
            const int64_t h = i / T, t = i % T, slot = slot_mapping[t];
            for (int64_t c = 0; c < D; c += 8) {
                _mm256_storeu_ps(keys + (h * S + slot) * D + c, _mm256_loadu_ps(k + h * k_head + t * k_row + c));
                _mm256_storeu_ps(values + (h * S + slot) * D + c, _mm256_loadu_ps(v + h * v_head + t * v_row + c));
            }
        }
        std::vector<float> w;
        std::vector<int64_t> at;
        // The query heads that share a KV head together on one thread, then the next row (a
        // request's rows are adjacent): each key and value is read once for the heads that read it.
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < Hkv * T; ++i) attend_group(s, i % T, i / T, w, at);
    }
}

}  // extern "C"
