// A sparse layer's router: its float32 product and each row's top-k experts and their weights, in
// two calls where torch takes a product and about a dozen ops (a one-row step of a 48-layer model
// spent ~6 ms a token in them). Each row's logits, choice and weights are computed by one thread
// in one fixed order, so a row's bits never depend on the other rows or the thread count.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <cmath>
#include <vector>

#include "vec.h"

namespace {

// x . w over H values (H % 8 == 0): four 8-lane accumulators where H % 32 == 0 (one otherwise),
// added in a fixed order: the same bits for a row whatever else the call holds.
float dot(const float* x, const float* w, int64_t H) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    if (H % 32 == 0) {
        for (int64_t c = 0; c < H; c += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(w + c), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c + 8), _mm256_loadu_ps(w + c + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c + 16), _mm256_loadu_ps(w + c + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c + 24), _mm256_loadu_ps(w + c + 24), a3);
        }
    } else {
        for (int64_t c = 0; c < H; c += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(w + c), a0);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// exp(v - max) over n values in place and their sum (ascending order): a softmax's numerators.
float exp_shifted(float* v, int64_t n) {
    float most = v[0], sum = 0.0f;
    for (int64_t i = 1; i < n; ++i) most = v[i] > most ? v[i] : most;
    for (int64_t i = 0; i < n; ++i) sum += (v[i] = std::exp(v[i] - most));
    return sum;
}

// The k largest of v [n] into ids (largest first; equal values: the lower index first).
void top_k(const float* v, int64_t n, int64_t k, int64_t* ids, std::vector<char>& taken) {
    taken.assign(static_cast<size_t>(n), 0);
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; ++i)
            if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
        taken[best] = 1;
        ids[j] = best;
    }
}

}  // namespace

extern "C" {

// logits [T, N] = x [T, H] times w [N, H] transposed (+ bias [N] where given; H % 8 == 0).
void bs_router_logits(const float* x, int64_t T, int64_t H, const float* w, const float* bias, int64_t N,
                      float* logits, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T * N > 64)
    for (int64_t i = 0; i < T * N; ++i) {
        const int64_t t = i / N, n = i % N;
        const float v = dot(x + t * H, w + n * H, H);
        logits[i] = bias != nullptr ? v + bias[n] : v;
    }
}

// Each row's k experts of the first E of its logits [T, ld] and their weights: with
// `softmax_first`, the softmax over all E, the k largest (ties: the lower index), divided by their
// sum where `renormalize`; else the k largest logits and the softmax over those k. ids [T, k]
// int64, weights [T, k] float32.
void bs_moe_route(const float* logits, int64_t T, int64_t ld, int64_t E, int64_t k, int softmax_first,
                  int renormalize, int64_t* ids, float* weights, int threads) {
#pragma omp parallel num_threads(threads) if (T > 1)
    {
        std::vector<float> p(static_cast<size_t>(E));
        std::vector<char> taken;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            p.assign(logits + t * ld, logits + t * ld + E);
            int64_t* id = ids + t * k;
            float* w = weights + t * k;
            if (softmax_first) {
                const float sum = exp_shifted(p.data(), E);
                for (int64_t e = 0; e < E; ++e) p[e] /= sum;
                top_k(p.data(), E, k, id, taken);
                float chosen = 0.0f;
                for (int64_t j = 0; j < k; ++j) chosen += (w[j] = p[id[j]]);
                if (renormalize)
                    for (int64_t j = 0; j < k; ++j) w[j] /= chosen;
            } else {
                top_k(p.data(), E, k, id, taken);
                for (int64_t j = 0; j < k; ++j) w[j] = p[id[j]];
                const float sum = exp_shifted(w, k);
                for (int64_t j = 0; j < k; ++j) w[j] /= sum;
            }
        }
    }
}

}  // extern "C"
