// Native transport, the collectives whose result is dense: DSAR_Split_allgather (SparCML §5.2,
// Algorithm 3) and the dense allreduce. Every length-N buffer is an output written once: on a
// node, fresh N-sized buffers (page faults) and extra passes cost more than the wire.
//   reduce-scatter into a dense slice: the split phase, summed straight into this rank's dense
//     range (no sorted merges: DSAR densifies the range anyway, and the scatter of sorted
//     segments is one streaming pass per segment);
//   dense allgather: every rank's slice lands in place in the length-N result (MPI_Allgatherv),
//     without a [P, slot] staging buffer and the copy out of it;
//   dense allreduce of a stream: densified straight into the result, MPI_Allreduce in place.
// The dense results also return their indices 0..N-1, written after the communication.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "mpi_wire.h"
#include "partition.h"

namespace {

using sparcml::Header;
using sparcml::Segment;
using sparcml::Status;

// Our length-N outputs are fresh buffers of XLA's: asking for transparent huge pages before the
// first write turns thousands of 4 KiB page faults per call into a few (THP in "madvise" mode).
void AdviseHugePages(void* data, size_t bytes) {
  constexpr size_t kWorthIt = size_t{4} << 20;
  if (bytes < kWorthIt) return;
  uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // a hint: errors are harmless
}

template <class Buffer>
void AdviseHugePages(Buffer& b) {
  AdviseHugePages(b->untyped_data(), b->size_bytes());
}

ffi::Error ReduceScatterDenseImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                                  ffi::BufferR0<ffi::S32> status_in, ffi::Token, ffi::ResultBuffer<ffi::F32> slice,
                                  ffi::ResultBufferR0<ffi::S32> union_count, ffi::ResultBufferR0<ffi::S32> status_out,
                                  ffi::ResultBufferR0<ffi::F32> bytes_sent, ffi::Result<ffi::Token>,
                                  int64_t comm_handle, int64_t tag, int64_t n, double delta) {
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  int parts, me;
  MPI_Comm_size(comm, &parts);
  MPI_Comm_rank(comm, &me);
  Status status = static_cast<Status>(status_in.typed_data()[0]);
  // Range r of this rank's stream goes to rank r, as pairs or as a dense slice (SparCML's rule).
  sparcml::RangeMessages posted = sparcml::PostRanges(comm, static_cast<int>(tag), idx.typed_data(), val.typed_data(),
                                                      nnz.typed_data()[0], n, status, delta);
  std::vector<sparcml::Bytes> received = sparcml::ReceiveRanges(comm, static_cast<int>(tag), &posted);
  double sent = posted.sent;

  // Sum: every segment added into the dense range, in rank order (the order of the sorted merges).
  int64_t length = static_cast<int64_t>(slice->element_count());
  float* out = slice->typed_data();
  AdviseHugePages(slice);
  std::memset(out, 0, length * sizeof(float));
  std::vector<unsigned char> touched;  // the union's support, while no segment is dense
  int64_t covered = 0;
  for (int r = 0; r < parts && status == sparcml::kOk; ++r) {
    Segment s = sparcml::UnpackSegment(received[r]);
    status = sparcml::Incoming(status, s);
    if (status != sparcml::kOk) break;
    if (s.header.dense) {
      for (int64_t i = 0; i < length; ++i) out[i] += s.val[i];
      covered = length;
      continue;
    }
    if (covered < length && touched.empty()) touched.assign(length, 0);
    for (int64_t j = 0; j < s.header.count; ++j) {
      int32_t i = s.idx[j];
      out[i] += s.val[j];
      if (covered < length) {
        covered += !touched[i];
        touched[i] = 1;
      }
    }
  }
  if (status != sparcml::kOk) {
    std::memset(out, 0, length * sizeof(float));
    covered = 0;
  }
  union_count->typed_data()[0] = static_cast<int32_t>(covered);
  status_out->typed_data()[0] = status;
  bytes_sent->typed_data()[0] = static_cast<float>(sent);
  return ffi::Error::Success();
}

void Iota(ffi::ResultBuffer<ffi::S32>& indices) {
  int32_t* idx = indices->typed_data();
  int64_t n = static_cast<int64_t>(indices->element_count());
  for (int64_t i = 0; i < n; ++i) idx[i] = static_cast<int32_t>(i);
}

ffi::Error AllgatherDenseImpl(ffi::Buffer<ffi::F32> slice, ffi::BufferR0<ffi::S32> status_in, ffi::Token,
                              ffi::ResultBuffer<ffi::S32> indices, ffi::ResultBuffer<ffi::F32> values, ffi::ResultBufferR0<ffi::S32> status_out,
                              ffi::ResultBufferR0<ffi::F32> bytes_sent, ffi::Result<ffi::Token>, int64_t comm_handle) {
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  int parts, me;
  MPI_Comm_size(comm, &parts);
  MPI_Comm_rank(comm, &me);
  int64_t n = static_cast<int64_t>(values->element_count());
  std::vector<int> counts(parts), displs(parts);
  for (int r = 0; r < parts; ++r) {
    displs[r] = static_cast<int>(sparcml_part_start(n, parts, r));
    counts[r] = static_cast<int>(sparcml_part_start(n, parts, r + 1)) - displs[r];
  }
  float* out = values->typed_data();
  AdviseHugePages(values);
  AdviseHugePages(indices);
  // MPICH's MPI_Allgather is about twice as fast as its MPI_Allgatherv here: equal parts use it.
  if (std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; })) {
    MPI_Allgather(slice.typed_data(), counts[me], MPI_FLOAT, out, counts[me], MPI_FLOAT, comm);
  } else {
    MPI_Allgatherv(slice.typed_data(), counts[me], MPI_FLOAT, out, counts.data(), displs.data(), MPI_FLOAT, comm);
  }
  Iota(indices);
  status_out->typed_data()[0] = status_in.typed_data()[0];
  // Counted as equal slots of the largest part, as by the mpi4jax transport and the non-blocking
  // engine (MPI_Allgatherv sends a few values less when N % P != 0).
  int slot = *std::max_element(counts.begin(), counts.end());
  bytes_sent->typed_data()[0] = static_cast<float>(4.0 * slot * (parts - 1));
  return ffi::Error::Success();
}

ffi::Error AllreduceDenseImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                              ffi::Token, ffi::ResultBuffer<ffi::S32> indices, ffi::ResultBuffer<ffi::F32> values,
                              ffi::Result<ffi::Token>, int64_t comm_handle) {
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  int64_t n = static_cast<int64_t>(values->element_count()), count = nnz.typed_data()[0];
  float* out = values->typed_data();
  AdviseHugePages(values);
  AdviseHugePages(indices);
  if (count == n) {
    std::memcpy(out, val.typed_data(), n * sizeof(float));
  } else {  // the summary step validated the stream: sorted indices in [0, n)
    std::memset(out, 0, n * sizeof(float));
    const int32_t* in_idx = idx.typed_data();
    const float* in_val = val.typed_data();
    for (int64_t j = 0; j < count; ++j) out[in_idx[j]] = in_val[j];
  }
  MPI_Allreduce(MPI_IN_PLACE, out, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm);
  Iota(indices);
  return ffi::Error::Success();
}

}  // namespace

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiReduceScatterDense(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiReduceScatterDense, ReduceScatterDenseImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::F32>>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n")
                                  .Attr<double>("delta"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiAllgatherDense(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiAllgatherDense, AllgatherDenseImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::F32>>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiAllreduceDense(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiAllreduceDense, AllreduceDenseImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm"));
