// Wire format of the native transport: one message per stream, as in SparCML's own C.
//   header {status, count, dense} then either count int32 indices + count float32 values
//   (pairs) or count float32 values (dense slice). Indices are relative to the receiver's range.
// The blocking exchange and the allgather (mpi_ops.cc) send the same parts as separate messages
// under one tag, straight from and into XLA's buffers.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ffi_common.h"

namespace sparcml {

// SparCML's rule: pairs cost 8 bytes and dense values 4, so a stream over `size` entries turns
// dense once it holds this many (delta scales the switch point). A huge delta (1e300: "never
// dense") saturates instead of overflowing the conversion.
inline int64_t DenseThreshold(int64_t size, double delta) {
  double threshold = std::ceil(delta * size * 4 / 8);
  if (threshold >= static_cast<double>(std::numeric_limits<int64_t>::max())) return std::numeric_limits<int64_t>::max();
  return std::max<int64_t>(1, static_cast<int64_t>(threshold));
}

// A vector that leaves its elements uninitialized: message and scratch buffers are written in
// full before they are read, and zeroing megabytes per call would cost a memory pass each.
template <class T>
struct NoInit : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = NoInit<U>;
  };
  NoInit() = default;
  template <class U>
  NoInit(const NoInit<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <class T>
using Scratch = std::vector<T, NoInit<T>>;
using Bytes = Scratch<char>;

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
Bytes PackSegment(const int32_t* idx, const float* val, int64_t begin, int64_t end, int64_t offset,
                              int64_t length, bool source_dense, int32_t status, double delta);

struct Segment {
  Header header{};
  const int32_t* idx = nullptr;  // null for a dense slice
  const float* val = nullptr;
};
Segment UnpackSegment(const char* data, size_t size);
// This rank's status after receiving a peer's header: an error there turns it into kPeerFailed.
Status Incoming(Status local, const Header& peer);
inline Status Incoming(Status local, const Segment& s) { return Incoming(local, s.header); }
inline int64_t PayloadBytes(const Header& h) { return int64_t{h.count} * (h.dense ? 4 : 8); }

// A stream's parts as separate messages under one tag, which MPI keeps in order: the header, then
// the indices (pairs only) and the values, straight from the caller's buffers (valid until the
// requests appended to `sends` complete).
void PostParts(const Header& h, const int32_t* idx, const float* val, int dest, int tag, MPI_Comm comm,
               std::vector<MPI_Request>* sends);
Header ReceiveHeader(int source, int tag, MPI_Comm comm);
// The payload that follows header `h`, into idx (pairs only) and val.
void ReceivePayload(const Header& h, int32_t* idx, float* val, int source, int tag, MPI_Comm comm);
inline Segment UnpackSegment(const Bytes& buffer) { return UnpackSegment(buffer.data(), buffer.size()); }

// Signatures that ranks compare travel as int64 fields named by a comma-separated list;
// delta, alpha and beta are doubles stored bit for bit.
std::vector<std::string> SplitFieldNames(std::string_view names);
std::string RenderField(const std::string& name, int64_t value);

// The first of the leading `fields` values of every rank's row (rank r's row starts at
// all + r * row) on which the ranks disagree, with every rank's value listed (the first 8);
// an empty `field` means that they all agree.
struct Disagreement {
  std::string field, listing;
};
Disagreement FirstDisagreement(const int64_t* all, int row, int fields, int parts,
                               const std::vector<std::string>& names);

// Receives one message of unknown size from `source` (MPI_PROC_NULL yields an empty segment).
Bytes ReceiveAny(MPI_Comm comm, int source, int tag, int* actual_source);

// Every rank's message, in rank order (mine moved in): posted to every peer at once and received
// per source, so only the valid bytes travel and no size exchange is needed. On 4 ranks sharing
// 2 cores this took a third of MPICH's MPI_Allgatherv (ring) for 1.3 MB messages, with a
// fifth of its worst case; the bytes each rank sends are the same.
std::vector<Bytes> AllgatherBytes(MPI_Comm comm, int tag, Bytes mine);

// The split phase of SSAR/DSAR_Split_allgather: message r holds range r of the stream, re-based
// to the range, as pairs or as a dense slice (SparCML's rule); it is sent to rank r.
struct RangeMessages {
  std::vector<Bytes> messages;       // messages[me] stays here: this rank's own range
  std::vector<MPI_Request> requests;  // the posted sends
  double sent = 0;                    // payload bytes sent (headers excluded)
};
RangeMessages PostRanges(MPI_Comm comm, int tag, const int32_t* idx, const float* val, int64_t count, int64_t n,
                         int32_t status, double delta);

// Every rank's message for this rank's range, in rank order (own one included); completes the sends.
std::vector<Bytes> ReceiveRanges(MPI_Comm comm, int tag, RangeMessages* posted);

}  // namespace sparcml
