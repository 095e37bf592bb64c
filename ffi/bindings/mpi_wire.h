// The native transport's wire protocol: every message of a collective call starts with a header
// that carries the call's signature hash and error flags, so that agreement and validation ride
// on the algorithm's own messages (no agreement round before a call, no status round after it).
//
//   header {signature, kind, flags, bad rank, count, dense, inline, nnz max/min/sum}
//   then `count` int32 indices + `count` float32 values (pairs), `count` float32 values (a dense
//   slice; with `half`, the values as bfloat16, rounded to nearest even, and widened back to float32
//   on arrival) or `coded` bytes of QSGD codes of a dense slice of `count` values: inside the header's
//   message when small, else as one or two more messages under the same tag, straight from the
//   sender's buffers (MPI keeps messages of one source and tag in order).
//
// A receiver compares the signature hash with its own and ORs the flags into its own; the flags
// travel on in every later message, so an error reaches every rank whose result depends on the
// failing rank. A hash that differs means the ranks may run different schedules: the rank that
// sees it aborts the call (see Call::Abort), which every rank then joins.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sparcml {

// SparCML's rule: pairs cost 8 bytes and dense values 4, so a stream over `size` entries turns
// dense once it holds this many (delta scales the switch point). A huge delta (1e300: "never
// dense") saturates instead of overflowing the conversion.
int64_t DenseThreshold(int64_t size, double delta);

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
using SharedBytes = std::shared_ptr<const Bytes>;

enum Kind : int32_t { kData = 1, kAbort = 2 };
// Error flags, ORed along the schedule.
enum Flag : int32_t { kBadInput = 1, kRejected = 2 };

struct Header {
  uint64_t signature = 0;
  int32_t kind = kData;
  int32_t flags = 0;
  int32_t bad_rank = std::numeric_limits<int32_t>::max();  // lowest rank whose input is invalid
  int32_t count = 0;                                        // pairs, or values of a dense slice
  int32_t dense = 0;
  int32_t inline_payload = 0;
  int32_t coded = 0;  // > 0: the dense slice travels as this many bytes of QSGD codes
  int32_t half = 0;   // the values travel as bfloat16
  int64_t nnz_max = 0, nnz_min = 0, nnz_sum = 0;            // carried by the agreement step
};

inline int64_t PayloadBytes(const Header& h) {
  if (h.coded > 0) return h.coded;
  return int64_t{h.count} * ((h.dense ? 0 : 4) + (h.half ? 2 : 4));
}

