// Host interface of the row kernel's fallback form (twell_ffn.cu), for the blocked kernel's
// handler (twell_ffn_blocked.cu): launched after the blocked steps on the same stream, it
// reads the entries the call needed on the device and computes y by rows only where they
// did not fit the blocked kernel's workspace, so no host or graph-level branch is needed.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace jax_twell {

// y [rows, d] from x, the TwELL (values, cols [rows, n_tiles, capacity], counts [rows,
// n_tiles]) and the weights as the row kernel takes them, bf16 (bf16 = true) or f16, where
// *needed > max_entries; a grid of a few CTAs per SM that exits at once otherwise.
// Gated: w_act = w_gate, w_up [d, f], w_up_t [f, d]; else w_act = w_up, w_up and w_up_t
// unused. Errors: d not a multiple of 8 or above the row kernel's limit, too much shared
// memory per row for this GPU.
xla::ffi::Error LaunchRowFallback(cudaStream_t stream, bool bf16, bool gated, int64_t rows, int d, int f, int tile,
                                  int capacity, int n_tiles, const void* x, const void* values, const int16_t* cols,
                                  const int32_t* counts, const void* w_act, const void* w_up, const void* w_up_t,
                                  const void* w_down, void* y, const int32_t* needed, int64_t max_entries);

}  // namespace jax_twell
