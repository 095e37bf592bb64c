// Thin glue between the C kernels and the XLA FFI.
#pragma once

#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// XLA_FFI_DEFINE_HANDLER_SYMBOL carries no visibility attribute; declare the symbol exported first.
#define SPARCML_EXPORT extern "C" __attribute__((visibility("default")))

namespace sparcml {

inline ffi::Error KernelError(int status, const char* err) {
  if (status == 0) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(err));
}

inline int64_t Length(const ffi::AnyBuffer& b) { return static_cast<int64_t>(b.element_count()); }

// The capacity of a stream held in index and value buffers of these lengths. A stream dense by
// construction has no index buffer and its n values; with any other count it is invalid (-1,
// which sparcml_check_stream rejects by name) rather than empty or read through indices that are
// not there.
inline int64_t StreamCapacity(int64_t index_length, int64_t value_length, int64_t nnz, int64_t n) {
  if (index_length == 0 && value_length == n && n > 0) return nnz == n ? n : -1;
  return index_length;
}

}  // namespace sparcml