// float32 -> bfloat16 bits, rounded to nearest even (as XLA's convert); a NaN stays a NaN.
// Branch-free, so that the loops over whole messages vectorize.
inline uint16_t Bf16Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  uint32_t rounded = (b + 0x7fffU + ((b >> 16) & 1)) >> 16, nan = (b >> 16) | 0x40;
  return static_cast<uint16_t>((b & 0x7fffffffU) > 0x7f800000U ? nan : rounded);
}
inline float FromBf16(uint16_t h) {
  uint32_t b = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
// Rounds values to what they become on a bfloat16 wire.
inline void RoundToBf16(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = FromBf16(Bf16Bits(v[i]));
}
inline void ToBf16(const float* v, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16Bits(v[i]);
}
inline void FromBf16(const uint16_t* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FromBf16(h[i]);
}

inline MPI_Comm CommFromF(int64_t handle) { return MPI_Comm_f2c(static_cast<MPI_Fint>(handle)); }

// The two private duplicates of a user communicator: one for calls that run on the calling
// thread, one for the progress engine's thread, so that their messages never meet. Both are made
// by the first call of either kind on the communicator (a collective call, in program order).
// They are cached as an attribute of the user's communicator, not by its handle: MPI reuses a
// freed communicator's handle, and a later communicator must not inherit its group. Freeing the
// user's communicator drops the attribute; the duplicates are freed once no call holds them.
struct Channels {
  MPI_Comm blocking = MPI_COMM_NULL, engine = MPI_COMM_NULL;
  int64_t blocking_calls = 0, engine_calls = 0;
  Channels() = default;
  Channels(const Channels&) = delete;
  Channels& operator=(const Channels&) = delete;
  ~Channels();
};
std::shared_ptr<Channels> ChannelsOf(MPI_Comm user);

// The static signature of a call, as ranks compare it: named int64 fields (doubles stored bit
// for bit) and their hash, which travels in every header.
struct Signature {
  uint64_t hash = 0;
  std::vector<int64_t> fields;
  std::vector<std::string> names;
};
std::vector<std::string> SplitFieldNames(std::string_view names);

// Raised inside a call once this rank has joined the call's abort; the interpreter unwinds.
struct Aborted {};

// One collective call on a channel: the message protocol, this rank's error state and the
// accounting of what it sent. `background` (the engine's thread) waits by polling with naps, so
// that it leaves the core to the computation it overlaps; the calling thread blocks in MPI.
class Call {
 public:
  Call(MPI_Comm comm, int tag, Signature signature, bool background);
  ~Call();

  int rank() const { return rank_; }
  int nprocs() const { return nprocs_; }
  MPI_Comm comm() const { return comm_; }
  bool failed() const { return flags_ != 0; }
  int32_t flags() const { return flags_; }
  int32_t bad_rank() const { return bad_rank_; }
  double sent() const { return sent_; }
  void CountSent(double bytes) { sent_ += bytes; }
  void Fail(int32_t flag, int32_t bad_rank);

  // A header of this call carrying the error state, for a payload of `count` entries.
  Header Make(int64_t count, bool dense) const;
  // Posts a message to `dest` (payload `idx` (pairs only) and `val`, valid until WaitSends).
  void Send(int dest, Header h, const int32_t* idx, const float* val);
  // Posts a message whose payload is the `h.coded` bytes of `codes`, held until WaitSends (or
  // the end of the call, should it unwind first).
  void SendCoded(int dest, Header h, SharedBytes codes);
  void WaitSends();
  // Lets MPI move the posted sends along without waiting for them (between chunks of work).
  void Progress();
  // The next message from `source`: its header (and its payload when that travels inline).
  // Checks the signature and takes the flags; throws Aborted on an abort notice or a mismatch.
  struct Message {
    Header h;
    Bytes data;
  };
  Message Receive(int source);
  // The first message to arrive from any of `pending` (removed from it; *source names it): a
  // phase that hears from several peers takes them as they come.
  Message ReceiveFirst(std::vector<int>* pending, int* source);
  // The payload of message `m` from `source`, into idx (pairs only; nullptr: dropped) and val
  // (nullptr: dropped). Payloads of one source must be taken in the order of their headers.
  void Payload(int source, const Message& m, int32_t* idx, float* val);
  // The payload of a coded message (`m.h.coded` bytes) into `codes`.
  void PayloadCoded(int source, const Message& m, char* codes);
  // Waits for a nonblocking MPI collective (or any requests).
  void Await(MPI_Request* requests, int count);

  // Every rank learns the flags and the counts of every rank: the agreement step of the calls
  // that need it before a collective MPI call or a choice on the global count.
  void Agree(int64_t nnz);
  int64_t nnz_max() const { return nnz_max_; }
  // Whether every rank already holds every rank's flags (an all-to-all or Agree happened).
  bool agreed() const { return agreed_; }
  bool background() const { return background_; }
  // Whether data messages carry their values as bfloat16 (the program's wire setting).
  bool half() const { return half_; }
  void SetHalf(bool half) { half_ = half; }
  void MarkAgreed() { agreed_ = true; }

  // Joins the call's abort: tells every peer, then receives everything the peers sent in this
  // call up to their own abort notice, so that no message of this call is left over.
  void Abort();
  bool aborted() const { return aborted_; }
  // After an abort: every rank's signature, to name what the ranks disagree on.
  std::string Diagnose();

 private:
  void Post(int dest, Header h, const void* const* pieces, const int64_t* bytes, int count);
  void Read(int source, const Message& m, void* const* pieces, const int64_t* bytes, int count);
  void Drain(int source);
  Message ReceiveRaw(int source);
  Message Take(MPI_Message* message, const MPI_Status& status);
  Message Check(int source, Message m);
  void WatchOthers(const std::vector<int>& awaited);

  MPI_Comm comm_;
  int tag_, rank_, nprocs_;
  Signature signature_;
  bool background_;
  int32_t flags_ = 0, bad_rank_ = std::numeric_limits<int32_t>::max();
  double sent_ = 0;
  bool agreed_ = false, aborted_ = false, half_ = false;
  int64_t nnz_max_ = 0;
  std::vector<char> abort_seen_;
  // Headers taken ahead of their turn (see WatchOthers), and per source the payloads that still
  // follow headers already taken: a source's next message is a header only when none does.
  std::vector<std::deque<Message>> early_;
  std::vector<int> payloads_due_;
  std::vector<MPI_Request> sends_;
  std::vector<std::unique_ptr<Bytes>> send_buffers_;
  std::vector<SharedBytes> held_;
};

}  // namespace sparcml
