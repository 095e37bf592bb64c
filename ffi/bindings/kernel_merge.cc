#include "ffi_common.h"
#include "merge.h"

namespace {

ffi::Error MergeImpl(ffi::Buffer<ffi::S32> a_idx, ffi::Buffer<ffi::F32> a_val, ffi::BufferR0<ffi::S32> a_nnz,
                     ffi::Buffer<ffi::S32> b_idx, ffi::Buffer<ffi::F32> b_val, ffi::BufferR0<ffi::S32> b_nnz,
                     ffi::ResultBuffer<ffi::S32> out_idx, ffi::ResultBuffer<ffi::F32> out_val,
                     ffi::ResultBufferR0<ffi::S32> out_nnz, int64_t n, int64_t dense_threshold) {
  char err[SPARCML_ERRLEN] = {0};
  int64_t nnz = 0;
  int64_t a_count = a_nnz.typed_data()[0], b_count = b_nnz.typed_data()[0];
  int64_t a_cap = sparcml::StreamCapacity(a_idx.element_count(), a_val.element_count(), a_count, n);
  int64_t b_cap = sparcml::StreamCapacity(b_idx.element_count(), b_val.element_count(), b_count, n);
  int status = sparcml_merge(a_idx.typed_data(), a_val.typed_data(), a_count, a_cap, b_idx.typed_data(),
                             b_val.typed_data(), b_count, b_cap, n, dense_threshold,
                             out_idx->typed_data(), out_val->typed_data(),
                             static_cast<int64_t>(out_idx->element_count()), &nnz, err);
  out_nnz->typed_data()[0] = static_cast<int32_t>(nnz);
  return sparcml::KernelError(status, err);
}

}  // namespace

SPARCML_EXPORT XLA_FFI_Error* SparcmlMerge(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMerge, MergeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("dense_threshold"));
