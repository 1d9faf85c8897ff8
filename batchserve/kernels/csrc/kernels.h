// The kernels' C entry points, for the files that call one another's (bindings.cpp, layers.cpp).
#pragma once
#include <stdint.h>

extern "C" {
void bs_attention(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                  const float*, int64_t, int64_t, const int64_t*, float*, float*, int64_t, const int32_t*,
                  const int32_t*, const int32_t*, const int32_t*, const int32_t*, const int32_t*, float, float,
                  const float*, float*, int);
void bs_rms_norm(const float*, const float*, const float*, int64_t, int64_t, float, float*, float*, int);
void bs_silu_mul(const float*, int64_t, int64_t, float*, int);
void bs_clamped_swiglu(const float*, int64_t, int64_t, float, float, float*, int);
void bs_rotary(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*, float*, int);
double bs_decoder_layers(const int64_t*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int, float, const float*, const float*, const int64_t*, float*, float*, int64_t, const int32_t*,
                         const int32_t*, const int32_t*, const int32_t*, const int32_t*, const int32_t*, float, float*,
                         float*, float*, int);
void bs_bf16_pack(const uint16_t*, int64_t, int64_t, uint16_t*, int);
int64_t bs_bf16_packed_size(int64_t, int64_t);
int bs_bf16_columns();
void bs_bf16_linear(const float*, int64_t, int64_t, const uint16_t*, int64_t, void*, int, int);
int64_t bs_layers_workspace(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
int64_t bs_layer_fields();
int64_t bs_block_packed_size(int64_t, int64_t, int64_t);
void bs_block_pack(int64_t, const uint8_t*, int64_t, int64_t, int64_t, uint8_t*, int);
void bs_block_linear(const float*, int64_t, const int64_t*, float*, int);
int bs_block_wide();
int bs_abi_version();
int64_t bs_moe_workspace(int64_t, int64_t, int64_t);
void bs_router_logits(const float*, int64_t, int64_t, const float*, const float*, int64_t, float*, int);
void bs_moe_route(const float*, int64_t, int64_t, int64_t, int64_t, int, int, int64_t*, float*, int);
void bs_moe_experts(const float*, int64_t, int64_t, int64_t, const int64_t*, const float*, const int64_t*, int64_t,
                    int64_t, float, float, float*, float*, int);
}
