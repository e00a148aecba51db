// CUDA kernel of autosac::pack_downcast: many float32 device arrays -> one
// flat bfloat16 or float16 device buffer, round to nearest even (Inf and NaN
// kept).  Plain CUDA C++, no PyTorch headers: pack_downcast_cuda_binding.cpp
// registers it as the op's CUDA implementation.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace autosac {

// The shard holding flat element `i`: the last s with offsets[s] <= i.
__device__ __forceinline__ int shard_of(const int64_t* offsets, int n, int64_t i) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename Out, typename Convert>
__global__ void pack_kernel(const float* const* srcs, const int64_t* offsets, int n, int64_t total, Out* out,
                            Convert convert) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int s = shard_of(offsets, n, i);
    out[i] = convert(srcs[s][i - offsets[s]]);
  }
}

struct ToBF16 {
  __device__ __forceinline__ __nv_bfloat16 operator()(float x) const { return __float2bfloat16_rn(x); }
};

struct ToF16 {
  __device__ __forceinline__ __half operator()(float x) const { return __float2half_rn(x); }
};

// srcs and offsets are device arrays: n source pointers, n + 1 offsets
// (offsets[n] == total; empty shards repeat an offset).  Returns the launch's error.
cudaError_t launch_pack_downcast(const float* const* srcs, const int64_t* offsets, int n, int64_t total, void* out,
                                 bool bf16, int sm_count, cudaStream_t stream) {
  if (total == 0) {
    return cudaSuccess;
  }
  const int threads = 256;
  int64_t blocks = (total + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sm_count > 0 ? sm_count : 80) * 32;
  if (blocks > cap) {
    blocks = cap;
  }
  if (bf16) {
    pack_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        srcs, offsets, n, total, static_cast<__nv_bfloat16*>(out), ToBF16());
  } else {
    pack_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        srcs, offsets, n, total, static_cast<__half*>(out), ToF16());
  }
  return cudaGetLastError();
}

}  // namespace autosac
