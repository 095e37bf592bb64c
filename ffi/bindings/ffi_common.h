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

}  // namespace sparcml
