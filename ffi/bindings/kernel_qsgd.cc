// QSGD quantize / dequantize handlers. Leading dimensions are a batch (vmap_method="broadcast_all"
// gives every operand the same ones); the last dimension is the vector. Large vectors are cut into
// bucket-aligned chunks that run on XLA's intra-op thread pool; chunking does not change results.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "ffi_common.h"
#include "qsgd.h"

namespace {

constexpr int64_t kMinChunk = 1 << 16;  // values per task: enough to amortize scheduling

int64_t LastDim(ffi::AnyBuffer::Dimensions dims) { return dims.size() == 0 ? 1 : dims.back(); }

template <typename B>
int64_t Rows(const B& b, int64_t row) {
  return row > 0 ? static_cast<int64_t>(b.element_count()) / row : 0;
}

// Runs fn(row, first, count, err) over rows x chunks of n values, on the caller and up to
// num_threads - 1 pool tasks that claim chunks from a shared counter. The caller waits only for
// claimed chunks, so it cannot deadlock when the pool runs tasks late, inline or not at all;
// late tasks find no chunk left and touch only the shared state they co-own.
template <typename Fn>
ffi::Error ParallelChunks(ffi::ThreadPool& pool, int64_t rows, int64_t n, int64_t align, Fn fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunk = std::max<int64_t>(kMinChunk, n / (4 * threads));
  chunk = std::min(n, (chunk + align - 1) / align * align);
  const int64_t per_row = chunk > 0 ? (n + chunk - 1) / chunk : 0, total = rows * per_row;

  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::condition_variable cv;
    std::string error;
  };
  auto state = std::make_shared<State>();
  auto work = [state, total, per_row, chunk, n, fn]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < total;) {
      char err[SPARCML_ERRLEN] = {0};
      const int64_t row = c / per_row, first = (c % per_row) * chunk;
      if (fn(row, first, std::min(chunk, n - first), err) != 0 && !state->failed.exchange(true)) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->error = err;
      }
      if (state->done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min(threads, total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // Schedule takes an rvalue
  work();
  {
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done.load() == total; });
    if (state->failed.load()) return ffi::Error::InvalidArgument(state->error);
  }
  return ffi::Error::Success();
}

ffi::Error BadShape(const std::string& what) { return ffi::Error::InvalidArgument("qsgd: " + what); }

ffi::Error QuantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> key,
                        ffi::ResultBuffer<ffi::U8> packed, ffi::ResultBuffer<ffi::F32> scales, int64_t bits,
                        int64_t bucket_size, std::string_view scale) {
  int kind = scale == "max" ? SPARCML_QSGD_SCALE_MAX : scale == "l2" ? SPARCML_QSGD_SCALE_L2 : -2;
  if (kind < 0) return BadShape("scale=\"" + std::string(scale) + "\" is unknown; use \"max\" or \"l2\"");
  char err[SPARCML_ERRLEN] = {0};
  const int64_t n = LastDim(x.dimensions());
  if (int status = sparcml_qsgd_check(n, static_cast<int>(bits), bucket_size, kind, err)) {
    return sparcml::KernelError(status, err);
  }
  const int64_t nbytes = sparcml_qsgd_packed_bytes(n, static_cast<int>(bits));
  const int64_t nb = sparcml_qsgd_num_buckets(n, bucket_size);
  const int64_t rows = Rows(x, n);
  if (LastDim(key.dimensions()) != 2 || Rows(key, 2) != rows) {
    return BadShape("key must be uint32[2] (jax.random.key_data of a threefry key) per vector");
  }
  if (LastDim(packed->dimensions()) != nbytes || Rows(*packed, nbytes) != rows) {
    return BadShape("packed output must hold ceil(n * bits / 8) = " + std::to_string(nbytes) + " bytes per vector");
  }
  if (LastDim(scales->dimensions()) != nb || Rows(*scales, nb) != rows) {
    return BadShape("scales output must hold ceil(n / bucket_size) = " + std::to_string(nb) + " values per vector");
  }
  const float* xs = x.typed_data();
  const uint32_t* keys = key.typed_data();
  uint8_t* out = packed->typed_data();
  float* sc = scales->typed_data();
  const int b = static_cast<int>(bits);
  return ParallelChunks(pool, rows, n, sparcml_qsgd_alignment(bucket_size, b),
                        [=](int64_t r, int64_t first, int64_t count, char* e) {
                          return sparcml_qsgd_quantize_range(xs + r * n, n, first, count, b, bucket_size, kind,
                                                             keys[2 * r], keys[2 * r + 1], out + r * nbytes,
                                                             sc + r * nb, e);
                        });
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> scales,
                          ffi::ResultBuffer<ffi::F32> out, int64_t bits, int64_t bucket_size) {
  char err[SPARCML_ERRLEN] = {0};
  const int64_t n = LastDim(out->dimensions());
  if (int status = sparcml_qsgd_check(n, static_cast<int>(bits), bucket_size, -1, err)) {
    return sparcml::KernelError(status, err);
  }
  const int64_t nbytes = sparcml_qsgd_packed_bytes(n, static_cast<int>(bits));
  const int64_t nb = sparcml_qsgd_num_buckets(n, bucket_size);
  const int64_t rows = Rows(*out, n);
  if (LastDim(packed.dimensions()) != nbytes || Rows(packed, nbytes) != rows) {
    return BadShape("packed must hold ceil(n * bits / 8) = " + std::to_string(nbytes) + " bytes per vector");
  }
  if (LastDim(scales.dimensions()) != nb || Rows(scales, nb) != rows) {
    return BadShape("scales must hold ceil(n / bucket_size) = " + std::to_string(nb) + " values per vector");
  }
  const uint8_t* p = packed.typed_data();
  const float* sc = scales.typed_data();
  float* o = out->typed_data();
  const int b = static_cast<int>(bits);
  return ParallelChunks(pool, rows, n, sparcml_qsgd_alignment(bucket_size, b),
                        [=](int64_t r, int64_t first, int64_t count, char* e) {
                          return sparcml_qsgd_dequantize_range(p + r * nbytes, sc + r * nb, n, first, count, b,
                                                               bucket_size, o + r * n, e);
                        });
}

}  // namespace

SPARCML_EXPORT XLA_FFI_Error* SparcmlQsgdQuantize(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlQsgdQuantize, QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<std::string_view>("scale"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlQsgdDequantize(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlQsgdDequantize, DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size"));
