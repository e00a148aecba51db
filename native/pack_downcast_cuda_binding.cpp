// Registers the CUDA kernel (pack_downcast_cuda.cu) as autosac::pack_downcast's
// CUDA implementation.  Built only when PyTorch has CUDA.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

namespace autosac {

cudaError_t launch_pack_downcast(const float* const* srcs, const int64_t* offsets, int n, int64_t total, void* out,
                                 bool bf16, int sm_count, cudaStream_t stream);

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

// One kernel launch writing every shard's downcast elements into `out`.
static void pack_into_cuda(at::TensorList shards, at::ScalarType dtype, const at::Tensor& out) {
  const auto device = shards[0].device();
  std::vector<at::Tensor> src;
  src.reserve(shards.size());
  std::vector<int64_t> table(2 * shards.size() + 1, 0);  // pointers, then offsets
  int64_t total = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    src.push_back(shards[i].contiguous());
    table[i] = reinterpret_cast<int64_t>(src.back().data_ptr<float>());
    table[shards.size() + i] = total;
    total += shards[i].numel();
  }
  table[2 * shards.size()] = total;
  if (total == 0) {
    return;
  }
  c10::cuda::CUDAGuard guard(device);
  auto host = at::from_blob(table.data(), {static_cast<int64_t>(table.size())}, at::kLong).pin_memory();
  auto dev = host.to(device, /*non_blocking=*/true);
  const int64_t* d = dev.data_ptr<int64_t>();
  const int n = static_cast<int>(shards.size());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto err = launch_pack_downcast(reinterpret_cast<const float* const*>(d), d + n, n, total, out.data_ptr(),
                                        dtype == at::kBFloat16, sms, stream.stream());
  TORCH_CHECK(err == cudaSuccess, "pack_downcast: CUDA launch failed: ", cudaGetErrorString(err));
  // the tables must outlive the kernel: tie them to the stream's work
  dev.record_stream(stream);
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
