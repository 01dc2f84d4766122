// What one dependent stage of a decode step costs, apart from its bytes (bench/stage_floor.py drives it).
//
// A stage is a small GEMV: each block multiplies its `rows` rows of the stage's bf16 weight [blocks * rows, K]
// by the whole input vector, which is the stage before's output (x[i] = out[i % n], fp32), and writes its rows'
// dots. Nothing else: no activation, no fold. With rows = 0 a block writes one value, a sum of the input: the
// pure dependency. The weights reach shared memory by bulk copies (cp.async.bulk, an mbarrier a slot), issued
// by one thread, so that a block's whole slice is in flight at once whatever its size.
//
// Two ways to chain the stages:
// - stage_kernel, a launch a stage (the decode step's design): the slice's copies issued before the
//   programmatic wait (`pre`, as the step's kernels load their weights) or after it, the input read after it.
// - persistent_kernel, every stage in one cooperative launch, a grid-wide barrier between stages (one counter,
//   an arrival a block, polled with acquire loads; or cooperative groups' grid sync), and the copies of the
//   next `ahead` stages' slices in flight while this one computes and waits (ahead 0: a stage's copies issued
//   after its barrier).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch.cuh"

namespace spillway {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kLanes;
constexpr int kMaxAhead = 4;
constexpr int kBarrierBytes = 128;  // the mbarriers' space ahead of the slots (keeps the slots aligned)

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One thread: `bytes` of src into dst, the mbarrier's phase completing once they land. A slot is overwritten
// only after every thread's reads of it (a __syncthreads before), which the proxy fence orders before the copy.
__device__ __forceinline__ void copy_slice(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  constexpr uint32_t kPiece = 32768;  // well under the mbarrier's transaction count
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
  for (uint32_t at = 0; at < bytes; at += kPiece) {
    const uint32_t piece = bytes - at < kPiece ? bytes - at : kPiece;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            shared_address(static_cast<char*>(dst) + at)),
        "l"(static_cast<const char*>(src) + at), "r"(piece), "r"(shared_address(bar))
        : "memory");
  }
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  }
}

// The stage's input in shared memory: x[i] = prev[i % n] for i < k. `coherent`: through L2 only (another
// SM wrote prev inside this launch); else after a launch boundary, as the step's kernels read.
__device__ __forceinline__ void load_input(float* xs, const float* prev, int n, int k, bool coherent) {
  for (int i = threadIdx.x; i < k; i += kThreads) xs[i] = coherent ? __ldcg(prev + i % n) : load_after_wait(prev + i % n);
  __syncthreads();
}

// The block's rows of tile [rows, k] times xs → out[0..rows); with rows = 0, out[0] = a mean of 64 of xs.
__device__ __forceinline__ void multiply(const __nv_bfloat16* tile, const float* xs, int rows, int k, float* out) {
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  if (rows == 0) {
    if (warp == 0) {
      float acc = xs[lane] + xs[k - 1 - lane];
      for (int o = 16; o; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) out[0] = acc * (1.0f / 64);  // a mean: bounded over any number of stages
    }
    return;
  }
  for (int r = warp; r < rows; r += kWarps) {
    const uint4* row = reinterpret_cast<const uint4*>(tile + static_cast<int64_t>(r) * k);
    float acc = 0.0f;
    for (int c = lane; c < k / 8; c += kLanes) {
      const uint4 w = row[c];
      const float4 lo = reinterpret_cast<const float4*>(xs)[2 * c], hi = reinterpret_cast<const float4*>(xs)[2 * c + 1];
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
      const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc = fmaf(__uint_as_float(ws[i] << 16), x[2 * i], acc);
        acc = fmaf(__uint_as_float(ws[i] & 0xffff0000u), x[2 * i + 1], acc);
      }
    }
    for (int o = 16; o; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) out[r] = acc;
  }
}

__device__ __forceinline__ int outputs(int rows) { return rows ? rows : 1; }

__global__ void __launch_bounds__(kThreads) stage_kernel(const __nv_bfloat16* w, const float* prev, int n_prev,
                                                          float* out, int rows, int k, int gdc, int pre) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  auto* tile = reinterpret_cast<__nv_bfloat16*>(smem + kBarrierBytes);
  float* xs = reinterpret_cast<float*>(smem + kBarrierBytes + static_cast<int64_t>(rows) * k * 2);
  const uint32_t bytes = static_cast<uint32_t>(rows) * k * 2;
  const __nv_bfloat16* slice = w + static_cast<int64_t>(blockIdx.x) * rows * k;
  const bool copier = threadIdx.x == 0 && rows > 0;
  if (copier) barrier_init(bar);
  if (copier && pre) copy_slice(tile, slice, bytes, bar);
  gdc_wait(gdc);
  if (copier && !pre) copy_slice(tile, slice, bytes, bar);
  load_input(xs, prev, n_prev, k, false);
  if (rows) barrier_wait(bar, 0);
  multiply(tile, xs, rows, k, out + static_cast<int64_t>(blockIdx.x) * outputs(rows));
}

