#include "ffi_common.h"
#include "partition.h"

#include <vector>

namespace {

ffi::Error FromDenseImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out_idx,
                         ffi::ResultBuffer<ffi::F32> out_val, ffi::ResultBufferR0<ffi::S32> out_nnz,
                         int64_t dense_threshold) {
  int64_t nnz = 0;
  sparcml_from_dense(x.typed_data(), static_cast<int64_t>(x.element_count()), dense_threshold,
                     out_idx->typed_data(), out_val->typed_data(), static_cast<int64_t>(out_idx->element_count()),
                     &nnz);
  out_nnz->typed_data()[0] = static_cast<int32_t>(nnz);
  return ffi::Error::Success();
}

ffi::Error FromDenseCountedImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out_idx,
                                ffi::ResultBuffer<ffi::F32> out_val, ffi::ResultBufferR0<ffi::S32> out_nnz,
                                ffi::ResultBufferR0<ffi::S32> out_count) {
  int64_t nnz = 0, count = 0;
  sparcml_from_dense_counted(x.typed_data(), static_cast<int64_t>(x.element_count()), out_idx->typed_data(),
                             out_val->typed_data(), static_cast<int64_t>(out_idx->element_count()), &nnz, &count);
  out_nnz->typed_data()[0] = static_cast<int32_t>(nnz);
  out_count->typed_data()[0] = static_cast<int32_t>(count);
  return ffi::Error::Success();
}

ffi::Error CoalesceImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::ResultBuffer<ffi::S32> out_idx,
                        ffi::ResultBuffer<ffi::F32> out_val, ffi::ResultBufferR0<ffi::S32> out_nnz, int64_t n,
                        int64_t dense_threshold) {
  char err[SPARCML_ERRLEN] = {0};
  int64_t nnz = 0;
  int status = sparcml_coalesce(idx.typed_data(), val.typed_data(), static_cast<int64_t>(idx.element_count()), n,
                                dense_threshold, out_idx->typed_data(), out_val->typed_data(),
                                static_cast<int64_t>(out_idx->element_count()), &nnz, err);
  out_nnz->typed_data()[0] = static_cast<int32_t>(nnz);
  return sparcml::KernelError(status, err);
}

ffi::Error ScatterAddImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                          ffi::Buffer<ffi::F32> dense, ffi::ResultBuffer<ffi::F32> out) {
  char err[SPARCML_ERRLEN] = {0};
  int64_t n = static_cast<int64_t>(dense.element_count()), count = nnz.typed_data()[0];
  int status = sparcml_scatter_add(idx.typed_data(), val.typed_data(), count,
                                   sparcml::StreamCapacity(idx.element_count(), val.element_count(), count, n),
                                   dense.typed_data(), n, out->typed_data(), err);
  return sparcml::KernelError(status, err);
}

ffi::Error ToDenseImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                       ffi::ResultBuffer<ffi::F32> out) {
  char err[SPARCML_ERRLEN] = {0};
  int64_t n = static_cast<int64_t>(out->element_count()), count = nnz.typed_data()[0];
  int status = sparcml_to_dense(idx.typed_data(), val.typed_data(), count,
                                sparcml::StreamCapacity(idx.element_count(), val.element_count(), count, n), n,
                                out->typed_data(), err);
  return sparcml::KernelError(status, err);
}

ffi::Error PackImpl(ffi::RemainingArgs parts, ffi::Result<ffi::AnyBuffer> out) {
  std::vector<const void*> data(parts.size());
  std::vector<int64_t> bytes(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    auto part = parts.get<ffi::AnyBuffer>(i);
    if (!part.has_value()) return part.error();
    data[i] = part->untyped_data();
    bytes[i] = static_cast<int64_t>(part->size_bytes());
  }
  sparcml_pack(data.data(), bytes.data(), static_cast<int64_t>(data.size()), out->untyped_data());
  return ffi::Error::Success();
}

