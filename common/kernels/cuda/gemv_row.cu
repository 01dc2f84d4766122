// One row of x times a bf16 weight [N, K], for the decode step's projections of a few thousand rows (the
// token mixers' output projections, the MoE input projection): common/kernels/gemv_native.py calls it.
//
// A warp computes ROWS output rows over all K inputs. Lane l holds 16-byte chunks l, l+32, ... of each of
// its rows in registers (CHUNKS a lane: K = 256 · CHUNKS), every one loaded before the programmatic wait
// (the weights are no kernel's output), so the resident blocks have their whole weight tiles in flight while
// the kernel before finishes. After the wait the block stages x in shared memory, each lane multiplies its
// chunks in fp32 and the warp sums them through shuffles: no split over K, so no partial products, no
// arrival and no second pass (the Triton GEMV, common/kernels/gemv.py, splits the output projections' K in
// six and folds the chunks).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch.cuh"

namespace spillway {

constexpr int kMaxChunks = 32;   // K up to 8,192
constexpr int kTwoRowChunks = 16;  // two rows a warp up to K 4,096 (64 registers of weights a lane a row)

// acc + the dot of eight bf16 weights and eight bf16 inputs, in fp32 (a bf16 is the top half of its float).
__device__ __forceinline__ float dot_chunk(uint4 w, uint4 x, float acc) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(__uint_as_float(ws[i] << 16), __uint_as_float(xs[i] << 16), acc);
    acc = fmaf(__uint_as_float(ws[i] & 0xffff0000u), __uint_as_float(xs[i] & 0xffff0000u), acc);
  }
  return acc;
}

template <int CHUNKS, int ROWS>
__global__ void __launch_bounds__(256) gemv_row_kernel(const uint4* w, const uint4* x,
                                                       const __nv_bfloat16* bias, __nv_bfloat16* y, int n,
                                                       int gdc) {
  extern __shared__ uint4 x_chunks[];
  constexpr int kRowChunks = CHUNKS * kLanes;  // 16-byte chunks a row
  const int lane = threadIdx.x % kLanes;
  const int first = (blockIdx.x * (blockDim.x / kLanes) + threadIdx.x / kLanes) * ROWS;
  uint4 wv[ROWS][CHUNKS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = min(first + r, n - 1);  // past the last row: that row again, its sum not stored
    const uint4* chunks = w + static_cast<int64_t>(row) * kRowChunks + lane;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) wv[r][j] = load_settled(chunks + j * kLanes);
  }
  gdc_wait(gdc);
  for (int c = threadIdx.x; c < kRowChunks; c += blockDim.x) x_chunks[c] = load_after_wait(x + c);
  __syncthreads();
  float acc[ROWS] = {};
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const uint4 xv = x_chunks[j * kLanes + lane];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = dot_chunk(wv[r][j], xv, acc[r]);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float sum = acc[r];
#pragma unroll
    for (int offset = kLanes / 2; offset; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const int row = first + r;
    if (lane == 0 && row < n) y[row] = __float2bfloat16(bias ? sum + __bfloat162float(bias[row]) : sum);
  }
}

// The instance for `chunks` chunks a lane (CHUNKS counts up to it) and `rows` rows a warp, launched.
template <int CHUNKS>
cudaError_t launch_row(int chunks, int rows, int warps, const void* w, const void* x, const void* bias, void* y,
                       int n, int pdl, int gdc, void* stream) {
  if constexpr (CHUNKS > kMaxChunks) {
    return cudaErrorInvalidValue;
  } else {
    if (chunks != CHUNKS) return launch_row<CHUNKS + 1>(chunks, rows, warps, w, x, bias, y, n, pdl, gdc, stream);
    constexpr int kPair = CHUNKS <= kTwoRowChunks ? 2 : 1;
    if (rows != 1 && rows != kPair) return cudaErrorInvalidValue;
    auto kernel = rows == 2 ? gemv_row_kernel<CHUNKS, kPair> : gemv_row_kernel<CHUNKS, 1>;
    const int per_block = rows * warps;
    return launch_pdl_smem(kernel, dim3((n + per_block - 1) / per_block), dim3(warps * kLanes),
                           CHUNKS * kLanes * sizeof(uint4), stream, pdl, w, x, bias, y, n, gdc);
  }
}

}  // namespace spillway

// y [n] bf16 ← x [k] bf16 · w [n, k]ᵀ bf16 (+ bias [n] bf16, or null); k a multiple of 256 up to 8,192,
// `rows` a warp 1, or 2 where k ≤ 4,096; `warps` a block up to 8. `pdl`: launched with programmatic stream
// serialization; `gdc` 0 no wait, 1 wait then trigger, 2 wait only (common/kernels/pdl.py).
extern "C" int spillway_gemv_row(const void* w, const void* x, const void* bias, void* y, int n, int k, int rows,
                                 int warps, int pdl, int gdc, void* stream) {
  if (k % 256 != 0 || warps < 1 || warps > 8 || n < 1) return cudaErrorInvalidValue;
  return spillway::launch_row<1>(k / 256, rows, warps, w, x, bias, y, n, pdl, gdc, stream);
}
