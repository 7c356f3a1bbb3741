// `--load-format dummy`: random weights of the configured shapes, so real-scale shapes run
// without a checkpoint. Shared by the decoder and the drafters.
#pragma once

#include "backend/backend.h"

#include <cstdint>
#include <vector>

namespace xinfer {

// Fills `t` (on `backend`) with deterministic random values: uniform in ±1/sqrt(cols) for
// matrices (keeps activations O(1) through the layers), 1 ± 0.1 for norm weights. `stream`
// picks the values (callers pass a seed mixed with a per-tensor counter). (The decoder then
// zeroes the routers' correction biases, so that dummy models route about uniformly:
// tests/models/test_dummy_routing.cpp.)
//
// Host-memory backends get an independent value per element. On accelerators a tensor larger
// than one tile (2^20 elements) gets one random tile, uploaded once and replicated on the device
// by doubling copies: the values repeat with that period, which changes nothing for speed
// measurements and turns a ~30 s host fill of a 309B-shape model into well under a second
// of device copies.
void fill_dummy_weights(Backend& backend, const Tensor& t, bool is_norm, uint64_t stream);

// Block-scaled FP8 dummy weights: `weight` (f8_e4m3 [.., rows, cols]) holds the values of
// fill_dummy_weights's stream quantized to e4m3 with one scale s = (1/sqrt(cols)) / 448 — the
// stream's bound over e4m3's largest value, i.e. amax/448 of every block — and every element of
// `scale` (f32, any grid) is s, so dequantizing gives the f32 dummy values within e4m3 rounding.
// Replicated on accelerators like fill_dummy_weights (one 2^20-element tile).
void fill_dummy_fp8_weights(Backend& backend, const Tensor& weight, const Tensor& scale, uint64_t stream);

// The first n values of that stream for a tensor with `cols` columns, as f32 on the host (for
// callers that convert or assemble weights before uploading).
std::vector<float> dummy_values(int64_t n, int64_t cols, bool is_norm, uint64_t stream);

}  // namespace xinfer
