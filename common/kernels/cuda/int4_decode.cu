// Decode MoE over int4 (W4A16, group 128, zero points) experts, a token a pair: gate/up and down as CUDA C,
// for the launch shapes Triton cannot express (common/kernels/native.py builds the library,
// common/kernels/moe_int4_native.py calls it).
//
// gate/up: a warp computes R gate rows n..n+R-1 of pair p's expert and their up rows n+I.. over all H
// inputs. Lane l reads 16-byte chunks l, l+32, ... of each row (a chunk: 32 inputs of one group) and keeps
// the inputs those chunks multiply (from L1, one chunk at a time) in registers, shared by the warp's 2R
// rows. In the inner dot a code costs three instructions: one LOP3 puts it in place in the mantissa of 2^23
// (the float 2^23 + q*16^e, exact), one FADD takes 2^23 away, one FFMA multiplies it by its input, stored
// divided by 16^e. With the inputs' conversion, scales, zeros and addresses it issues about as much as
// Triton's words form (bench.sass_census --native): the gain is in the loads. The zero point costs
// one multiply a chunk: sum (q - z) x = sum q x - z sum x. The rows' codes are all loaded before any math,
// and, when the pair's row is settled (not written by the kernel just before), before the programmatic-launch
// wait.
//
// Int4 layout (common/experts/formats.py): codes [R, 2I, H/2] bytes, input 2j in the low nibble of byte j;
// read as words, input 8m + i sits in bits 4i..4i+3 of word m. Scales bf16 and zeros uint8 [R, 2I, H/128].
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch.cuh"

namespace spillway {  // named: profiles show the kernels by name (bench.trace_summary pools anonymous ones)

constexpr float kMagic = 8388608.0f;  // 2^23

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, int wide) {
  return wide ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// The code at nibble i of `word` (i < 5) or of `high` (word >> 20, i >= 5) times its input, divided by its
// place value beforehand: q * x exactly as two roundings would give it.
// The mask comes in a register (`masks`, built from a kernel argument): with both constants immediate,
// ptxas splits the AND-OR into two LOP3s, since a LOP3 takes one immediate.
__device__ __forceinline__ float code_term(uint32_t word, uint32_t mask, float x_scaled, float dot) {
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(bits) : "r"(word), "r"(mask), "n"(0x4B000000));
  return fmaf(__uint_as_float(bits) - kMagic, x_scaled, dot);
}

__device__ __forceinline__ float word_dot(uint32_t word, const uint32_t* masks, const float* xs, float dot) {
  const uint32_t high = word >> 20;
#pragma unroll
  for (int i = 0; i < 8; ++i) dot = code_term(i < 5 ? word : high, masks[i < 5 ? i : i - 5], xs[i], dot);
  return dot;
}

// Where act column n goes in down's words layout (moe_int4._words_at), and the factor it is stored with.
__device__ __forceinline__ int64_t words_at(int n, float* factor) {
  const int g = n / 128, r = n % 128, i = r % 8, m = r / 8;
  const int shift = i < 5 ? 4 * i : 4 * (i - 5);
  *factor = __uint_as_float(static_cast<uint32_t>(127 - shift) << 23);
  return static_cast<int64_t>(g * 8 + i) * 16 + m;
}

// Where act column n goes stored split (moe_int4._split_at): per group of 128, the evens then the odds.
__device__ __forceinline__ int64_t split_at(int n) {
  const int j = n % 128;
  return n - j + (j % 2) * 64 + j / 2;
}

// act column n of pair p <- value, in down's layout: 0 fp32 in order, 1 fp32 words (with its factor),
// 2 fp32 split, 3 bf16 in order (the tensor-core down's).
__device__ __forceinline__ void store_act(float* act, int p, int inter, int n, int layout, float value) {
  const int64_t row = static_cast<int64_t>(p) * inter;
  if (layout == 3) {
    reinterpret_cast<__nv_bfloat16*>(act)[row + n] = __float2bfloat16(value);
    return;
  }
  float factor = 1.0f;
  const int64_t at = layout == 1 ? words_at(n, &factor) : layout == 2 ? split_at(n) : n;
  act[row + at] = value * factor;
}

