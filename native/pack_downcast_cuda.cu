// CUDA kernel of autosac::pack_downcast: many float32 device arrays -> one
// flat bfloat16 or float16 device buffer, round to nearest even (Inf and NaN
// kept).  Plain CUDA C++, no PyTorch headers: pack_downcast_cuda_binding.cpp
// registers it as the op's CUDA implementation.
//
// Work split: every array is cut into chunks of kChunk elements and each
// block converts one chunk, so a block finds its array once (a search over
// at most kMaxPieces block offsets) instead of once per element.  The table
// of arrays travels as the kernel's argument (no host-to-device copy); more
// arrays than one table holds take more launches.  Inside a chunk a thread
// loads 16 bytes (four floats) at a time and stores their four 16-bit
// results as 8, 4 or 2-byte words, as the destination's alignment allows; the
// unaligned first and last elements of a chunk (at most 3 each) go one by one.
// The values are converted one at a time by the same intrinsics as before
// (__float2bfloat16_rn, __float2half_rn): bitwise Tensor.to on CUDA.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace autosac {
namespace {

// The shape of the work; benchmarks/pack_downcast_cuda_check.cu builds other
// values to compare them and a small AUTOSAC_PACK_MAX_GRID to test the splits.
#ifndef AUTOSAC_PACK_THREADS
#define AUTOSAC_PACK_THREADS 256
#endif
#ifndef AUTOSAC_PACK_UNROLL
#define AUTOSAC_PACK_UNROLL 4
#endif
#ifndef AUTOSAC_PACK_MAX_GRID
#define AUTOSAC_PACK_MAX_GRID INT_MAX
#endif

constexpr int kThreads = AUTOSAC_PACK_THREADS;   // threads per block
constexpr int kUnroll = AUTOSAC_PACK_UNROLL;     // 16-byte loads in flight per thread
constexpr int kChunk = kThreads * kUnroll * 4;   // elements per block (4096): a multiple of 4
constexpr int kMaxGrid = AUTOSAC_PACK_MAX_GRID;  // blocks per launch (the grid's x limit)
constexpr int kMaxPieces = 128;                  // arrays per launch: the table stays under 4 KB of arguments

// Piece i (an array, or a part of one) is blocks [first_block[i], first_block[i + 1]).
struct Table {
  const float* src[kMaxPieces];
  uint16_t* dst[kMaxPieces];
  int64_t numel[kMaxPieces];
  int first_block[kMaxPieces + 1];
  int n;
};
static_assert(sizeof(Table) <= 4096, "kernel arguments are limited to 4 KB");

struct ToBF16 {
  static __device__ __forceinline__ uint16_t bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};

struct ToF16 {
  static __device__ __forceinline__ uint16_t bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

// Four results at q: one 8-byte store, two 4-byte stores or four 2-byte ones,
// as q's alignment (`align`: 8, 4 or 2 bytes, the same for the whole block) allows.
template <typename C>
__device__ __forceinline__ void store4(uint16_t* q, const float4& v, int align) {
  const uint32_t a = C::bits(v.x), b = C::bits(v.y), c = C::bits(v.z), d = C::bits(v.w);
  if (align == 8) {
    *reinterpret_cast<uint2*>(q) = make_uint2(a | (b << 16), c | (d << 16));
  } else if (align == 4) {
    reinterpret_cast<uint32_t*>(q)[0] = a | (b << 16);
    reinterpret_cast<uint32_t*>(q)[1] = c | (d << 16);
  } else {
    q[0] = static_cast<uint16_t>(a);
    q[1] = static_cast<uint16_t>(b);
    q[2] = static_cast<uint16_t>(c);
    q[3] = static_cast<uint16_t>(d);
  }
}

// The piece holding block `b`: the last i with first_block[i] <= b (the same for every thread of the block).
__device__ __forceinline__ int piece_of(const Table& t, int b) {
  int lo = 0, hi = t.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_block[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Elements [begin, end) of one piece, end - begin <= kChunk; src is 4-byte aligned.
template <typename C>
__device__ __forceinline__ void convert_chunk(const float* __restrict__ src, uint16_t* __restrict__ dst, int64_t begin,
                                              int64_t end) {
  const int tid = static_cast<int>(threadIdx.x);
  // begin is a multiple of 4, so src + begin + head is 16-byte aligned
  const int head = static_cast<int>(((16u - (reinterpret_cast<uintptr_t>(src) & 15u)) & 15u) >> 2);
  const int64_t vbegin = begin + head < end ? begin + head : end;
  const int nvec = static_cast<int>((end - vbegin) >> 2);
  const int64_t vend = vbegin + 4 * static_cast<int64_t>(nvec);
  if (tid < vbegin - begin) {  // up to 3 elements before the first aligned float4
    dst[begin + tid] = C::bits(src[begin + tid]);
  }
  if (tid < end - vend) {  // up to 3 elements after the last whole float4
    dst[vend + tid] = C::bits(src[vend + tid]);
  }
  const float4* v = reinterpret_cast<const float4*>(src + vbegin);
  uint16_t* q = dst + vbegin;
  const uintptr_t qa = reinterpret_cast<uintptr_t>(q);
  const int align = (qa & 7u) == 0 ? 8 : ((qa & 3u) == 0 ? 4 : 2);
  float4 r[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {  // every load issued before the first store
    const int i = tid + k * kThreads;
    if (i < nvec) {
      r[k] = v[i];
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int i = tid + k * kThreads;
    if (i < nvec) {
      store4<C>(q + 4 * static_cast<int64_t>(i), r[k], align);
    }
  }
}

// The table is read where the launch put it (nvcc indexes kernel arguments in
// place: -Xptxas -v reports no stack frame), one search per block.
template <typename C>
__global__ void __launch_bounds__(kThreads) pack_kernel(const Table t) {
  const int b = static_cast<int>(blockIdx.x);
  const int p = piece_of(t, b);
  const int64_t begin = static_cast<int64_t>(b - t.first_block[p]) * kChunk;
  const int64_t end = begin + kChunk < t.numel[p] ? begin + kChunk : t.numel[p];
  convert_chunk<C>(t.src[p], t.dst[p], begin, end);
}

cudaError_t launch(const Table& t, bool bf16, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(t.first_block[t.n]);
  if (bf16) {
    pack_kernel<ToBF16><<<blocks, kThreads, 0, stream>>>(t);
  } else {
    pack_kernel<ToF16><<<blocks, kThreads, 0, stream>>>(t);
  }
  return cudaGetLastError();
}

}  // namespace

// srcs and numels are host arrays of n entries: n float32 device arrays (each
// 4-byte aligned) of numels[i] elements, written one after another into the
// device buffer `out` (16-bit elements, 2-byte aligned).  Empty arrays are
// skipped.  Returns the first launch error.
cudaError_t launch_pack_downcast(const float* const* srcs, const int64_t* numels, int n, void* out, bool bf16,
                                 cudaStream_t stream) {
  Table t;
  t.n = 0;
  t.first_block[0] = 0;
  uint16_t* dst = static_cast<uint16_t*>(out);
  for (int i = 0; i < n; ++i) {
    int64_t done = 0;
    while (done < numels[i]) {
      const int64_t room = static_cast<int64_t>(kMaxGrid) - t.first_block[t.n];  // blocks one launch may still take
      if (t.n == kMaxPieces || room == 0) {
        const cudaError_t err = launch(t, bf16, stream);
        if (err != cudaSuccess) {
          return err;
        }
        t.n = 0;
        continue;
      }
      // a piece split off a longer array ends at a whole chunk: the rest keeps its alignment
      const int64_t rest = numels[i] - done;
      const int64_t take = rest < room * kChunk ? rest : room * kChunk;
      t.src[t.n] = srcs[i] + done;
      t.dst[t.n] = dst;
      t.numel[t.n] = take;
      t.first_block[t.n + 1] = t.first_block[t.n] + static_cast<int>((take + kChunk - 1) / kChunk);
      ++t.n;
      dst += take;
      done += take;
    }
  }
  return t.n > 0 ? launch(t, bf16, stream) : cudaSuccess;
}

}  // namespace autosac
