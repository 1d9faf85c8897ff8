// A sparse layer's routed experts in one call: each expert's gate|up product, silu * up and down
// product over the rows that chose it, each row's outputs times its weights added in ascending
// expert order. The same kernels, in the same order, with the same arithmetic (no contraction:
// the build's -ffp-contract=off) as `SparseMoE.forward`'s Python loop over the experts, so the
// same bits, without the dozen Python-level calls and fresh tensors each expert costs there (a
// one-row step of a 48-layer, 8-of-128-expert model makes about 400 expert calls).
#include <stdint.h>
#include <string.h>

#include <vector>

#include "kernels.h"

namespace {

template <class T>
const T* addr(int64_t v) { return reinterpret_cast<const T*>(static_cast<intptr_t>(v)); }

// The experts' activation: silu(gate) * up, or where `limit` > 0 gpt-oss's clamped SwiGLU.
struct Activation {
    float alpha, limit;
};

// y [n, N] += bias [N] where there is one: torch's `out + bias`, one add a value, so its bits.
void add_bias(float* y, int64_t n, int64_t N, const float* bias) {
    if (bias == nullptr) return;
    for (int64_t j = 0; j < n; ++j)
        for (int64_t c = 0; c < N; ++c) y[j * N + c] += bias[c];
}

// One expert over its n rows (their indices into x in `picks`, as row * k + slot): gathered, gate|up
// (+ its bias), the activation, down (+ its bias) into y [n, H]. `expert`: the table's row (gate|up
// and down descriptors, then their biases' addresses, 0 for none). The intermediates live in the
// calling thread's own buffer, kept between calls and grown to the largest expert it has run.
void run_expert(const float* x, int64_t H, int64_t k, const int64_t* picks, int64_t n, const int64_t* expert,
                int64_t I, Activation act, float* y, int threads) {
    static thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(n * (H + 2 * I + I)));
    float* rows = scratch.data();        // [n, H]
    float* gate_up = rows + n * H;       // [n, 2I]
    float* glu = gate_up + n * 2 * I;    // [n, I]
    for (int64_t j = 0; j < n; ++j)
        memcpy(rows + j * H, x + picks[j] / k * H, static_cast<size_t>(H) * sizeof(float));
    bs_block_linear(rows, n, addr<int64_t>(expert[0]), gate_up, threads);
    add_bias(gate_up, n, 2 * I, addr<float>(expert[2]));
    if (act.limit > 0)
        bs_clamped_swiglu(gate_up, n, I, act.alpha, act.limit, glu, threads);
    else
        bs_silu_mul(gate_up, n, I, glu, threads);
    bs_block_linear(glu, n, addr<int64_t>(expert[1]), y, threads);
    add_bias(y, n, H, addr<float>(expert[3]));
}

}  // namespace

extern "C" {

// Floats of workspace a call over T rows with k experts each needs: every pick's output.
int64_t bs_moe_workspace(int64_t T, int64_t H, int64_t k) { return T * k * H; }

// x [T, H]; ids [T, k] (each row's experts, each in 0..E-1) and weights [T, k]; experts [E, 4]: each
// expert's gate|up and down product descriptors (csrc/blocks.h; gate|up's N is 2 I, down's is H) and
// their float32 biases' addresses (0: none). out [T, H] = for each row, the sum over its experts in
// ascending expert order of weight * down(act(gate|up)) of the row, act silu(gate) * up or, where
// `limit` > 0, the clamped SwiGLU (`bs_clamped_swiglu`). `work`: bs_moe_workspace floats.
//
// Where at least as many experts are chosen as there are threads, the threads take whole experts
// (each product on one thread: no fork and join per product, and each thread streams its own
// expert's weights); else every thread shares each product's columns. A row's bits are the same
// either way: each product gives a row the same bits at any thread count, and the sum's order is
// fixed.
void bs_moe_experts(const float* x, int64_t T, int64_t H, int64_t k, const int64_t* ids, const float* weights,
                    const int64_t* experts, int64_t E, int64_t I, float alpha, float limit, float* work, float* out,
                    int threads) {
    // The picks (row * k + slot) grouped by expert, rows ascending within each: a counting sort.
    std::vector<int64_t> start(static_cast<size_t>(E + 1), 0), order(static_cast<size_t>(T * k));
    std::vector<int64_t> place(static_cast<size_t>(T * k));  // each pick's place in `order`
    for (int64_t i = 0; i < T * k; ++i) ++start[static_cast<size_t>(ids[i] + 1)];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    std::vector<int64_t> next(start.begin(), start.end() - 1), hit;
    for (int64_t i = 0; i < T * k; ++i) {
        place[i] = next[ids[i]]++;
        order[static_cast<size_t>(place[i])] = i;
    }
    for (int64_t e = 0; e < E; ++e)
        if (start[e + 1] > start[e]) hit.push_back(e);
    float* ys = work;  // [T k, H]: each pick's output, in `order`'s order
    const int64_t n_hit = static_cast<int64_t>(hit.size());
    auto expert = [&](int64_t h, int inner) {
        const int64_t e = hit[h], first = start[e];
        run_expert(x, H, k, order.data() + first, start[e + 1] - first, experts + 4 * e, I, Activation{alpha, limit},
                   ys + first * H, inner);
    };
    if (n_hit >= threads && threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t h = 0; h < n_hit; ++h) expert(h, 1);
    } else {
        for (int64_t h = 0; h < n_hit; ++h) expert(h, threads);
    }
    // Each row's outputs times its weights, added in ascending expert order: 0 + (y w) + (y w) ...
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
    for (int64_t r = 0; r < T; ++r) {
        int64_t slots[64];  // k <= 64: the caller's (`moe.why_not_kernel`)
        const int64_t n = k < 64 ? k : 64;
        for (int64_t j = 0; j < n; ++j) {  // the row's slots sorted by expert (insertion: k is small)
            int64_t at = j;
            while (at > 0 && ids[r * k + slots[at - 1]] > ids[r * k + j]) {
                slots[at] = slots[at - 1];
                --at;
            }
            slots[at] = j;
        }
        float* o = out + r * H;
        memset(o, 0, static_cast<size_t>(H) * sizeof(float));
        for (int64_t j = 0; j < n; ++j) {
            const int64_t pick = r * k + slots[j];
            const float w = weights[pick];
            const float* v = ys + place[pick] * H;
            for (int64_t h = 0; h < H; ++h) o[h] += v[h] * w;
        }
    }
}

}  // extern "C"