template <int R, int C>
__global__ void gate_up_kernel(const __nv_bfloat16* __restrict__ x, const void* __restrict__ rows,
                               const void* __restrict__ row_of, int wide_rows, int wide_row_of, int lookup,
                               const uint4* __restrict__ codes, const __nv_bfloat16* __restrict__ scales,
                               const uint8_t* __restrict__ zeros, float* __restrict__ act, int k, int hidden,
                               int inter, int act_layout, int gdc, int settled, uint32_t nibble) {
  const int p = blockIdx.x;
  const int lane = threadIdx.x % kLanes;
  const int first = (blockIdx.y * (blockDim.x / kLanes) + threadIdx.x / kLanes) * R;
  const int chunks = hidden / 32;  // 16-byte chunks a row
  const int groups = hidden / 128;
  uint4 q[2 * R][C];
  int64_t row = 0;
  auto load_codes = [&]() {
    row = load_index(rows, p, wide_rows);
    if (lookup) row = load_index(row_of, row, wide_row_of);
    const int64_t base = row * 2 * inter;
#pragma unroll
    for (int r = 0; r < 2 * R; ++r) {
      const int64_t out = base + first + (r % R) + (r / R) * inter;  // gate rows, then up rows
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int j = c * kLanes + lane;
        q[r][c] = j < chunks ? __ldg(codes + out * chunks + j) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  if (settled) load_codes();
  gdc_wait(gdc);
  if (!settled) load_codes();

  uint32_t masks[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) masks[i] = nibble << (4 * i);
  const uint4* xt = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(p / k) * hidden);
  const int64_t base = row * 2 * inter;
  float acc[2 * R] = {};
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int j = c * kLanes + lane;
    if (j >= chunks) break;
    // The chunk's 32 inputs, each divided by its code's place value, and their plain sum.
    float xs[32];
    float x_sum = 0.0f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {  // 8 inputs a load
      const uint4 packed = load_after_wait(xt + j * 4 + v);
      const uint32_t halves[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float value = __uint_as_float(e % 2 ? halves[e / 2] & 0xFFFF0000u : halves[e / 2] << 16);
        const int shift = e < 5 ? 4 * e : 4 * (e - 5);
        xs[v * 8 + e] = value * __uint_as_float(static_cast<uint32_t>(127 - shift) << 23);
        x_sum += value;
      }
    }
#pragma unroll
    for (int r = 0; r < 2 * R; ++r) {
      float dot = word_dot(q[r][c].x, masks, &xs[0], 0.0f);
      dot = word_dot(q[r][c].y, masks, &xs[8], dot);
      dot = word_dot(q[r][c].z, masks, &xs[16], dot);
      dot = word_dot(q[r][c].w, masks, &xs[24], dot);
      const int64_t at = (base + first + (r % R) + (r / R) * inter) * groups + j / 4;
      const float zero = static_cast<float>(zeros[at]);
      acc[r] = fmaf(__bfloat162float(scales[at]), dot - zero * x_sum, acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < 2 * R; ++r) {
#pragma unroll
    for (int d = kLanes / 2; d > 0; d /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], d);
  }
  if (lane < R) {
    float gate = acc[0], up = acc[R];
#pragma unroll
    for (int r = 1; r < R; ++r) {
      if (lane == r) {
        gate = acc[r];
        up = acc[R + r];
      }
    }
    store_act(act, p, inter, first + lane, act_layout, gate / (1.0f + __expf(-gate)) * up);
  }
}

using GateUpKernel = decltype(&gate_up_kernel<1, 1>);

// gate_up_kernel<R, C> for `rows_per_warp` R (1, 2 or 4) and `chunk_loads` C (1 to 3); null for others.
GateUpKernel gate_up_instance(int rows_per_warp, int chunk_loads) {
  constexpr GateUpKernel kTable[3][3] = {
      {&gate_up_kernel<1, 1>, &gate_up_kernel<1, 2>, &gate_up_kernel<1, 3>},
      {&gate_up_kernel<2, 1>, &gate_up_kernel<2, 2>, &gate_up_kernel<2, 3>},
      {&gate_up_kernel<4, 1>, &gate_up_kernel<4, 2>, &gate_up_kernel<4, 3>},
  };
  const int r = rows_per_warp == 1 ? 0 : rows_per_warp == 2 ? 1 : rows_per_warp == 4 ? 2 : -1;
  return r < 0 || chunk_loads < 1 || chunk_loads > 3 ? nullptr : kTable[r][chunk_loads - 1];
}

// down: a warp computes 8 output rows of pair p's expert, 4 lanes a row; lane l reads chunk l % 4 of every
// group of its row (I / 128 chunks) and the 32 activations each multiplies, stored by gate/up in the words
// layout (already divided by their code's place value: one 16-byte load per code position). The zero point
// is folded into each code position's offset (2^23 + z*16^e), so there is no sum of the activations. With
// `fold`, the last of a token's k pairs to finish a block of rows sums the k partial rows in order (and the
// shared expert, gated) into out, as moe_int4's _down_kernel does (common/kernels/arrival.py: the same
// additions in the same order, whatever the schedule).
constexpr int kMaxGroups = 8;  // I up to 1024

__device__ __forceinline__ float offset_term(uint32_t word, uint32_t mask, float offset, float a, float dot) {
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(bits) : "r"(word), "r"(mask), "n"(0x4B000000));
  return fmaf(__uint_as_float(bits) - offset, a, dot);
}

