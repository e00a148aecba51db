// Registers the CUDA kernel (pack_downcast_cuda.cu) as autosac::pack_downcast's
// CUDA implementation.  Built only when PyTorch has CUDA.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

namespace autosac {

cudaError_t launch_pack_downcast(const float* const* srcs, const int64_t* numels, int n, void* out, bool bf16,
                                 cudaStream_t stream);

static int64_t checked_total(at::TensorList shards, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              "pack_downcast: dtype must be torch.bfloat16 or torch.float16, got ", dtype);
  TORCH_CHECK(!shards.empty(), "pack_downcast: needs at least one tensor");
  int64_t total = 0;
  for (const auto& t : shards) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, "pack_downcast: every tensor must be float32, got ", t.scalar_type());
    TORCH_CHECK(t.device() == shards[0].device(), "pack_downcast: tensors on different devices (", shards[0].device(),
                " and ", t.device(), ")");
    total += t.numel();
  }
  return total;
}

// Writes every shard's downcast elements into `out`: one kernel launch per
// 128 shards, the shards' pointers and sizes passed as the kernel's argument.
static void pack_into_cuda(at::TensorList shards, at::ScalarType dtype, const at::Tensor& out) {
  c10::cuda::CUDAGuard guard(shards[0].device());
  std::vector<at::Tensor> src;  // contiguous copies of strided shards live until the kernel is queued
  src.reserve(shards.size());
  std::vector<const float*> ptrs;
  ptrs.reserve(shards.size());
  std::vector<int64_t> numels;
  numels.reserve(shards.size());
  for (const auto& t : shards) {
    src.push_back(t.contiguous());
    ptrs.push_back(src.back().data_ptr<float>());
    numels.push_back(t.numel());
  }
  const auto err = launch_pack_downcast(ptrs.data(), numels.data(), static_cast<int>(shards.size()), out.data_ptr(),
                                        dtype == at::kBFloat16, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "pack_downcast: CUDA launch failed: ", cudaGetErrorString(err));
}

at::Tensor pack_downcast_cuda(at::TensorList shards, at::ScalarType dtype) {
  const int64_t total = checked_total(shards, dtype);
  c10::cuda::CUDAGuard guard(shards[0].device());
  at::Tensor out = at::empty({total}, shards[0].options().dtype(dtype));
  pack_into_cuda(shards, dtype, out);
  return out;
}

at::Tensor& pack_downcast_out_cuda(at::TensorList shards, at::ScalarType dtype, at::Tensor& out) {
  const int64_t total = checked_total(shards, dtype);
  TORCH_CHECK(out.scalar_type() == dtype && out.dim() == 1 && out.is_contiguous() && out.numel() == total &&
                  out.device() == shards[0].device(),
              "pack_downcast: out must be a contiguous 1-D ", dtype, " tensor of ", total, " elements on ",
              shards[0].device());
  pack_into_cuda(shards, dtype, out);
  return out;
}

}  // namespace autosac

TORCH_LIBRARY_IMPL(autosac, CUDA, m) {
  m.impl("pack_downcast", &autosac::pack_downcast_cuda);
  m.impl("pack_downcast.out", &autosac::pack_downcast_out_cuda);
}
