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
// wherever its keys sit in the pool and however many threads run.
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

// Four keys' scores at once, each with exactly `dot`'s operations: four independent FMA chains
// (where one chain waits on each FMA's latency), their lanes summed in hsum's order through a
// 4x4 transpose.
inline __m128 dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t D) {
    const __m256 q0 = _mm256_loadu_ps(q);
    __m256 a0 = _mm256_mul_ps(q0, _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(q0, _mm256_loadu_ps(k1));
    __m256 a2 = _mm256_mul_ps(q0, _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(q0, _mm256_loadu_ps(k3));
    for (int64_t c = 8; c < D; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + c), a0);
        a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k1 + c), a1);
        a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k2 + c), a2);
        a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k3 + c), a3);
    }
    // Per key [v0+v4, v1+v5, v2+v6, v3+v7], as hsum's first add.
    __m128 h0 = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    __m128 h1 = _mm_add_ps(_mm256_castps256_ps128(a1), _mm256_extractf128_ps(a1, 1));
    __m128 h2 = _mm_add_ps(_mm256_castps256_ps128(a2), _mm256_extractf128_ps(a2, 1));
    __m128 h3 = _mm_add_ps(_mm256_castps256_ps128(a3), _mm256_extractf128_ps(a3, 1));
    _MM_TRANSPOSE4_PS(h0, h1, h2, h3);  // h_l: lane l of each key
    return _mm_add_ps(_mm_add_ps(h0, h2), _mm_add_ps(h1, h3));  // (a+c) + (b+d), as hsum
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
    float* out;  // [T, Hq, D]
};

inline int32_t slot_of(const Step& s, int64_t t, int64_t j) {
    const int64_t p = s.prefix_len[t];
    return j < p ? s.slots[s.prefix_at[t] + j] : s.tails[s.tail_at[t] + (j - p)];
}

// Row t, query head qh: scores into `w` (length n, padded to a multiple of 8), then its output.
void attend_row(const Step& s, int64_t t, int64_t qh, std::vector<float>& w) {
    const int64_t D = s.D, n = s.prefix_len[t] + s.tail_len[t];
    const int64_t h = qh / (s.Hq / s.Hkv);
    const float* q = s.q + qh * s.q_head + t * s.q_row;
    const float* kh = s.keys + h * s.S * D;
    const float* vh = s.values + h * s.S * D;
    w.resize(static_cast<size_t>((n + 7) / 8 * 8));
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const __m128 d4 = dot4(q, kh + static_cast<int64_t>(slot_of(s, t, j)) * D,
                               kh + static_cast<int64_t>(slot_of(s, t, j + 1)) * D,
                               kh + static_cast<int64_t>(slot_of(s, t, j + 2)) * D,
                               kh + static_cast<int64_t>(slot_of(s, t, j + 3)) * D, D);
        _mm_storeu_ps(&w[j], _mm_mul_ps(d4, _mm_set1_ps(s.scale)));
    }
    for (; j < n; ++j) w[j] = dot(q, kh + static_cast<int64_t>(slot_of(s, t, j)) * D, D) * s.scale;
    float mx = -INFINITY;
    for (j = 0; j < n; ++j) mx = w[j] > mx ? w[j] : mx;
    for (int64_t j = n; j < static_cast<int64_t>(w.size()); ++j) w[j] = mx;  // padding: exp(0), unused
    const __m256 m = _mm256_set1_ps(mx);
    for (int64_t j = 0; j < n; j += 8) _mm256_storeu_ps(&w[j], exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&w[j]), m)));
    float den = 0.0f;
    for (int64_t j = 0; j < n; ++j) den += w[j];
    float* o = s.out + (t * s.Hq + qh) * D;
    for (int64_t c = 0; c < D; c += 64) {  // 8 independent accumulators at a time, keys in order for each
        const int64_t width = D - c < 64 ? D - c : 64;
        __m256 acc[8];
        for (int a = 0; a < 8; ++a) acc[a] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            const float* v = vh + static_cast<int64_t>(slot_of(s, t, j)) * D + c;
            const __m256 p = _mm256_set1_ps(w[j]);
            for (int64_t a = 0; a < width / 8; ++a) acc[a] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * a), acc[a]);
        }
        const __m256 d = _mm256_set1_ps(den);
        for (int64_t a = 0; a < width / 8; ++a) _mm256_storeu_ps(o + c + 8 * a, _mm256_div_ps(acc[a], d));
    }
}

}  // namespace

extern "C" {

// Write the step's k and v ([Hkv, T, D]) to their pool slots, then attend every row of q
// ([Hq, T, D]) (see Step). q, k and v: any head and row strides, unit stride inside a row; D % 8 == 0.
void bs_attention(const float* q, int64_t q_head, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                  const float* k, int64_t k_head,
                  int64_t k_row, const float* v, int64_t v_head, int64_t v_row, const int64_t* slot_mapping,
                  float* keys, float* values, int64_t S, const int32_t* slots, const int32_t* prefix_at,
                  const int32_t* prefix_len, const int32_t* tails, const int32_t* tail_at, const int32_t* tail_len,
                  float scale, float* out, int threads) {
    const Step s{q, q_head, q_row, T, Hq, Hkv, D, keys, values, S, slots, prefix_at, prefix_len, tails, tail_at, tail_len, scale, out};
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
        // The query heads that share a KV head, one row after another on one thread, then the next
        // row (a request's rows are adjacent): each key and value is read from memory once for the
        // G heads that read it and for the rows of its request, not once per query head.
        const int64_t G = Hq / Hkv;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < Hkv * T; ++i)
            for (int64_t g = 0; g < G; ++g) attend_row(s, i % T, (i / T) * G + g, w);
    }
}

}  // extern "C"