// The fold of a block's `rows_here` rows, called by every thread once its partial rows are written: the last
// of a token's k pairs to arrive sums their k partial rows in order, plus the shared expert (gated), into out
// (common/kernels/arrival.py: the same additions in the same order, whatever the schedule; the counter left
// at zero).
__device__ void fold_rows(const float* partial, int* counters, const __nv_bfloat16* shared,
                          const __nv_bfloat16* gate, int gate_stride, __nv_bfloat16* out, int p, int k,
                          int hidden, int rows_here) {
  __shared__ int last;
  __threadfence();  // this thread's partial row before the count
  __syncthreads();
  const int t = p / k;
  if (threadIdx.x == 0) {
    int* counter = counters + static_cast<int64_t>(t) * gridDim.y + blockIdx.y;
    last = atomicAdd(counter, 1) == k - 1;
    if (last) atomicExch(counter, 0);
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int r = threadIdx.x; r < rows_here; r += blockDim.x) {
    const int i = blockIdx.y * rows_here + r;
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += __ldcg(partial + static_cast<int64_t>(t * k + j) * hidden + i);
    if (shared != nullptr) {
      float s = __bfloat162float(shared[static_cast<int64_t>(t) * hidden + i]);
      if (gate != nullptr) s /= 1.0f + __expf(-__bfloat162float(gate[static_cast<int64_t>(t) * gate_stride]));
      sum += s;
    }
    out[static_cast<int64_t>(t) * hidden + i] = __float2bfloat16(sum);
  }
}

__global__ void down_kernel(const float* __restrict__ act, const void* __restrict__ rows,
                            const void* __restrict__ row_of, int wide_rows, int wide_row_of, int lookup,
                            const void* __restrict__ weights, int bf16_weights, const uint4* __restrict__ codes,
                            const __nv_bfloat16* __restrict__ scales, const uint8_t* __restrict__ zeros,
                            float* __restrict__ partial, int* __restrict__ counters,
                            const __nv_bfloat16* __restrict__ shared, const __nv_bfloat16* __restrict__ gate,
                            int gate_stride, __nv_bfloat16* __restrict__ out, int k, int hidden, int inter,
                            int fold, int gdc, uint32_t nibble) {
  const int p = blockIdx.x;
  const int lane = threadIdx.x % kLanes;
  const int n = (blockIdx.y * (blockDim.x / kLanes) + threadIdx.x / kLanes) * 8 + lane / 4;
  const int part = lane % 4;  // the chunk of each group this lane reads
  const int groups = inter / 128;
  const int chunks = inter / 32;
  // The rows and routing weights are never the kernel before's (gate/up's) outputs, and the codes' copies,
  // if any, are kernels further back or an event this launch waited for: codes in flight before the wait.
  int64_t row = load_index(rows, p, wide_rows);
  if (lookup) row = load_index(row_of, row, wide_row_of);
  const int64_t out_row = row * hidden + n;
  uint4 q[kMaxGroups];
#pragma unroll
  for (int g = 0; g < kMaxGroups; ++g) {
    q[g] = g < groups ? __ldg(codes + out_row * chunks + g * 4 + part) : make_uint4(0, 0, 0, 0);
  }
  const float weight = bf16_weights ? __bfloat162float(static_cast<const __nv_bfloat16*>(weights)[p])
                                    : static_cast<const float*>(weights)[p];
  gdc_wait(gdc);
  uint32_t masks[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) masks[i] = nibble << (4 * i);
  const float4* a4 = reinterpret_cast<const float4*>(act + static_cast<int64_t>(p) * inter);
  float acc = 0.0f;
#pragma unroll
  for (int g = 0; g < kMaxGroups; ++g) {
    if (g >= groups) break;
    const float zero = static_cast<float>(zeros[out_row * groups + g]);
    float dot = 0.0f;
    const uint32_t words[4] = {q[g].x, q[g].y, q[g].z, q[g].w};
    uint32_t high[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) high[m] = words[m] >> 20;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = i < 5 ? i : i - 5;
      const float offset = fmaf(zero, static_cast<float>(1 << (4 * e)), kMagic);
      // words 4 * part.. of code position i
      const float4 a = load_after_wait(a4 + ((g * 8 + i) * 16 + part * 4) / 4);
      const uint32_t mask = masks[e];
      dot = offset_term(i < 5 ? words[0] : high[0], mask, offset, a.x, dot);
      dot = offset_term(i < 5 ? words[1] : high[1], mask, offset, a.y, dot);
      dot = offset_term(i < 5 ? words[2] : high[2], mask, offset, a.z, dot);
      dot = offset_term(i < 5 ? words[3] : high[3], mask, offset, a.w, dot);
    }
    acc = fmaf(__bfloat162float(scales[out_row * groups + g]), dot, acc);
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  if (part == 0) partial[static_cast<int64_t>(p) * hidden + n] = acc * weight;
  if (fold) {
    fold_rows(partial, counters, shared, gate, gate_stride, out, p, k, hidden, blockDim.x / kLanes * 8);
  }
}


