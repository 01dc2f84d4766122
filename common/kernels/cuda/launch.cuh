// What the CUDA C decode kernels share (common/kernels/native.py hashes this header with each source that
// includes it): programmatic dependent launch (common/kernels/pdl.py) and the loads that follow its wait.
#pragma once

#include <cuda_runtime.h>

namespace spillway {

constexpr int kLanes = 32;

// Loads of what the kernels before wrote (x, the activations), after gdc_wait: ld.global.ca (SASS
// LDG.STRONG.SM, cached in L1 as .nc is; the wait makes the grid before's writes visible to them). Through a
// const __restrict__ pointer nvcc emits ld.global.nc, which it treats as invariant and may hoist above the
// wait's asm, reading the activations before the kernel before wrote them. ld.global.cg (L2 only) is also
// correct, but slower.
template <typename T>
__device__ __forceinline__ T load_after_wait(const T* p) {
  return __ldca(p);
}

// A weight's chunk (no kernel writes it), loaded before the programmatic wait: a weak ld.global (asm
// volatile), not __ldg. ptxas treats a non-coherent load (ld.global.nc) as free to move across
// griddepcontrol.wait and sinks most of them below it, so they wait for the kernel before after all; weak
// loads it keeps above (the SASS tests in tests/common/kernels/test_gemv_native.py and
// tests/bench/test_sass_census.py). L1::no_allocate: a weight is read once a step.
__device__ __forceinline__ uint4 load_settled(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void gdc_wait(int gdc) {
#if __CUDA_ARCH__ >= 900  // programmatic dependent launch: Hopper on (common/kernels/pdl.py)
  if (gdc) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (gdc == 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// `kernel` launched on `stream` with `smem` bytes of dynamic shared memory, with programmatic stream
// serialization when `pdl` (common/kernels/pdl.py), each argument cast to the parameter it fills.
template <typename... Params, typename... Args>
cudaError_t launch_pdl_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, void* stream, int pdl,
                            Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// launch_pdl_smem without dynamic shared memory.
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, void* stream, int pdl, Args... args) {
  return launch_pdl_smem(kernel, grid, block, 0, stream, pdl, args...);
}

}  // namespace spillway
