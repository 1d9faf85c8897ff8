// A Llama-family model's decoder layers in one call: for each layer, residual add + RMSNorm,
// q|k|v, rotary, attention over the paged pool, o, residual add + RMSNorm, gate|up, silu * up and
// down, each by the same kernel (and so with the same bits) as the per-layer Python forward calls.
// A one-row step otherwise makes about 20 Python-level calls a layer, each costing microseconds
// of dispatch and a fresh output tensor; here they cost nothing, and the intermediates live in one
// workspace the caller hands in.
#include <stdint.h>
#include <string.h>

#include <chrono>

#include "kernels.h"

namespace {

// One layer's row of the table (int64 each; pointers as integers, 0 for a missing bias). Each
// product (a `BlockLinear`: any GGUF types, several parts) is 2 fields: its descriptor
// (csrc/blocks.h) and its bias.
enum Field : int64_t {
    kInputNorm, kPostNorm,
    kQkv, kQkvBias,
    kO, kOBias,
    kGateUp, kGateUpBias,
    kDown, kDownBias,
    kQNorm, kKNorm,  // RMSNorm weights over each head of q and of k (Qwen3's), 0 for none
    // A sparse layer (its gate|up and down 0): its float32 router [E, H] and bias (0 for none), and
    // its experts' table [E, 4] (csrc/moe.cpp's); 0 for a dense layer.
    kRouter, kRouterBias, kExperts,
    kFields,
};

template <class T>
const T* at(const int64_t* row, Field f) { return reinterpret_cast<const T*>(static_cast<intptr_t>(row[f])); }

// y [T, N] = x [T, K] times the layer's product whose descriptor is at `desc`, plus its bias (the
// next field) if any: added after the product, as `BlockLinear.forward` does (one float add: the
// same bits).
void product(const int64_t* row, Field desc, const float* x, int64_t T, int64_t N, float* y, int threads) {
    bs_block_linear(x, T, at<int64_t>(row, desc), y, threads);
    const float* bias = at<float>(row, Field(desc + 1));
    if (bias != nullptr)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t n = 0; n < N; ++n) y[t * N + n] += bias[n];
}

// Each of `heads` heads from head `first` of every row of qkv [T, width] RMS-normed over its D values
// in place, by `bs_rms_norm` one head at a time: the bits of the per-layer forward's norm of those rows.
void norm_heads(float* qkv, int64_t T, int64_t width, int64_t first, int64_t heads, int64_t D, const float* weight,
                float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T * heads > 1)
    for (int64_t i = 0; i < T * heads; ++i) {
        float* head = qkv + (i / heads) * width + (first + i % heads) * D;
        bs_rms_norm(head, nullptr, weight, 1, D, eps, head, nullptr, 1);
    }
}

}  // namespace

