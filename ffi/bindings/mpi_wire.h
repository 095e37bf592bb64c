// Wire format of the native transport: one message per stream, as in SparCML's own C.
//   header {status, count, dense} then either count int32 indices + count float32 values
//   (pairs) or count float32 values (dense slice). Indices are relative to the receiver's range.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ffi_common.h"

namespace sparcml {

enum Status : int32_t { kOk = 0, kBadInput = 1, kOverflow = 2, kPeerFailed = 3 };

struct Header {
  int32_t status;
  int32_t count;
  int32_t dense;
  int32_t reserved;
};

// The detailed message of the last local failure; reported by the final check on this rank.
std::string& LastError();
void SetError(Status* status, Status code, const std::string& message);

inline MPI_Comm CommFromF(int64_t handle) { return MPI_Comm_f2c(static_cast<MPI_Fint>(handle)); }
inline int Peer(int64_t rank) { return rank < 0 ? MPI_PROC_NULL : static_cast<int>(rank); }

// Packs pairs [begin, end) of a stream, re-based by `offset`, or a dense slice when cheaper.
std::vector<char> PackSegment(const int32_t* idx, const float* val, int64_t begin, int64_t end, int64_t offset,
                              int64_t length, bool source_dense, int32_t status, double delta);

struct Segment {
  Header header{};
  const int32_t* idx = nullptr;  // null for a dense slice
  const float* val = nullptr;
};
Segment UnpackSegment(const std::vector<char>& buffer);

// Receives one message of unknown size from `source` (MPI_PROC_NULL yields an empty segment).
std::vector<char> ReceiveAny(MPI_Comm comm, int source, int tag, int* actual_source);

}  // namespace sparcml