// Every block's arrival for stage s, then the wait for all of them: a monotonic counter (zeroed before the
// launch), so no reset between stages.
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1)
    persistent_kernel(const __nv_bfloat16* w, int64_t stage_elems, float* outs, int64_t out_stride, int n,
                      int rows, int k, int stages, int ahead, int cg_sync, unsigned* counter) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem);
  const int slots = ahead > 0 ? ahead : 1;
  const int64_t tile_elems = static_cast<int64_t>(rows) * k;
  auto* tiles = reinterpret_cast<__nv_bfloat16*>(smem + kBarrierBytes);
  float* xs = reinterpret_cast<float*>(smem + kBarrierBytes + slots * tile_elems * 2);
  const uint32_t bytes = static_cast<uint32_t>(tile_elems * 2);
  const bool copier = threadIdx.x == 0 && rows > 0;
  auto issue = [&](int s) {
    copy_slice(tiles + (s % slots) * tile_elems, w + s * stage_elems + blockIdx.x * tile_elems, bytes,
               bars + s % slots);
  };
  if (copier) {
    for (int i = 0; i < slots; ++i) barrier_init(bars + i);
    for (int s = 0; s < ahead && s < stages; ++s) issue(s);
  }
  for (int s = 0; s < stages; ++s) {
    if (copier && ahead == 0) issue(s);
    load_input(xs, outs + s * out_stride, n, k, true);
    if (rows) barrier_wait(bars + s % slots, (s / slots) & 1);
    multiply(tiles + (s % slots) * tile_elems, xs, rows, k,
             outs + (s + 1) * out_stride + static_cast<int64_t>(blockIdx.x) * outputs(rows));
    __syncthreads();  // the slot's reads done before its next copy
    if (copier && ahead > 0 && s + ahead < stages) issue(s + ahead);
    if (cg_sync) {
      cooperative_groups::this_grid().sync();
    } else {
      grid_barrier(counter, static_cast<unsigned>(s + 1) * gridDim.x);
    }
  }
}

int64_t stage_smem(int rows, int k, int slots) {
  return kBarrierBytes + static_cast<int64_t>(slots) * rows * k * 2 + static_cast<int64_t>(k) * 4;
}

}  // namespace spillway

using spillway::stage_smem;

// The shared memory a launch of `rows` rows and `slots` weight slots needs, made available to both kernels.
extern "C" int spillway_stage_floor_setup(int rows, int k, int slots) {
  const int chain = static_cast<int>(stage_smem(rows, k, 1)), persistent = static_cast<int>(stage_smem(rows, k, slots));
  cudaError_t err = cudaFuncSetAttribute(spillway::stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, chain);
  if (err != cudaSuccess) return err;
  return cudaFuncSetAttribute(spillway::persistent_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              persistent);
}

// `stages` launches of stage_kernel on `stream`, stage s reading outs[s] and writing outs[s + 1] (rows of
// out_stride floats) with weights w + s * stage_elems; `pdl`: each in programmatic dependent launch.
extern "C" int spillway_stage_floor_chain(const void* w, int64_t stage_elems, void* outs, int64_t out_stride,
                                          int n, int rows, int k, int stages, int blocks, int pdl, int pre,
                                          void* stream) {
  if (k % 256 != 0 || rows < 0) return cudaErrorInvalidValue;
  const auto* weights = static_cast<const __nv_bfloat16*>(w);
  auto* out = static_cast<float*>(outs);
  for (int s = 0; s < stages; ++s) {
    const cudaError_t err = spillway::launch_pdl_smem(
        spillway::stage_kernel, dim3(blocks), dim3(spillway::kThreads), stage_smem(rows, k, 1), stream, pdl,
        weights + s * stage_elems, out + s * out_stride, n, out + (s + 1) * out_stride, rows, k, pdl, pre);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Every stage in one cooperative launch of persistent_kernel (`blocks` must all be resident at once), its
// barriers cooperative groups' grid sync (`cg_sync`) or `counter`'s, zeroed first on the same stream.
extern "C" int spillway_stage_floor_persistent(const void* w, int64_t stage_elems, void* outs, int64_t out_stride,
                                               int n, int rows, int k, int stages, int blocks, int ahead,
                                               int cg_sync, void* counter, void* stream) {
  if (k % 256 != 0 || rows < 0 || ahead < 0 || ahead > spillway::kMaxAhead) return cudaErrorInvalidValue;
  auto* s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(counter, 0, sizeof(unsigned), s);
  if (err != cudaSuccess) return err;
  const auto* weights = static_cast<const __nv_bfloat16*>(w);
  auto* out = static_cast<float*>(outs);
  auto* count = static_cast<unsigned*>(counter);
  void* args[] = {&weights, &stage_elems, &out, &out_stride, &n, &rows, &k, &stages, &ahead, &cg_sync, &count};
  const int slots = ahead > 0 ? ahead : 1;
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(spillway::persistent_kernel), dim3(blocks),
                                     dim3(spillway::kThreads), args, stage_smem(rows, k, slots), s);
}