// gate/up on the tensor cores: a block of 4 warps computes 16 gate rows and their 16 up rows of pair p's
// expert; warp w takes the groups g = w, w + 4, ... of the inputs and the block sums the 4 partial dots in
// shared memory. Per group a lane loads one 16-byte chunk (chunk t = lane % 4) of row lane / 4 and of row
// lane / 4 + 8, for gate and for up: 8 words. One LOP3 turns a word's codes i and i + 4 into the bf16 pair
// 128 + q (bf16's last place at 128 is 1) and one bf16x2 subtraction into q - z, exact; an m16n8k16 MMA
// multiplies 16 rows x 16 codes by the inputs, which every lane packs the same way (all 8 columns of B hold
// x, so every column of C holds the dot), accumulating in fp32; the group's scale multiplies that in fp32.
// A warp loads kMmaAhead groups of codes ahead of the one it multiplies: with every group loaded before any
// math, a one-wave launch has each SM wait for all its bytes and then only compute.
constexpr int kMmaWarps = 4;
constexpr int kMmaMaxGroups = 5;  // a warp's groups: inputs up to 4 * 5 * 128 = 2560
constexpr int kMmaAhead = 1;      // groups whose codes are loaded ahead of the one being multiplied

__device__ __forceinline__ uint32_t code_pair(uint32_t word, int i, uint32_t zero_pair) {
  uint32_t bits;  // codes i and i + 4 of the word as bf16 128 + q (low half: code i)
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(bits) : "r"(word >> (4 * i)), "r"(0x000F000Fu), "n"(0x43004300));
  const __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&bits),
                                   *reinterpret_cast<const __nv_bfloat162*>(&zero_pair));
  return *reinterpret_cast<const uint32_t*>(&q);
}

__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The bf16 pair (128 + z, 128 + z) for an int4 zero point z (< 16): bf16's 128 + z is 0x4300 | z, exact.
__device__ __forceinline__ uint32_t zero_pair_of(uint32_t zero) {
  const uint32_t half = 0x4300u | (zero & 0x7Fu);
  return half | (half << 16);
}

// One group's codes for a lane (chunk t of rows g, g + 8 of gate, then of up) and, for the row t of those
// four, its scale (bf16 bits) and zero, raw: converted only when the group is multiplied, so that a load in
// flight never stalls the warp. Lane (g, t)'s row t is handed to the others by shuffles.
struct MmaGroup {
  uint4 q[4];
  uint32_t zero;
  uint32_t scale;
};

