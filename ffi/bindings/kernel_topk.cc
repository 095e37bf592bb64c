#include "ffi_common.h"
#include "topk.h"

namespace {

// x is float32[..., n]: every leading index is one independent row (vmap_method="broadcast_all"),
// so a vmapped top-k is one call. Outputs are [..., k].
ffi::Error TopkImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out_idx, ffi::ResultBuffer<ffi::F32> out_val,
                    int64_t k) {
  auto dims = x.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("topk: x must have at least one dimension");
  const int64_t n = dims.back();
  const int64_t rows = n == 0 ? 0 : static_cast<int64_t>(x.element_count()) / n;
  char err[SPARCML_ERRLEN] = {0};
  if (n == 0) return sparcml::KernelError(sparcml_topk(x.typed_data(), 0, k, nullptr, nullptr, err), err);
  if (static_cast<int64_t>(out_idx->element_count()) != rows * k) {
    return ffi::Error::InvalidArgument("topk: outputs must hold k entries per row of x");
  }
  for (int64_t r = 0; r < rows; ++r) {
    int status = sparcml_topk(x.typed_data() + r * n, n, k, out_idx->typed_data() + r * k,
                              out_val->typed_data() + r * k, err);
    if (status != 0) return sparcml::KernelError(status, err);
  }
  return ffi::Error::Success();
}

}  // namespace

SPARCML_EXPORT XLA_FFI_Error* SparcmlTopk(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlTopk, TopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k"));