extern "C" {

int64_t bs_layer_fields() { return kFields; }

// What batchserve/kernels/__init__.py's ABI_VERSION must match: bumped when a signature or the layer table changes.
int bs_abi_version() { return 11; }

// Floats of workspace a step of T rows needs (E routed experts, k a row, for sparse layers; E 0: none).
int64_t bs_layers_workspace(int64_t T, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I, int64_t E,
                            int64_t k) {
    const int64_t sparse = E > 0 ? T * (E + 3 * k) + bs_moe_workspace(T, H, k) : 0;  // logits, ids (2 each), weights
    return T * (H + (Hq + 2 * Hkv) * D + (Hq + Hkv) * D + Hq * D + H + 2 * I + I) + sparse;
}

// Run L layers (their `table` [L, kFields]) over x [T, H] (the embeddings): `out` [T, H] gets the
// last layer's output and `residual` [T, H] the residual stream beside it (the model adds the two
// in its final norm). cos, sin [T, D]: each row's rotation. The pool's keys and values are
// [L, Hkv, S, D]; the plan (slot_mapping .. tail_len) is `bs_attention`'s, the same for every
// layer. A sparse layer routes each row to k of its E experts of I features by `route` (bit 0:
// softmax first, bit 1: renormalize; `bs_moe_route`'s), through the same kernels as
// `KernelSparseMoE.forward`. Returns the seconds spent in attention (the engine reports them apart).
double bs_decoder_layers(const int64_t* table, int64_t L, const float* x, int64_t T, int64_t H, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t I, int64_t E, int64_t k, int route, float eps,
                         const float* cos, const float* sin,
                         const int64_t* slot_mapping, float* keys, float* values, int64_t S, const int32_t* slots,
                         const int32_t* prefix_at, const int32_t* prefix_len, const int32_t* tails,
                         const int32_t* tail_at, const int32_t* tail_len, float scale, float* work, float* out,
                         float* residual, int threads) {
    const int64_t qkv_width = (Hq + 2 * Hkv) * D;
    float* h = work;                            // [T, H] normed
    float* qkv = h + T * H;                     // [T, (Hq + 2 Hkv) D]
    float* qk = qkv + T * qkv_width;            // [Hq + Hkv, T, D] rotated
    float* attn = qk + (Hq + Hkv) * T * D;      // [T, Hq, D]
    float* o = attn + T * Hq * D;               // [T, H]
    float* gate_up = o + T * H;                 // [T, 2I]
    float* act = gate_up + T * 2 * I;           // [T, I]
    float* logits = act + T * I;                // [T, E] (sparse layers)
    int64_t* ids = reinterpret_cast<int64_t*>(logits + T * E);  // [T, k]
    float* weights = logits + T * E + 2 * T * k;  // [T, k]
    float* moe_work = weights + T * k;          // bs_moe_workspace
    double attention_s = 0.0;
    for (int64_t l = 0; l < L; ++l) {
        const int64_t* row = table + l * kFields;
        if (l == 0) {  // no residual yet: the embeddings are it
            memcpy(residual, x, static_cast<size_t>(T * H) * sizeof(float));
            bs_rms_norm(x, nullptr, at<float>(row, kInputNorm), T, H, eps, h, nullptr, threads);
        } else {
            bs_rms_norm(out, residual, at<float>(row, kInputNorm), T, H, eps, h, residual, threads);
        }
        product(row, kQkv, h, T, qkv_width, qkv, threads);
        if (row[kQNorm] != 0) {
            norm_heads(qkv, T, qkv_width, 0, Hq, D, at<float>(row, kQNorm), eps, threads);
            norm_heads(qkv, T, qkv_width, Hq, Hkv, D, at<float>(row, kKNorm), eps, threads);
        }
        // q and k heads of each row ([T, heads, D] inside qkv) rotated into head-major [Hq + Hkv, T, D]
        bs_rotary(qkv, Hq + Hkv, T, D, D, qkv_width, cos, sin, qk, threads);
        const int64_t pool = l * Hkv * S * D;
        const auto t0 = std::chrono::steady_clock::now();
        bs_attention(qk, T * D, D, T, Hq, Hkv, D, qk + Hq * T * D, T * D, D, qkv + (Hq + Hkv) * D, D, qkv_width,
                     slot_mapping, keys + pool, values + pool, S, slots, prefix_at, prefix_len, tails, tail_at,
                     tail_len, scale, 0.0f, nullptr, attn, threads);
        attention_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        product(row, kO, attn, T, H, o, threads);
        bs_rms_norm(o, residual, at<float>(row, kPostNorm), T, H, eps, h, residual, threads);
        if (row[kExperts] != 0) {
            bs_router_logits(h, T, H, at<float>(row, kRouter), at<float>(row, kRouterBias), E, logits, threads);
            bs_moe_route(logits, T, E, E, k, route & 1, (route >> 1) & 1, ids, weights, threads);
            bs_moe_experts(h, T, H, k, ids, weights, at<int64_t>(row, kExperts), E, I, 0.0f, 0.0f, moe_work, out,
                           threads);
            continue;
        }
        product(row, kGateUp, h, T, 2 * I, gate_up, threads);
        bs_silu_mul(gate_up, T, I, act, threads);
        product(row, kDown, act, T, H, out, threads);
    }
    return attention_s;
}

}  // extern "C"