// The 16 bf16 input pairs X[i] = (x[2i], x[2i + 1]) of this lane's 32 inputs (a chunk: 4 loads).
__device__ __forceinline__ void input_pairs(const uint4* xv, uint32_t* xw) {
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    xw[4 * v] = xv[v].x, xw[4 * v + 1] = xv[v].y, xw[4 * v + 2] = xv[v].z, xw[4 * v + 3] = xv[v].w;
  }
}

// acc[0], acc[1] (rows g, g + 8) += scale * dot of one group: the rows' chunk t of codes (`lo`, `hi`: 4
// words each), their zero pairs and scales, against this lane's input pairs `xw`. B's fragments: for word m
// and pair j, (x[8m + 2j], x[8m + 2j + 4]) and (x[8m + 2j + 1], x[8m + 2j + 5]), the low and the high halves
// of X[4m + j] and X[4m + j + 2] (one PRMT each).
__device__ __forceinline__ void mma_rows(const uint4& lo, const uint4& hi, const uint32_t* zero_pair,
                                         const float* scale, const uint32_t* xw, float* acc) {
  float c[4] = {};
#pragma unroll
  for (int m = 0; m < 4; ++m) {  // the chunk's words: inputs 32t + 8m + 0..7
    const uint32_t word_lo = (&lo.x)[m], word_hi = (&hi.x)[m];
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // codes (2j, 2j + 4) in k-slots 2t, 2t+1; (2j+1, 2j+5) in 2t+8, 2t+9
      const uint32_t a[4] = {
          code_pair(word_lo, 2 * j, zero_pair[0]), code_pair(word_hi, 2 * j, zero_pair[1]),
          code_pair(word_lo, 2 * j + 1, zero_pair[0]), code_pair(word_hi, 2 * j + 1, zero_pair[1])};
      const uint32_t b[2] = {__byte_perm(xw[4 * m + j], xw[4 * m + j + 2], 0x5410),
                             __byte_perm(xw[4 * m + j], xw[4 * m + j + 2], 0x7632)};
      mma_bf16(c, a, b);
    }
  }
  acc[0] = fmaf(scale[0], c[0], acc[0]);  // row g (every column holds the dot)
  acc[1] = fmaf(scale[1], c[2], acc[1]);  // row g + 8
}

// Row r's zero pair and scale from lane (g, r), which loaded them (`zero`, `scale`: raw bf16 bits).
__device__ __forceinline__ void row_scale(uint32_t zero, uint32_t scale, int g, int r, uint32_t* zero_pair,
                                          float* value) {
  *zero_pair = zero_pair_of(__shfl_sync(0xffffffffu, zero, g * 4 + r));
  *value = __uint_as_float(__shfl_sync(0xffffffffu, scale, g * 4 + r) << 16);
}

// acc (rows g, g + 8 of gate, then of up) += one group's dots: its codes `s` against this lane's 32 inputs
// `xv` (the group's chunk t), each row's scale applied in fp32.
__device__ __forceinline__ void mma_group(const MmaGroup& s, const uint4* xv, int g, float* acc) {
  uint32_t xw[16];
  input_pairs(xv, xw);
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // gate (rows 0, 1 of q), then up (rows 2, 3)
    uint32_t zero_pair[2];
    float scale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) row_scale(s.zero, s.scale, g, 2 * half + r, &zero_pair[r], &scale[r]);
    mma_rows(s.q[2 * half], s.q[2 * half + 1], zero_pair, scale, xw, acc + 2 * half);
  }
}