ffi::Error UnpackImpl(ffi::AnyBuffer in, ffi::RemainingRets parts) {
  std::vector<void*> data(parts.size());
  std::vector<int64_t> bytes(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    auto part = parts.get<ffi::AnyBuffer>(i);
    if (!part.has_value()) return part.error();
    data[i] = (*part)->untyped_data();
    bytes[i] = static_cast<int64_t>((*part)->size_bytes());
  }
  sparcml_unpack(in.untyped_data(), data.data(), bytes.data(), static_cast<int64_t>(data.size()));
  return ffi::Error::Success();
}

ffi::Error ToDensePartsImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                            ffi::RemainingRets parts) {
  std::vector<float*> data(parts.size());
  std::vector<int64_t> sizes(parts.size());
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    auto part = parts.get<ffi::Buffer<ffi::F32>>(i);
    if (!part.has_value()) return part.error();
    data[i] = (*part)->typed_data();
    sizes[i] = static_cast<int64_t>((*part)->element_count());
    n += sizes[i];
  }
  char err[SPARCML_ERRLEN] = {0};
  int64_t count = nnz.typed_data()[0];
  int status = sparcml_to_dense_parts(idx.typed_data(), val.typed_data(), count,
                                      sparcml::StreamCapacity(idx.element_count(), val.element_count(), count, n), n,
                                      data.data(), sizes.data(), static_cast<int64_t>(data.size()), err);
  return sparcml::KernelError(status, err);
}

ffi::Error SplitImpl(ffi::Buffer<ffi::S32> idx, ffi::BufferR0<ffi::S32> nnz, ffi::ResultBuffer<ffi::S32> offsets,
                     int64_t n) {
  char err[SPARCML_ERRLEN] = {0};
  int status = sparcml_split(idx.typed_data(), nnz.typed_data()[0], static_cast<int64_t>(idx.element_count()), n,
                             static_cast<int64_t>(offsets->element_count()) - 1, offsets->typed_data(), err);
  return sparcml::KernelError(status, err);
}

ffi::Error GatherImpl(ffi::Buffer<ffi::F32> dense, ffi::Buffer<ffi::S32> indices, ffi::BufferR0<ffi::S32> nnz,
                      ffi::ResultBuffer<ffi::S32> out_idx, ffi::ResultBuffer<ffi::F32> out_val) {
  char err[SPARCML_ERRLEN] = {0};
  int status = sparcml_gather(dense.typed_data(), static_cast<int64_t>(dense.element_count()), indices.typed_data(),
                              nnz.typed_data()[0], static_cast<int64_t>(indices.element_count()),
                              out_idx->typed_data(), out_val->typed_data(), err);
  return sparcml::KernelError(status, err);
}

}  // namespace

SPARCML_EXPORT XLA_FFI_Error* SparcmlFromDense(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlFromDense, FromDenseImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("dense_threshold"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlFromDenseCounted(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlFromDenseCounted, FromDenseCountedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>());

SPARCML_EXPORT XLA_FFI_Error* SparcmlCoalesce(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlCoalesce, CoalesceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("dense_threshold"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlScatterAdd(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlScatterAdd, ScatterAddImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

SPARCML_EXPORT XLA_FFI_Error* SparcmlToDense(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlToDense, ToDenseImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

SPARCML_EXPORT XLA_FFI_Error* SparcmlPack(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlPack, PackImpl, ffi::Ffi::Bind().RemainingArgs().Ret<ffi::AnyBuffer>());

SPARCML_EXPORT XLA_FFI_Error* SparcmlUnpack(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlUnpack, UnpackImpl, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().RemainingRets());

SPARCML_EXPORT XLA_FFI_Error* SparcmlToDenseParts(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlToDenseParts, ToDensePartsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .RemainingRets());

SPARCML_EXPORT XLA_FFI_Error* SparcmlSplit(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlSplit, SplitImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("n"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlGather(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlGather, GatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
