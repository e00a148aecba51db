// Standalone check and timing of native/pack_downcast_cuda.cu (no PyTorch),
// for a GPU host, also under compute-sanitizer:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -o /tmp/pdc benchmarks/pack_downcast_cuda_check.cu
//   /tmp/pdc check      every element written, bitwise a one-thread-per-element
//                       conversion, nothing written outside: sizes around the chunk
//                       and vector widths, every source and destination misalignment,
//                       more arrays than one launch takes
//   /tmp/pdc check quick   fewer shifts, for compute-sanitizer
//   /tmp/pdc time       64M float32 in 100 arrays -> bf16, against cudaMemcpy of 64M float32
//
// Add -DAUTOSAC_PACK_MAX_GRID=3 to split arrays across launches, or
// -DAUTOSAC_PACK_THREADS=... -DAUTOSAC_PACK_UNROLL=... to time other shapes.

#include "../native/pack_downcast_cuda.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

template <bool BF16>
__global__ void reference(const float* src, uint16_t* dst, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    dst[i] = BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(src[i])) : __half_as_ushort(__float2half_rn(src[i]));
  }
}

static cudaError_t launch_pack_downcast_host(const std::vector<const float*>& srcs, const std::vector<int64_t>& sizes,
                                      uint16_t* out, bool bf16) {
  return autosac::launch_pack_downcast(srcs.data(), sizes.data(), static_cast<int>(srcs.size()), out, bf16, 0);
}

static uint32_t next_random(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return static_cast<uint32_t>(s >> 16);
}

// One case: arrays of `sizes` at float offsets `shift` (mod 4) into a random
// buffer, packed at element `out_shift` of a guarded output.
static bool run_case(const std::vector<int64_t>& sizes, int shift, int out_shift, bool bf16, const float* pool,
                     int64_t pool_n, uint64_t& rng) {
  std::vector<const float*> srcs;
  int64_t total = 0;
  for (int64_t n : sizes) {
    const int64_t room = pool_n - n - 8;
    const int64_t at = room > 0 ? (next_random(rng) % (room / 4)) * 4 + shift : 0;
    srcs.push_back(pool + at);
    total += n;
  }
  const int64_t guard = 16, len = total + 2 * guard;
  uint16_t *out, *ref;
  CHECK(cudaMalloc(&out, len * 2));
  CHECK(cudaMalloc(&ref, len * 2));
  CHECK(cudaMemset(out, 0xAB, len * 2));
  CHECK(cudaMemset(ref, 0xAB, len * 2));
  CHECK(launch_pack_downcast_host(srcs, sizes, out + guard + out_shift, bf16));
  int64_t at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > 0) {
      const unsigned blocks = static_cast<unsigned>((sizes[i] + 255) / 256);
      if (bf16) {
        reference<true><<<blocks, 256>>>(srcs[i], ref + guard + out_shift + at, sizes[i]);
      } else {
        reference<false><<<blocks, 256>>>(srcs[i], ref + guard + out_shift + at, sizes[i]);
      }
    }
    at += sizes[i];
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> a(len), b(len);
  CHECK(cudaMemcpy(a.data(), out, len * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(b.data(), ref, len * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaFree(out));
  CHECK(cudaFree(ref));
  for (int64_t i = 0; i < len; ++i) {
    if (a[i] != b[i]) {
      std::printf("MISMATCH %s arrays=%zu shift=%d out_shift=%d at %lld: %04x != %04x\n", bf16 ? "bf16" : "f16",
                  sizes.size(), shift, out_shift, static_cast<long long>(i), a[i], b[i]);
      return false;
    }
  }
  return true;
}

static int check(bool quick) {  // quick: bf16, two source and two destination shifts
  const int64_t pool_n = 1 << 22;
  std::vector<uint32_t> bits(pool_n);
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  for (auto& b : bits) {
    b = next_random(rng) ^ (next_random(rng) << 16);  // every pattern: NaNs, Infs, subnormals, ties
  }
  float* pool;
  CHECK(cudaMalloc(&pool, pool_n * 4));
  CHECK(cudaMemcpy(pool, bits.data(), pool_n * 4, cudaMemcpyHostToDevice));
  const int64_t edge[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 1023, 1024, 1025, 4091, 4095, 4096, 4097, 4100, 8191, 8192, 8193,
                          12291, 100003};
  const int n_edge = sizeof(edge) / sizeof(edge[0]);
  int cases = 0, bad = 0;
  for (int bf16 = quick ? 1 : 0; bf16 < 2; ++bf16) {
    for (int shift = 0; shift < 4; shift += quick ? 3 : 1) {
      for (int out_shift = 0; out_shift < (quick ? 2 : 4); ++out_shift) {
        for (int e = 0; e < n_edge; ++e) {  // one array of each size, and each size after an odd one
          bad += !run_case({edge[e]}, shift, out_shift, bf16, pool, pool_n, rng);
          bad += !run_case({3, edge[e], 5}, shift, out_shift, bf16, pool, pool_n, rng);
          cases += 2;
        }
        std::vector<int64_t> many;  // more arrays than one launch's table holds
        for (int i = 0; i < 300; ++i) {
          many.push_back(edge[next_random(rng) % n_edge]);
        }
        bad += !run_case(many, shift, out_shift, bf16, pool, pool_n, rng);
        ++cases;
      }
    }
  }
  CHECK(cudaFree(pool));
  std::printf("check: %d cases, %d mismatched (chunk %d, max grid %d)\n", cases, bad, autosac::kChunk,
              autosac::kMaxGrid);
  return bad == 0 ? 0 : 1;
}

static float time_ms(cudaEvent_t s, cudaEvent_t e) {
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, s, e));
  return ms;
}