__global__ void __launch_bounds__(kMmaWarps * kLanes, 4)  // 4 blocks an SM: 528 hold the 400 at once
    gate_up_mma_kernel(const __nv_bfloat16* __restrict__ x, const void* __restrict__ rows,
                       const void* __restrict__ row_of, int wide_rows, int wide_row_of, int lookup,
                       const uint4* __restrict__ codes, const __nv_bfloat16* __restrict__ scales,
                       const uint8_t* __restrict__ zeros, float* __restrict__ act, int k, int hidden, int inter,
                       int act_layout, int gdc, int settled) {
  const int p = blockIdx.x;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int g = lane / 4, t = lane % 4;  // the MMA fragments' group and thread in group
  const int first = blockIdx.y * 16;    // gate rows first..first+15
  const int chunks = hidden / 32, groups = hidden / 128;
  int64_t row = 0;
  auto out_row = [&](int r) -> int64_t {  // r: 0, 1 gate rows g, g + 8; 2, 3 up rows g, g + 8
    return row * 2 * inter + first + g + (r % 2) * 8 + (r / 2) * inter;
  };
  auto load_group = [&](int G, MmaGroup& s) {
    const int group = warp + G * kMmaWarps;
    if (group >= groups) return;
#pragma unroll
    for (int r = 0; r < 4; ++r) s.q[r] = __ldg(codes + out_row(r) * chunks + group * 4 + t);
    const int64_t at = out_row(t) * groups + group;
    s.zero = zeros[at];
    s.scale = reinterpret_cast<const uint16_t*>(scales)[at];
  };
  // The codes of kMmaAhead groups are in flight while one is multiplied; a group's inputs one ahead.
  MmaGroup stage[kMmaAhead + 1];
  auto load_first = [&]() {
    row = load_index(rows, p, wide_rows);
    if (lookup) row = load_index(row_of, row, wide_row_of);
#pragma unroll
    for (int G = 0; G < kMmaAhead; ++G) load_group(G, stage[G]);
  };
  if (settled) load_first();
  gdc_wait(gdc);
  if (!settled) load_first();

  const uint4* xt = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(p / k) * hidden);
  auto load_x = [&](int G, uint4* xv) {
    const int group = warp + G * kMmaWarps;
    if (group >= groups) return;
#pragma unroll
    for (int v = 0; v < 4; ++v) xv[v] = load_after_wait(xt + group * 16 + t * 4 + v);
  };
  uint4 xv[2][4];
  load_x(0, xv[0]);
  float acc[4] = {};  // rows g, g + 8 of gate, then of up
#pragma unroll
  for (int G = 0; G < kMmaMaxGroups; ++G) {
    if (G + kMmaAhead < kMmaMaxGroups) load_group(G + kMmaAhead, stage[(G + kMmaAhead) % (kMmaAhead + 1)]);
    if (G + 1 < kMmaMaxGroups) load_x(G + 1, xv[(G + 1) % 2]);
    if (warp + G * kMmaWarps < groups) mma_group(stage[G % (kMmaAhead + 1)], xv[G % 2], g, acc);
  }
  __shared__ float partial[kMmaWarps][32];  // a warp's 16 gate then 16 up rows
  if (t == 0) {
    partial[warp][g] = acc[0];
    partial[warp][g + 8] = acc[1];
    partial[warp][16 + g] = acc[2];
    partial[warp][16 + g + 8] = acc[3];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    const int i = threadIdx.x;
    float gate = 0.0f, up = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) {  // in warp order: the same sum every run
      gate += partial[w][i];
      up += partial[w][16 + i];
    }
    store_act(act, p, inter, first + i, act_layout, gate / (1.0f + __expf(-gate)) * up);
  }
}

// down on the tensor cores: a warp computes 16 output rows of pair p's expert over all I inputs, as one half
// of gate_up_mma_kernel does (lane (g, t): rows n + g and n + g + 8, chunk t of each group), against the
// activations gate/up stored in bf16 in order (act layout 3). The rows are settled (as for down_kernel), so
// all G groups' codes, scales and zeros (lanes t = 0, 1: rows n + g, n + g + 8) are loaded before the
// programmatic wait; the activations one group ahead after it. Partial rows and the fold as down_kernel's.
constexpr int kMmaDownRows = 16;  // a warp's rows
constexpr int kMmaDownWarps = 4;

