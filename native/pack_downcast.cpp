// autosac::pack_downcast(Tensor[] shards, ScalarType dtype) -> Tensor
//
// One pass over many float32 tensors, writing one flat bfloat16 or float16
// buffer: shard i lands at the sum of the sizes before it.  Rounding is to
// nearest, ties to even, bitwise as Tensor.to casts on the same device (NaNs
// stay NaNs, infinities infinities).  The CPU kernel splits the total element range across
// threads with at::parallel_for, whatever the shard boundaries.
//
// Registered for CPU and Meta (so FakeTensorMode traces it); the CUDA kernel
// lives in pack_downcast_cuda.cu and is bound by pack_downcast_cuda_binding.cpp
// when torch is built with CUDA.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace autosac {

// float32 -> bfloat16 bits, round to nearest even.  Every NaN becomes 0xffff,
// the NaN PyTorch's own CPU conversion (Tensor.to) writes, so the result is
// bitwise that of casting each tensor on its own.
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? 0xffffu : rounded);
}

// Compiled for AVX-512, AVX2 and baseline x86-64, picked at load time by the
// CPU (GCC function multiversioning); elsewhere one portable version.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AUTOSAC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AUTOSAC_CLONES
#endif

AUTOSAC_CLONES static void convert_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = bf16_bits(src[i]);
  }
}

// float32 -> float16, IEEE round to nearest even; a NaN keeps its sign and top
// payload bits and is made quiet, as PyTorch's CPU conversion (F16C) writes it.
AUTOSAC_CLONES static void convert_f16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &src[i], sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      dst[i] = static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
    } else {
      dst[i] = c10::Half(src[i]).x;
    }
  }
}

static void check_inputs(at::TensorList shards, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              "pack_downcast: dtype must be torch.bfloat16 or torch.float16, got ", dtype);
  TORCH_CHECK(!shards.empty(), "pack_downcast: needs at least one tensor");
  const auto device = shards[0].device();
  for (const auto& t : shards) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, "pack_downcast: every tensor must be float32, got ", t.scalar_type());
    TORCH_CHECK(t.device() == device, "pack_downcast: tensors on different devices (", device, " and ", t.device(), ")");
  }
}

static std::vector<int64_t> offsets_of(at::TensorList shards) {
  std::vector<int64_t> offsets(shards.size() + 1, 0);
  for (size_t i = 0; i < shards.size(); ++i) {
    offsets[i + 1] = offsets[i] + shards[i].numel();
  }
  return offsets;
}

// Writes the shards' downcast elements into `out` (1-D, contiguous, `dtype`,
// as many elements as the shards hold together).
static void pack_into(at::TensorList shards, at::ScalarType dtype, const at::Tensor& out) {
  std::vector<at::Tensor> src;
  src.reserve(shards.size());
  for (const auto& t : shards) {
    src.push_back(t.contiguous());
  }
  const auto offsets = offsets_of(src);
  const int64_t total = offsets.back();
  if (total == 0) {
    return;
  }
  std::vector<const float*> ptrs(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    ptrs[i] = src[i].data_ptr<float>();
  }
  const bool bf16 = dtype == at::kBFloat16;
  uint16_t* base = static_cast<uint16_t*>(out.data_ptr());
  constexpr int64_t kGrain = 1 << 16;
  at::parallel_for(0, total, kGrain, [&](int64_t begin, int64_t end) {
    // the shard holding element `begin`, then on through the shards this range covers
    size_t s = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    int64_t pos = begin;
    while (pos < end) {
      while (offsets[s + 1] <= pos) {
        ++s;  // skip empty shards
      }
      const int64_t stop = std::min(end, offsets[s + 1]);
      const float* from = ptrs[s] + (pos - offsets[s]);
      if (bf16) {
        convert_bf16(from, base + pos, stop - pos);
      } else {
        convert_f16(from, base + pos, stop - pos);
      }
      pos = stop;
    }
  });
}

static int64_t total_numel(at::TensorList shards) {
  int64_t total = 0;
  for (const auto& t : shards) {
    total += t.numel();
  }
  return total;
}

static void check_out(at::TensorList shards, at::ScalarType dtype, const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == dtype, "pack_downcast: out has dtype ", out.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), "pack_downcast: out must be a contiguous 1-D tensor");
  TORCH_CHECK(out.device() == shards[0].device(), "pack_downcast: out is on ", out.device(), ", the tensors on ",
              shards[0].device());
  TORCH_CHECK(out.numel() == total_numel(shards), "pack_downcast: out holds ", out.numel(),
              " elements, the tensors ", total_numel(shards));
}

at::Tensor pack_downcast_cpu(at::TensorList shards, at::ScalarType dtype) {
  check_inputs(shards, dtype);
  at::Tensor out = at::empty({total_numel(shards)}, shards[0].options().dtype(dtype));
  pack_into(shards, dtype, out);
  return out;
}

at::Tensor& pack_downcast_out_cpu(at::TensorList shards, at::ScalarType dtype, at::Tensor& out) {
  check_inputs(shards, dtype);
  check_out(shards, dtype, out);
  pack_into(shards, dtype, out);
  return out;
}

at::Tensor& pack_downcast_out_meta(at::TensorList shards, at::ScalarType dtype, at::Tensor& out) {
  check_inputs(shards, dtype);
  TORCH_CHECK(out.scalar_type() == dtype, "pack_downcast: out has dtype ", out.scalar_type(), ", expected ", dtype);
  return out;
}

at::Tensor pack_downcast_meta(at::TensorList shards, at::ScalarType dtype) {
  check_inputs(shards, dtype);
  c10::SymInt total = 0;
  for (const auto& t : shards) {
    total += t.sym_numel();
  }
  return at::empty_symint({total}, shards[0].options().dtype(dtype));
}

}  // namespace autosac

TORCH_LIBRARY(autosac, m) {
  m.def("pack_downcast(Tensor[] shards, ScalarType dtype) -> Tensor");
  m.def("pack_downcast.out(Tensor[] shards, ScalarType dtype, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(autosac, CPU, m) {
  m.impl("pack_downcast", &autosac::pack_downcast_cpu);
  m.impl("pack_downcast.out", &autosac::pack_downcast_out_cpu);
}

TORCH_LIBRARY_IMPL(autosac, Meta, m) {
  m.impl("pack_downcast", &autosac::pack_downcast_meta);
  m.impl("pack_downcast.out", &autosac::pack_downcast_out_meta);
}
