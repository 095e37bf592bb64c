// QSGD quantize / dequantize handlers. Leading dimensions are a batch (vmap_method="broadcast_all"
// gives every operand the same ones); the last dimension is the vector.
#include <string>
#include <string_view>

#include "ffi_common.h"
#include "qsgd.h"

namespace {

int64_t LastDim(ffi::AnyBuffer::Dimensions dims) { return dims.size() == 0 ? 1 : dims.back(); }

template <typename B>
int64_t Rows(const B& b, int64_t row) {
  return row > 0 ? static_cast<int64_t>(b.element_count()) / row : 0;
}

ffi::Error BadShape(const std::string& what) { return ffi::Error::InvalidArgument("qsgd: " + what); }

ffi::Error QuantizeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> key, ffi::ResultBuffer<ffi::U8> packed,
                        ffi::ResultBuffer<ffi::F32> scales, int64_t bits, int64_t bucket_size,
                        std::string_view scale) {
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
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* k = key.typed_data() + 2 * r;
    int status = sparcml_qsgd_quantize(x.typed_data() + r * n, n, static_cast<int>(bits), bucket_size, kind, k[0],
                                       k[1], packed->typed_data() + r * nbytes, scales->typed_data() + r * nb, err);
    if (status) return sparcml::KernelError(status, err);
  }
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> out,
                          int64_t bits, int64_t bucket_size) {
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
  for (int64_t r = 0; r < rows; ++r) {
    int status = sparcml_qsgd_dequantize(packed.typed_data() + r * nbytes, scales.typed_data() + r * nb, n,
                                         static_cast<int>(bits), bucket_size, out->typed_data() + r * n, err);
    if (status) return sparcml::KernelError(status, err);
  }
  return ffi::Error::Success();
}

}  // namespace

SPARCML_EXPORT XLA_FFI_Error* SparcmlQsgdQuantize(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlQsgdQuantize, QuantizeImpl,
                              ffi::Ffi::Bind()
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
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size"));