template <int G>
__global__ void __launch_bounds__(kMmaDownWarps * kLanes, 4)
    down_mma_kernel(const __nv_bfloat16* __restrict__ act, const void* __restrict__ rows,
                    const void* __restrict__ row_of, int wide_rows, int wide_row_of, int lookup,
                    const void* __restrict__ weights, int bf16_weights, const uint4* __restrict__ codes,
                    const __nv_bfloat16* __restrict__ scales, const uint8_t* __restrict__ zeros,
                    float* __restrict__ partial, int* __restrict__ counters,
                    const __nv_bfloat16* __restrict__ shared, const __nv_bfloat16* __restrict__ gate,
                    int gate_stride, __nv_bfloat16* __restrict__ out, int k, int hidden, int fold, int gdc) {
  const int p = blockIdx.x;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int g = lane / 4, t = lane % 4;
  const int n = (blockIdx.y * kMmaDownWarps + warp) * kMmaDownRows + g;  // this lane's rows n, n + 8
  constexpr int kInter = G * 128, kChunks = G * 4;
  int64_t row = load_index(rows, p, wide_rows);
  if (lookup) row = load_index(row_of, row, wide_row_of);
  const int64_t lo_row = row * hidden + n, hi_row = lo_row + 8, own_row = t % 2 ? hi_row : lo_row;
  uint4 lo[G], hi[G];
  uint32_t zero[G], scale[G];  // row own_row's (lane (g, r) holds row r's: row_scale)
#pragma unroll
  for (int i = 0; i < G; ++i) {
    lo[i] = load_settled(codes + lo_row * kChunks + i * 4 + t);
    hi[i] = load_settled(codes + hi_row * kChunks + i * 4 + t);
    zero[i] = zeros[own_row * G + i];
    scale[i] = reinterpret_cast<const uint16_t*>(scales)[own_row * G + i];
  }
  const float weight = bf16_weights ? __bfloat162float(static_cast<const __nv_bfloat16*>(weights)[p])
                                    : static_cast<const float*>(weights)[p];
  gdc_wait(gdc);
  const uint4* at = reinterpret_cast<const uint4*>(act + static_cast<int64_t>(p) * kInter);
  uint4 av[2][4];
#pragma unroll
  for (int v = 0; v < 4; ++v) av[0][v] = load_after_wait(at + t * 4 + v);
  float acc[2] = {};
#pragma unroll
  for (int i = 0; i < G; ++i) {
    if (i + 1 < G) {
#pragma unroll
      for (int v = 0; v < 4; ++v) av[(i + 1) % 2][v] = load_after_wait(at + (i + 1) * 16 + t * 4 + v);
    }
    uint32_t xw[16], zero_pair[2];
    float value[2];
    input_pairs(av[i % 2], xw);
#pragma unroll
    for (int r = 0; r < 2; ++r) row_scale(zero[i], scale[i], g, r, &zero_pair[r], &value[r]);
    mma_rows(lo[i], hi[i], zero_pair, value, xw, acc);
  }
  if (t == 0) {
    partial[static_cast<int64_t>(p) * hidden + n] = acc[0] * weight;
    partial[static_cast<int64_t>(p) * hidden + n + 8] = acc[1] * weight;
  }
  if (fold) {
    fold_rows(partial, counters, shared, gate, gate_stride, out, p, k, hidden, kMmaDownWarps * kMmaDownRows);
  }
}

using DownMmaKernel = decltype(&down_mma_kernel<1>);

// down_mma_kernel<G> for I = 128 G, G 1 to 8; null for others.
DownMmaKernel down_mma_instance(int groups) {
  constexpr DownMmaKernel kTable[8] = {&down_mma_kernel<1>, &down_mma_kernel<2>, &down_mma_kernel<3>,
                                       &down_mma_kernel<4>, &down_mma_kernel<5>, &down_mma_kernel<6>,
                                       &down_mma_kernel<7>, &down_mma_kernel<8>};
  return groups < 1 || groups > 8 ? nullptr : kTable[groups - 1];
}

}  // namespace spillway

using namespace spillway;

// act [P, I] fp32 <- silu(gate) * up of pair p's expert (pool row row_of[rows[p]], or rows[p] without lookup)
// against x[p / k]; `act_layout`: 0 in order, 1 down's words layout, 2 split (evens then odds a group).
// `chunk_loads`: each lane's 16-byte chunks a row (1 to 3: hidden <= 1024 * chunk_loads). `rows_per_warp`
// 1, 2 or 4; `warps` a block; I a multiple of rows_per_warp * warps. `pdl`: launched with programmatic stream
// serialization; `gdc` 0 no wait, 1 wait then let the next kernel launch, 2 wait only. Returns the launch's
// cudaError_t.
extern "C" int spillway_int4_gate_up(const void* x, const void* rows, const void* row_of, int wide_rows,
                                     int wide_row_of, int lookup, const void* codes, const void* scales,
                                     const void* zeros, void* act, int pairs, int k, int hidden, int inter,
                                     int rows_per_warp, int warps, int chunk_loads, int act_layout, int pdl,
                                     int gdc, int settled, void* stream) {
  if (hidden % 128 != 0 || hidden > 1024 * chunk_loads || inter % (rows_per_warp * warps) != 0) {
    return cudaErrorInvalidValue;
  }
  const GateUpKernel kernel = gate_up_instance(rows_per_warp, chunk_loads);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(pairs, inter / (rows_per_warp * warps));
  return launch_pdl(kernel, grid, dim3(warps * kLanes), stream, pdl, x, rows, row_of, wide_rows, wide_row_of,
                    lookup, codes, scales, zeros, act, k, hidden, inter, act_layout, gdc, settled, 0xFu);
}

