// bf16 x bf16 -> float32 matrix product for XLA:CPU, run by the BLAS's bf16 kernel.
//
// XLA:CPU has no AMX path for dots; the BLAS (oneMKL's cblas_gemm_bf16bf16f32) does. This
// handler is registered as an XLA FFI target; the BLAS function is handed over at load time
// (jaxsim_set_gemm), so building needs no BLAS headers or libraries.
//
// The BLAS runs single-threaded per call; the product is split into row (or column) blocks
// run on XLA's own intra-op thread pool, so no second thread pool competes with XLA's. The
// calling thread takes blocks too and waits only for blocks another thread has started, so
// two products waiting on each other's tasks cannot deadlock a small pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// MKL_INT is 32-bit in the LP64 interface; the ILP64 one takes 64-bit integers.
using GemmFn32 = void (*)(int layout, int transa, int transb, int m, int n, int k, float alpha,
                          const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta,
                          float* c, int ldc);

GemmFn32 gemm_fn = nullptr;
// Split products over XLA's pool (a single-threaded BLAS); off: one call, the BLAS's threads.
bool split_over_pool = true;

constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;
// Below this many multiply-adds a block, splitting costs more than it saves.
constexpr int64_t kMinBlockWork = int64_t{1} << 21;

struct Plan {
  const uint16_t* a;
  const uint16_t* b;
  float* c;
  int64_t m, n, k;
  bool transpose_a, transpose_b, split_rows;
  int64_t blocks, block;  // block: rows (or columns) of C per block

  void Run(int64_t i) const {
    int64_t start = i * block;
    int64_t size = std::min(block, (split_rows ? m : n) - start);
    int64_t lda = transpose_a ? m : k;
    int64_t ldb = transpose_b ? k : n;
    const uint16_t* a_i = a;
    const uint16_t* b_i = b;
    float* c_i = c;
    int64_t rows = m, cols = n;
    if (split_rows) {
      a_i += transpose_a ? start : start * lda;
      c_i += start * n;
      rows = size;
    } else {
      b_i += transpose_b ? start * ldb : start;
      c_i += start;
      cols = size;
    }
    gemm_fn(kRowMajor, transpose_a ? kTrans : kNoTrans, transpose_b ? kTrans : kNoTrans,
            static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(k), 1.0f, a_i,
            static_cast<int>(lda), b_i, static_cast<int>(ldb), 0.0f, c_i, static_cast<int>(n));
  }
};

struct Shared {
  Plan plan;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;

  // Runs blocks until none are left; returns how many this thread ran.
  void Drain() {
    int64_t ran = 0;
    for (int64_t i = next.fetch_add(1); i < plan.blocks; i = next.fetch_add(1)) {
      plan.Run(i);
      ++ran;
    }
    if (ran) {
      std::lock_guard<std::mutex> lock(mu);
      done += ran;
      if (done == plan.blocks) cv.notify_all();
    }
  }
};

ffi::Error Bf16Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                    ffi::ResultBuffer<ffi::F32> c, bool transpose_a, bool transpose_b) {
  if (gemm_fn == nullptr) {
    return ffi::Error::Internal("jaxsim bf16 gemm: no BLAS function was set");
  }
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2) {
    return ffi::Error::InvalidArgument("jaxsim bf16 gemm: operands must be 2-D");
  }
  int64_t m = transpose_a ? ad[1] : ad[0];
  int64_t k = transpose_a ? ad[0] : ad[1];
  int64_t kb = transpose_b ? bd[1] : bd[0];
  int64_t n = transpose_b ? bd[0] : bd[1];
  if (k != kb) return ffi::Error::InvalidArgument("jaxsim bf16 gemm: contraction mismatch");
  if (m >= (int64_t{1} << 31) || n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31)) {
    return ffi::Error::InvalidArgument("jaxsim bf16 gemm: dimension over 2**31");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();  // before the plan: no block of size 0
  if (k == 0) {
    std::fill(c->typed_data(), c->typed_data() + m * n, 0.0f);
    return ffi::Error::Success();
  }
  auto shared = std::make_shared<Shared>();
  Plan& p = shared->plan;
  p.a = reinterpret_cast<const uint16_t*>(a.typed_data());
  p.b = reinterpret_cast<const uint16_t*>(b.typed_data());
  p.c = c->typed_data();
  p.m = m; p.n = n; p.k = k;
  p.transpose_a = transpose_a;
  p.transpose_b = transpose_b;
  p.split_rows = m >= n;
  int64_t extent = p.split_rows ? m : n;
  int64_t threads = split_over_pool ? std::max<int64_t>(1, pool.num_threads()) : 1;
  int64_t by_work = std::max<int64_t>(1, (m * n * k) / kMinBlockWork);
  p.blocks = std::min<int64_t>({threads, by_work, extent});
  // Blocks of whole 16-row (column) tiles, as the BLAS kernels work in such tiles.
  int64_t tiles = (extent + 15) / 16;
  p.block = ((tiles + p.blocks - 1) / p.blocks) * 16;
  p.blocks = (extent + p.block - 1) / p.block;
  for (int64_t i = 1; i < p.blocks; ++i) {
    pool.Schedule([shared] { shared->Drain(); });
  }
  shared->Drain();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done == p.blocks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsimBf16Gemm, Bf16Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

extern "C" void jaxsim_set_gemm(void* fn, int split) {
  gemm_fn = reinterpret_cast<GemmFn32>(fn);
  split_over_pool = split != 0;
}