static int timing() {
  const int64_t N = 64ll << 20, K = 100;
  std::vector<int64_t> sizes(K, N / K);
  sizes[K - 1] = N - (N / K) * (K - 1);
  std::vector<float*> bufs(K);
  std::vector<const float*> srcs(K);
  for (int i = 0; i < K; ++i) {
    CHECK(cudaMalloc(&bufs[i], sizes[i] * 4));
    CHECK(cudaMemset(bufs[i], 0x3f, sizes[i] * 4));
    srcs[i] = bufs[i];
  }
  uint16_t* out;
  float *a, *b;
  CHECK(cudaMalloc(&out, N * 2));
  CHECK(cudaMalloc(&a, N * 4));
  CHECK(cudaMalloc(&b, N * 4));
  cudaEvent_t s, e;
  CHECK(cudaEventCreate(&s));
  CHECK(cudaEventCreate(&e));
  const int reps = 50;
  for (int round = 0; round < 3; ++round) {
    CHECK(cudaEventRecord(s));
    for (int r = 0; r < reps; ++r) {
      CHECK(launch_pack_downcast_host(srcs, sizes, out, true));
    }
    CHECK(cudaEventRecord(e));
    CHECK(cudaEventSynchronize(e));
    const float pack = time_ms(s, e) / reps;
    CHECK(cudaEventRecord(s));
    for (int r = 0; r < reps; ++r) {
      CHECK(cudaMemcpyAsync(b, a, N * 4, cudaMemcpyDeviceToDevice));
    }
    CHECK(cudaEventRecord(e));
    CHECK(cudaEventSynchronize(e));
    const float copy = time_ms(s, e) / reps;
    const double pack_gbps = N * 6.0 / (pack * 1e6), copy_gbps = N * 8.0 / (copy * 1e6);
    std::printf("time: threads %d unroll %d: pack %.3f ms %.0f GB/s, copy %.3f ms %.0f GB/s, %.1f %%\n", autosac::kThreads,
                autosac::kUnroll, pack, pack_gbps, copy, copy_gbps, 100 * pack_gbps / copy_gbps);
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "time") == 0) {
    return timing();
  }
  return check(argc > 2 && std::strcmp(argv[2], "quick") == 0);
}