// partial [P, H] fp32 <- weights[p] (fp32, or bf16 with `bf16_weights`) * down of pair p's expert (rows as
// gate/up's) at act[p] (words layout); with `fold`, also out [T, H] bf16 <- the sum of each token's k
// partial rows in order, plus `shared` [T, H] (bf16, or null) times sigmoid(gate[t * gate_stride]) (bf16, or
// null: ungated), by the last pair of a block of rows to finish (`counters`: zero, left zero). 8 rows a
// warp, `warps` a block: H a multiple of 8 * warps; I a multiple of 128 up to 1024. `pdl`, `gdc` as
// gate/up's.
extern "C" int spillway_int4_down(const void* act, const void* rows, const void* row_of, int wide_rows,
                                  int wide_row_of, int lookup, const void* weights, int bf16_weights,
                                  const void* codes,
                                  const void* scales, const void* zeros, void* partial, void* counters,
                                  const void* shared, const void* gate, int gate_stride, void* out, int pairs,
                                  int k, int hidden, int inter, int warps, int fold, int pdl, int gdc,
                                  void* stream) {
  if (inter % 128 != 0 || inter > 128 * kMaxGroups || hidden % (8 * warps) != 0) return cudaErrorInvalidValue;
  const dim3 grid(pairs, hidden / (8 * warps));
  return launch_pdl(down_kernel, grid, dim3(warps * kLanes), stream, pdl, act, rows, row_of, wide_rows,
                    wide_row_of, lookup, weights, bf16_weights, codes, scales, zeros, partial, counters, shared,
                    gate, gate_stride, out, k, hidden, inter, fold, gdc, 0xFu);
}

// gate/up on the tensor cores (gate_up_mma_kernel): as spillway_int4_gate_up,
// 16 rows a block of 4 warps; I a multiple of 16, hidden a multiple of 128 up to 2560.
extern "C" int spillway_int4_gate_up_mma(const void* x, const void* rows, const void* row_of, int wide_rows,
                                         int wide_row_of, int lookup, const void* codes, const void* scales,
                                         const void* zeros, void* act, int pairs, int k, int hidden, int inter,
                                         int act_layout, int pdl, int gdc, int settled, void* stream) {
  if (hidden % 128 != 0 || hidden > 128 * kMmaWarps * kMmaMaxGroups || inter % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  return launch_pdl(gate_up_mma_kernel, dim3(pairs, inter / 16), dim3(kMmaWarps * kLanes), stream, pdl, x,
                    rows, row_of, wide_rows, wide_row_of, lookup, codes, scales, zeros, act, k, hidden, inter,
                    act_layout, gdc, settled);
}

// down on the tensor cores (down_mma_kernel): as spillway_int4_down, with act [P, I] bf16 in order (gate/up's
// act layout 3), 16 rows a warp and 4 warps a block: H a multiple of 64, I a multiple of 128 up to 1024.
extern "C" int spillway_int4_down_mma(const void* act, const void* rows, const void* row_of, int wide_rows,
                                      int wide_row_of, int lookup, const void* weights, int bf16_weights,
                                      const void* codes, const void* scales, const void* zeros, void* partial,
                                      void* counters, const void* shared, const void* gate, int gate_stride,
                                      void* out, int pairs, int k, int hidden, int inter, int fold, int pdl,
                                      int gdc, void* stream) {
  const DownMmaKernel kernel = inter % 128 == 0 ? down_mma_instance(inter / 128) : nullptr;
  if (kernel == nullptr || hidden % (kMmaDownRows * kMmaDownWarps) != 0) return cudaErrorInvalidValue;
  const dim3 grid(pairs, hidden / (kMmaDownRows * kMmaDownWarps));
  return launch_pdl(kernel, grid, dim3(kMmaDownWarps * kLanes), stream, pdl, act, rows, row_of, wide_rows,
                    wide_row_of, lookup, weights, bf16_weights, codes, scales, zeros, partial, counters, shared,
                    gate, gate_stride, out, k, hidden, fold, gdc);
}
