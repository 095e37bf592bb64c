#include "mpi_program.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "merge.h"
#include "partition.h"
#include "qsgd.h"
#include "topk.h"

namespace sparcml {

namespace {

struct Buffers {
  Scratch<int32_t> idx;
  Scratch<float> val;
};

int64_t PartStart(int64_t n, int parts, int r) { return sparcml_part_start(n, parts, r); }

// A stream's pairs [begin, end) re-based by `offset`, or its dense slice, as one range travels:
// a dense slice once that is no larger than the pairs (SparCML's rule, on the actual count).
struct Range {
  Header header;
  const int32_t* idx = nullptr;
  const float* val = nullptr;
  std::shared_ptr<Buffers> storage;
};

// QSGD on a phase's dense slices (bits 0: none).
struct Coding {
  int bits = 0;
  int64_t bucket = 0;
  int scale_kind = 0;
};

// The split phase codes the segment for range q under this salt of the rank's key (the allgather
// phase under the key itself), so that no two codings of one call share their random draws.
uint32_t SegmentSalt(int q) { return 0x9E3779B9u * static_cast<uint32_t>(q + 1); }

class Interpreter {
 public:
  Interpreter(const ProgramArgs& args, Call& call, Output output) : args_(args), call_(call), output_(output) {}

  void Run(const int64_t* code, int64_t count) {
    for (int64_t pc = 0; pc < count; ++pc) {
      const int64_t* w = code + pc * kWords;
      if (w[0] == kChoose) {
        pc += Choose(w, code + (pc + 1) * kWords);
        continue;
      }
      Execute(w, pc + 1 < count ? w + kWords : nullptr);
    }
  }

  Stream& Reg(int64_t i) {
    if (i >= static_cast<int64_t>(regs_.size())) regs_.resize(i + 1);
    return regs_[i];
  }

  // On a bfloat16 wire a rank keeps what it sends as its peers receive it, so that every rank
  // goes on with the same values (and ends with the same result).
  void AsOnTheWire(int64_t reg) {
    Stream& s = Reg(reg);
    int64_t count = s.dense ? s.n : s.nnz;
    if (!call_.half() || count == 0 || call_.failed() || s.as_sent) return;
    struct Rounded {
      std::shared_ptr<void> base;  // keeps the indices alive
      Scratch<float> val;
    };
    auto rounded = std::make_shared<Rounded>();
    rounded->base = s.storage;
    rounded->val.assign(s.val, s.val + count);
    RoundToBf16(rounded->val.data(), count);
    s.val = rounded->val.data();
    s.storage = rounded;
    s.as_sent = true;
  }

  int32_t algorithm = -1;
  int32_t dense_round = -1;

 private:
  // Returns how many instruction rows the choice and its branches take after its own.
  int64_t Choose(const int64_t* w, const int64_t* rows) {
    int64_t choices = w[3], skip = choices, picked = -1, start = 0;
    for (int64_t i = 0; i < choices; ++i) {  // the first choice whose bound covers the largest count
      const int64_t* row = rows + i * kWords;
      if (picked < 0 && (row[0] >= call_.nnz_max() || i == choices - 1)) {
        picked = i;
        start = skip;
        algorithm = static_cast<int32_t>(row[1]);
      }
      skip += row[2];
    }
    const int64_t* chosen = rows + picked * kWords;
    // The branch ends by moving its result into the program's: what it stores there is written
    // straight into the caller's buffers instead of a scratch register copied out at the end.
    const int64_t* last = rows + (start + chosen[2] - 1) * kWords;
    if (chosen[2] > 0 && last[0] == kMove && last[1] == args_.result_register) result_alias_ = last[3];
    Run(rows + start * kWords, chosen[2]);
    return skip;
  }

  void Execute(const int64_t* w, const int64_t* next) {
    int64_t dst = w[1], cap = w[2];
    switch (w[0]) {
      case kExchange: Exchange(dst, cap, w[3], w[4], static_cast<int>(w[5]), static_cast<int>(w[6]), w[7]); break;
      case kReduceScatter: {
        // DSAR: when the next step gathers this rank's dense slice into the result, the slice is
        // summed in its place there (the allgather then sends it from where it lies).
        bool in_place = next && next[0] == kAllgather && next[3] == dst && next[4] != kPairs &&
                        (next[1] == args_.result_register || next[1] == result_alias_);
        ReduceScatter(dst, cap, w[3], (w[4] & 1) != 0, in_place,
                      Coding{static_cast<int>(w[5]), w[6], static_cast<int>(w[7])}, (w[4] >> 1) - 1);
        break;
      }
      case kAllgather:
        if (w[4] == kPairs || w[4] == kSelectedPairs || w[4] == kRegionPairs) {
          AllgatherPairs(dst, cap, w[3], w[4] != kPairs, w[4] == kRegionPairs, w[5]);
        } else {
          AllgatherDense(dst, w[3], w[4] == kQuantized ? static_cast<int>(w[5]) : 0, w[6], static_cast<int>(w[7]));
        }
        break;
      case kAllreduce: Allreduce(dst, w[3]); break;
      case kSplit:
        if (w[4] > 0) {
          SplitRegions(dst, Reg(w[3]), cap, w[4] - 1);
        } else {
          Split(dst, Reg(w[3]), cap, w[5]);
        }
        break;
      case kConcat: Concat(dst, cap, w[3], w[4]); break;
      case kGather: Gather(dst, cap, w[3], w[4]); break;
      case kAgree: call_.Agree(Reg(w[3]).nnz); break;
      case kMove: {
        Stream s = Reg(w[3]);
        s.capacity = cap;
        Reg(dst) = s;
        break;
      }
      case kFree: Reg(w[3]) = Empty(Reg(w[3]).n, 0); break;
      case kSelect: Select(dst, cap, w[3], w[4], w[5]); break;
      case kAddLocal: {
        Stream a = Reg(w[3]), b = Reg(w[4]);
        Reg(dst) = Add(a, b, cap, dst);
        break;
      }
      case kResidual: Residual(dst, w[3], w[4], w[5]); break;
      case kNonzeros: Nonzeros(dst, cap, w[3], w[4]); break;
      case kWire: call_.SetHalf(w[3] == 16); break;
      default: throw std::runtime_error("unknown instruction " + std::to_string(w[0]));
    }
  }

  // --- storage: the result register goes straight into the caller's output buffers.
  struct Writable {
    int32_t* idx;
    float* val;
  };

  Writable Allocate(Stream& s, int64_t reg, int64_t n, int64_t pairs, bool dense) {
    s.n = n;
    s.dense = dense;
    int64_t slots = dense ? n : pairs;
    bool result = reg >= 0 && (reg == args_.result_register || reg == result_alias_);
    if (result && output_.val && slots <= (dense ? output_.capacity : output_.index_capacity)) {
      s.storage.reset();
      s.idx = dense ? nullptr : output_.idx;
      s.val = output_.val;
      return {output_.idx, output_.val};
    }
    auto b = std::make_shared<Buffers>();
    if (!dense) b->idx.resize(std::max<int64_t>(slots, 1));
    b->val.resize(std::max<int64_t>(slots, 1));
    s.idx = dense ? nullptr : b->idx.data();
    s.val = b->val.data();
    Writable out{dense ? nullptr : b->idx.data(), b->val.data()};
    s.storage = std::move(b);
    return out;
  }

  Stream Empty(int64_t n, int64_t cap) const {
    Stream s;
    s.n = n;
    s.capacity = cap;
    return s;
  }

  void AfterRound(int64_t dst, bool took_part) {
    if (took_part && dense_round < 0 && Reg(dst).dense) dense_round = round_;
    ++round_;
  }

  void Fail(const char* err) {
    if (error_.empty()) error_ = err;
    call_.Fail(kBadInput, call_.rank());
  }

  // a + b, dense once the count reaches the threshold and `cap` can hold n (SparCML's switch),
  // unless `may_densify` is false.
  Stream Add(const Stream& a, const Stream& b, int64_t cap, int64_t reg, bool may_densify = true) {
    int64_t n = a.n;
    if (call_.failed()) return Empty(n, cap);
    Stream out;
    out.capacity = cap;
    if (a.dense || b.dense) {
      Writable w = Allocate(out, reg, n, 0, true);
      const Stream& d = a.dense ? a : b;
      const Stream& o = a.dense ? b : a;
      if (o.dense) {
        for (int64_t i = 0; i < n; ++i) w.val[i] = d.val[i] + o.val[i];
      } else {
        std::memcpy(w.val, d.val, n * sizeof(float));
        for (int64_t j = 0; j < o.nnz; ++j) w.val[o.idx[j]] += o.val[j];
      }
      out.nnz = n;
      return out;
    }
    if (b.nnz == 0 || a.nnz == 0) {
      const Stream& only = a.nnz == 0 ? b : a;
      out = only;
      out.capacity = cap;
      return may_densify ? Densified(out, reg) : out;
    }
    int64_t bound = a.nnz + b.nnz, threshold = DenseThreshold(n, args_.delta);
    bool may_dense = may_densify && cap >= n && bound >= threshold;
    int64_t room = may_dense ? n : std::min(bound, cap);
    Writable w = Allocate(out, reg, n, room, false);
    char err[SPARCML_ERRLEN] = {0};
    int64_t count = 0;
    if (sparcml_merge(a.idx, a.val, a.nnz, a.nnz, b.idx, b.val, b.nnz, b.nnz, n,
                      may_dense ? threshold : std::numeric_limits<int64_t>::max(), w.idx, w.val, room, &count,
                      err)) {
      Fail(err);
      return Empty(n, cap);
    }
    if (count > room) {
      Fail("merge: the sum overflows its static capacity");
      return Empty(n, cap);
    }
    out.nnz = count;
    out.dense = may_dense && count == n;  // densified in place: the indices are 0..n-1
    return out;
  }

  // sparcml_from_dense in the engine: a dense register stays where it lies when its nonzeros
  // reach the threshold, so a dense vector costs one counting pass, and only a sparse one is
  // compacted (into exactly its count of pairs, not a capacity of n).
  void Nonzeros(int64_t dst, int64_t cap, int64_t src, int64_t step) {
    Stream s = Reg(src);
    s.capacity = cap;
    if (!s.dense || call_.failed()) {
      Reg(dst) = s;
      return;
    }
    int64_t threshold = DenseThreshold(s.n, args_.delta);
    int64_t count = step == kCompactCounted ? s.nnz
                                            : sparcml_count_nonzeros(s.val, s.n, cap >= s.n ? threshold : INT64_MAX);
    bool dense = count >= threshold && cap >= s.n;
    if (dense || step == kCountOnly) {  // counted only: a dense register whose nnz is its count
      s.nnz = dense ? s.n : count;
      Reg(dst) = s;
      return;
    }
    if (count > cap) {
      Fail("the vector has more nonzeros than the stream's capacity");
      Reg(dst) = Empty(s.n, cap);
      return;
    }
    Stream out;
    out.capacity = cap;
    Writable w = Allocate(out, dst, s.n, count, false);
    int64_t kept = 0, counted = 0;
    sparcml_from_dense_counted(s.val, s.n, w.idx, w.val, count, &kept, &counted);
    out.nnz = count;
    Reg(dst) = out;
  }

  // A sparse stream that reached the threshold in a capacity that holds n: its dense form.
  Stream Densified(const Stream& s, int64_t reg) {
    if (s.dense || s.capacity < s.n || s.nnz < DenseThreshold(s.n, args_.delta)) return s;
    Stream out;
    out.capacity = s.capacity;
    Writable w = Allocate(out, reg, s.n, 0, true);
    StoreDense(s, w.val);
    out.nnz = s.n;
    return out;
  }

  // The stream that message m from `source` carries (over [0, n)), in register `reg`.
  Stream Received(int source, const Call::Message& m, int64_t n, int64_t cap, int64_t reg) {
    Stream s;
    s.capacity = cap;
    if (call_.failed() || m.h.count == 0) {
      call_.Payload(source, m, nullptr, nullptr);
      return Empty(n, cap);
    }
    Writable w = Allocate(s, reg, n, m.h.count, m.h.dense);
    call_.Payload(source, m, w.idx, w.val);
    s.nnz = m.h.dense ? n : m.h.count;
    return s;
  }

  Header HeaderOf(const Stream& s) const { return call_.Make(s.dense ? s.n : s.nnz, s.dense); }

  // Every other rank, in a ring order from this one (so that ranks start with different peers).
  std::vector<int> Peers() const {
    std::vector<int> out;
    for (int i = 1; i < call_.nprocs(); ++i) out.push_back((call_.rank() - i + call_.nprocs()) % call_.nprocs());
    return out;
  }

  // The ranks of this rank's group in order, for teams of `width` consecutive ranks (0: one team
  // of every rank): its own team, or (`column`) the ranks at its position in every team.
  std::vector<int> Group(int64_t width, bool column) const {
    int p = call_.nprocs(), me = call_.rank();
    int64_t b = width > 0 ? width : p;
    std::vector<int> out;
    if (column) {
      for (int64_t r = me % b; r < p; r += b) out.push_back(static_cast<int>(r));
    } else {
      for (int64_t r = me - me % b; r < me - me % b + b; ++r) out.push_back(static_cast<int>(r));
    }
    return out;
  }

  // The other members of `group`, in a ring order from this rank: `ahead` d = 1, 2, ... places
  // on (whom to send to), else d places back (whom to hear from).
  std::vector<int> RingOf(const std::vector<int>& group, bool ahead) const {
    int g = static_cast<int>(group.size());
    int i = static_cast<int>(std::find(group.begin(), group.end(), call_.rank()) - group.begin());
    std::vector<int> out;
    for (int d = 1; d < g; ++d) out.push_back(group[ahead ? (i + d) % g : (i - d + g) % g]);
    return out;
  }

  // Range [lo, hi) of s, re-based to lo, as it travels (pairs, or a dense slice when no larger).
  Range RangeOf(const Stream& s, int64_t lo, int64_t hi) const {
    Range r;
    int64_t length = hi - lo;
    if (call_.failed()) {
      r.header = call_.Make(0, false);
      return r;
    }
    if (s.dense) {
      r.header = call_.Make(length, true);
      r.val = s.val + lo;
      return r;
    }
    int64_t begin = std::lower_bound(s.idx, s.idx + s.nnz, lo) - s.idx;
    int64_t end = std::lower_bound(s.idx, s.idx + s.nnz, hi) - s.idx;
    int64_t count = end - begin;
    r.storage = std::make_shared<Buffers>();
    if (length > 0 && count >= DenseThreshold(length, args_.delta)) {
      r.storage->val.assign(length, 0.0f);
      for (int64_t j = begin; j < end; ++j) r.storage->val[s.idx[j] - lo] = s.val[j];
      r.header = call_.Make(length, true);
      r.val = r.storage->val.data();
      return r;
    }
    r.storage->idx.resize(count);
    for (int64_t j = begin; j < end; ++j) r.storage->idx[j - begin] = s.idx[j] - static_cast<int32_t>(lo);
    r.header = call_.Make(count, false);
    r.idx = r.storage->idx.data();
    r.val = s.val + begin;
    return r;
  }

  Range PairsOf(const Stream& s) const {
    Range r;
    r.header = call_.Make(call_.failed() ? 0 : s.nnz, false);
    r.idx = s.idx;
    r.val = s.val;
    return r;
  }

  Stream AsStream(const Range& r, int64_t length, int64_t cap) const {
    Stream s;
    s.n = length;
    s.capacity = cap;
    s.dense = r.header.dense;
    s.nnz = r.header.count;
    s.idx = r.idx;
    s.val = r.val;
    s.storage = r.storage;
    return s;
  }

  // --- the operations (comm/native.py documents each).

  void Exchange(int64_t dst, int64_t cap, int64_t send, int64_t into, int dest, int source, int64_t combine) {
    bool hand_over = combine & kHandOver, pairs_only = combine & kPairsOnly;
    combine &= ~(kHandOver | kPairsOnly);
    if (dest >= 0) AsOnTheWire(send);
    Stream kept = hand_over && dest >= 0 ? Empty(Reg(into).n, cap) : Reg(into);
    if (dest >= 0) {
      const Stream& s = Reg(send);
      call_.Send(dest, HeaderOf(s), s.idx, s.val);
    }
    Stream out = kept;
    out.capacity = cap;
    if (source >= 0) {
      Call::Message m = call_.Receive(source);
      if (combine == kReplace) {
        out = Received(source, m, kept.n, cap, dst);
      } else {
        Stream got = Received(source, m, kept.n, m.h.count, -1);
        out = Add(kept, got, cap, dst, !pairs_only);
      }
    }
    call_.WaitSends();
    Reg(dst) = out;
    AfterRound(dst, dest >= 0 || source >= 0);
  }

  // QSGD works through a slice in chunks of about this many values, and between chunks lets MPI
  // move the messages already posted: a large send over TCP flows only while its rank calls
  // into MPI, so coding without these calls leaves the link idle.
  static constexpr int64_t kCodingChunk = int64_t{1} << 16;

  template <class Fn>
  void InChunks(int64_t count, Coding coding, Fn&& fn) {
    char err[SPARCML_ERRLEN] = {0};
    if (sparcml_qsgd_check(count, coding.bits, coding.bucket, -1, err)) {
      Fail(err);
      return;
    }
    int64_t align = sparcml_qsgd_alignment(coding.bucket, coding.bits);
    int64_t step = std::max<int64_t>(1, kCodingChunk / align) * align;
    for (int64_t first = 0; first < count && error_.empty(); first += step) {
      fn(first, std::min(step, count - first));
      call_.Progress();
    }
  }

  // Bytes of the codes of a dense slice of `count` values, as they travel: the float32 bucket
  // scales, then the packed codes.
  static int64_t CodedBytes(int64_t count, Coding coding) {
    return 4 * sparcml_qsgd_num_buckets(count, coding.bucket) + sparcml_qsgd_packed_bytes(count, coding.bits);
  }

  // A dense slice's QSGD codes (CodedBytes).
  Bytes Encode(const float* values, int64_t count, Coding coding, uint32_t salt) {
    int64_t nscales = sparcml_qsgd_num_buckets(count, coding.bucket);
    Bytes out(CodedBytes(count, coding));
    InChunks(count, coding, [&](int64_t first, int64_t c) {
      char err[SPARCML_ERRLEN] = {0};
      if (sparcml_qsgd_quantize_range(values, count, first, c, coding.bits, coding.bucket, coding.scale_kind,
                                      args_.key[0], args_.key[1] ^ salt,
                                      reinterpret_cast<uint8_t*>(out.data() + 4 * nscales),
                                      reinterpret_cast<float*>(out.data()), err)) {
        Fail(err);
      }
    });
    return out;
  }

  // The first `length` values of `codes` (from Encode, of a slice of at least `length` values):
  // decoded into out[0..length), or with `add` added to it.
  void Decode(const Bytes& codes, int64_t coded_length, int64_t length, Coding coding, bool add, float* out) {
    int64_t nscales = sparcml_qsgd_num_buckets(coded_length, coding.bucket);
    const uint8_t* packed = reinterpret_cast<const uint8_t*>(codes.data() + 4 * nscales);
    const float* scales = reinterpret_cast<const float*>(codes.data());
    InChunks(length, coding, [&](int64_t first, int64_t c) {
      char err[SPARCML_ERRLEN] = {0};
      if ((add ? sparcml_qsgd_accumulate_range : sparcml_qsgd_dequantize_range)(packed, scales, length, first, c,
                                                                                coding.bits, coding.bucket, out, err)) {
        Fail(err);
      }
    });
  }

  // Over the whole vector: each coded range's values minus their decoded codes, zeros elsewhere.
  Stream CodingError(const Stream& s, const std::vector<Range>& ranges, const std::vector<SharedBytes>& codes,
                     Coding coding) {
    Stream out;
    out.capacity = s.n;
    Writable w = Allocate(out, -1, s.n, 0, true);
    std::memset(w.val, 0, s.n * sizeof(float));
    int p = call_.nprocs();
    for (int q = 0; q < p && !call_.failed(); ++q) {
      if (!codes[q]) continue;
      int64_t lo = PartStart(s.n, p, q), length = PartStart(s.n, p, q + 1) - lo;
      Decode(*codes[q], length, length, coding, false, w.val + lo);
      for (int64_t i = 0; i < length; ++i) w.val[lo + i] = ranges[q].val[i] - w.val[lo + i];
    }
    out.nnz = s.n;
    return out;
  }

  // The codes of a coded dense slice of `length` values (CodedBytes).
  Bytes ReceivedCodes(int source, const Call::Message& m, int64_t length, Coding coding) {
    Bytes codes(m.h.coded);
    call_.PayloadCoded(source, m, codes.data());
    if (m.h.count != length || m.h.coded != CodedBytes(length, coding)) {
      throw std::runtime_error("a coded segment of the wrong size arrived");
    }
    return codes;
  }

  // The decoded values of `codes` as a dense stream of `length` values.
  Stream Decoded(const Bytes& codes, int64_t length, Coding coding) {
    Stream out;
    out.capacity = length;
    Writable w = Allocate(out, -1, length, 0, true);
    Decode(codes, length, length, coding, false, w.val);
    out.nnz = length;
    return out;
  }

  // With `coding` (DSAR's split phase, quantized), a segment that travels as a dense slice
  // travels as its QSGD codes instead; pairs stay exact, and so does this rank's own segment.
  // Register `error` (>= 0) then gets what the coding lost on this rank: the dense vector of
  // segment - decoded codes over the ranges it sent coded, zeros elsewhere (error feedback).
  void ReduceScatter(int64_t dst, int64_t cap, int64_t src, bool dense_slice, bool in_result, Coding coding,
                     int64_t error) {
    const Stream s = Reg(src);
    int p = call_.nprocs(), me = call_.rank();
    int64_t n = s.n, lo = PartStart(n, p, me), length = PartStart(n, p, me + 1) - lo;
    std::vector<Range> ranges(p);
    std::vector<SharedBytes> codes(p);
    for (int i = 1; i < p; ++i) {  // a ring order: every rank starts with a different peer
      int q = (me + i) % p;
      ranges[q] = RangeOf(s, PartStart(n, p, q), PartStart(n, p, q + 1));
      Header h = ranges[q].header;
      if (coding.bits && h.dense && h.count > 0) {
        codes[q] = std::make_shared<const Bytes>(Encode(ranges[q].val, h.count, coding, SegmentSalt(q)));
        h.coded = static_cast<int32_t>(codes[q]->size());
        call_.SendCoded(q, h, codes[q]);
      } else {
        call_.Send(q, h, ranges[q].idx, ranges[q].val);
      }
    }
    std::vector<Stream> segments(p);
    std::vector<Bytes> received(p);  // coded segments, decoded as they are summed, in rank order
    segments[me] = AsStream(RangeOf(s, lo, lo + length), length, length);
    for (std::vector<int> pending = Peers(); !pending.empty();) {
      int q = 0;
      Call::Message m = call_.ReceiveFirst(&pending, &q);
      if (m.h.coded > 0 && !call_.failed()) {
        received[q] = ReceivedCodes(q, m, length, coding);
        if (!dense_slice) segments[q] = Decoded(received[q], length, coding);
      } else {
        segments[q] = Received(q, m, length, m.h.count, -1);
      }
    }
    if (error >= 0) Reg(error) = CodingError(s, ranges, codes, coding);
    call_.WaitSends();
    call_.MarkAgreed();  // every rank heard from every rank
    Stream out = Empty(length, cap);
    if (!call_.failed() && dense_slice) {
      Writable w{nullptr, nullptr};
      if (in_result && output_.val && output_.capacity >= s.n) {
        out.dense = true;
        out.val = w.val = output_.val + lo;
      } else {
        w = Allocate(out, dst, length, 0, true);
      }
      std::memset(w.val, 0, length * sizeof(float));
      for (int r = 0; r < p; ++r) {  // in rank order
        const Stream& g = segments[r];
        if (!received[r].empty()) {
          Decode(received[r], length, length, coding, true, w.val);
        } else if (g.dense) {
          for (int64_t i = 0; i < length; ++i) w.val[i] += g.val[i];
        } else {
          for (int64_t j = 0; j < g.nnz; ++j) w.val[g.idx[j]] += g.val[j];
        }
      }
      out.nnz = length;
    } else if (!call_.failed()) {
      for (int r = 0; r < p; ++r) out = Add(out, segments[r], cap, r == p - 1 ? dst : -1);  // in rank order
      out.capacity = cap;
    }
    Reg(dst) = out;
    AfterRound(dst, true);
  }

  // Places part r (over [lo, lo + length)) of a concatenation into w: at `offset` as pairs, or
  // into the dense values.
  static void Place(const Stream& part, int64_t lo, bool to_dense, Writable w, int64_t offset) {
    if (to_dense) {
      if (part.dense) {
        if (w.val + lo != part.val) std::memcpy(w.val + lo, part.val, part.n * sizeof(float));
      } else {
        for (int64_t j = 0; j < part.nnz; ++j) w.val[lo + part.idx[j]] = part.val[j];
      }
      return;
    }
    int64_t c = part.dense ? part.n : part.nnz;
    for (int64_t j = 0; j < c; ++j) w.idx[offset + j] = static_cast<int32_t>(lo + (part.dense ? j : part.idx[j]));
    if (c) std::memcpy(w.val + offset, part.val, c * sizeof(float));
  }

  // Parts of run-time regions (`regions`) already carry indices over the whole vector. With
  // teams of `width` ranks, the parts of this rank's team: range q of `width` from position q.
  void AllgatherPairs(int64_t dst, int64_t cap, int64_t src, bool as_pairs, bool regions, int64_t width) {
    AsOnTheWire(src);
    const Stream part = Reg(src);
    int p = call_.nprocs(), me = call_.rank();
    int64_t n = args_.n, parts = width > 0 ? width : p;
    std::vector<int> team = Group(width, false);
    Range own = as_pairs ? PairsOf(part) : RangeOf(part, 0, part.n);  // else the dense slice when no larger
    for (int q : RingOf(team, true)) call_.Send(q, own.header, own.idx, own.val);
    std::vector<Call::Message> messages(p);
    int64_t total = own.header.count;
    for (std::vector<int> pending = RingOf(team, false); !pending.empty();) {
      int q = 0;
      Call::Message m = call_.ReceiveFirst(&pending, &q);
      total += m.h.count;
      messages[q] = std::move(m);
    }
    if (parts == p) call_.MarkAgreed();  // every rank heard from every rank
    Stream out = Empty(n, cap);
    if (call_.failed()) {
      for (int q : RingOf(team, false)) call_.Payload(q, messages[q], nullptr, nullptr);
    } else {
      bool to_dense = total >= DenseThreshold(n, args_.delta) && cap >= n;
      Writable w = Allocate(out, dst, n, total, to_dense);
      if (to_dense) std::memset(w.val, 0, n * sizeof(float));
      int64_t offset = 0;
      for (int64_t position = 0; position < parts; ++position) {
        int r = team[position];
        int64_t lo = regions ? 0 : PartStart(n, parts, position);
        int64_t length = regions ? n : PartStart(n, parts, position + 1) - lo;
        Stream got = r == me ? AsStream(own, length, length) : Stream{};
        if (r != me) {
          const Call::Message& m = messages[r];
          got.n = length;
          got.dense = m.h.dense;
          got.nnz = m.h.count;
          if (!to_dense) {  // the payload lands in place; only the indices are re-based after
            call_.Payload(r, m, w.idx + offset, w.val + offset);
            if (m.h.dense) {
              for (int64_t j = 0; j < m.h.count; ++j) w.idx[offset + j] = static_cast<int32_t>(lo + j);
            } else {
              for (int64_t j = 0; j < m.h.count; ++j) w.idx[offset + j] += static_cast<int32_t>(lo);
            }
            offset += m.h.count;
            continue;
          }
          if (m.h.dense) {
            call_.Payload(r, m, nullptr, w.val + lo);
            continue;
          }
          got = Received(r, m, length, m.h.count, -1);
        }
        Place(got, lo, to_dense, w, offset);
        offset += got.dense ? got.n : got.nnz;
      }
      out.nnz = to_dense ? n : total;
    }
    call_.WaitSends();
    Reg(dst) = out;
    AfterRound(dst, true);
  }

  // The dense allgather phase of DSAR: every rank's dense slice lands in place in the result
  // (MPI_Allgather, or MPI_Allgatherv when N % P != 0), optionally as QSGD codes (SparCML §6).
  void AllgatherDense(int64_t dst, int64_t src, int bits, int64_t bucket, int scale_kind) {
    const Stream part = Reg(src);
    int p = call_.nprocs(), me = call_.rank();
    int64_t n = args_.n;
    if (!call_.agreed()) call_.Agree(part.nnz);
    Stream out = Empty(n, n);
    if (!call_.failed()) {
      std::vector<int> counts(p), displs(p);
      int slot = 0;
      for (int r = 0; r < p; ++r) {
        displs[r] = static_cast<int>(PartStart(n, p, r));
        counts[r] = static_cast<int>(PartStart(n, p, r + 1)) - displs[r];
        slot = std::max(slot, counts[r]);
      }
      Writable w = Allocate(out, dst, n, 0, true);
      if (!part.dense) std::memset(w.val + displs[me], 0, counts[me] * sizeof(float));
      Place(part, displs[me], true, w, 0);
      if (bits) {
        QuantizedAllgather(w.val, counts, displs, slot, bits, bucket, scale_kind);
      } else if (call_.half()) {
        HalfAllgather(w.val, counts, displs, slot);
        out.as_sent = true;
      } else {
        MPI_Request request;
        if (std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; })) {
          // MPICH's MPI_Allgather is about twice as fast as its MPI_Allgatherv here.
          MPI_Iallgather(MPI_IN_PLACE, 0, MPI_FLOAT, w.val, counts[0], MPI_FLOAT, call_.comm(), &request);
        } else {
          MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, w.val, counts.data(), displs.data(), MPI_FLOAT, call_.comm(),
                          &request);
        }
        call_.Await(&request, 1);
        call_.CountSent(4.0 * slot * (p - 1));  // equal slots of the largest range, as the mpi4jax transport sends
      }
      out.nnz = n;
    }
    Reg(dst) = out;
    AfterRound(dst, true);
  }

  // Every rank's slice as bfloat16; the owner keeps its own rounded, as the others receive it.
  void HalfAllgather(float* values, const std::vector<int>& counts, const std::vector<int>& displs, int slot) {
    int p = call_.nprocs(), me = call_.rank();
    int64_t n = displs[p - 1] + counts[p - 1];
    Scratch<uint16_t> halves(std::max<int64_t>(n, 1));
    ToBf16(values + displs[me], counts[me], halves.data() + displs[me]);
    MPI_Request request;
    MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_UINT16_T, halves.data(), counts.data(), displs.data(), MPI_UINT16_T,
                    call_.comm(), &request);
    call_.Await(&request, 1);
    FromBf16(halves.data(), n, values);
    call_.CountSent(2.0 * slot * (p - 1));
  }

  // Every rank QSGD-codes its slice (zero-padded to the slot), the codes travel, and every rank
  // decodes the same bytes, so all ranks hold identical results. A peer's slice is decoded as it
  // arrives, while the others' are still on the wire.
  void QuantizedAllgather(float* values, const std::vector<int>& counts, const std::vector<int>& displs, int slot,
                          int bits, int64_t bucket, int scale_kind) {
    if (slot == 0) return;
    int p = call_.nprocs(), me = call_.rank();
    Coding coding{bits, bucket, scale_kind};
    std::vector<float> padded(slot, 0.0f);
    std::copy(values + displs[me], values + displs[me] + counts[me], padded.begin());
    auto mine = std::make_shared<const Bytes>(Encode(padded.data(), slot, coding, 0));
    for (int i = 1; i < p; ++i) {  // a ring order, as in ReduceScatter; a failed rank sends its flags only
      Header h = call_.Make(slot, true);
      h.coded = static_cast<int32_t>(mine->size());
      call_.SendCoded((me + i) % p, h, mine);
    }
    if (!call_.failed()) Decode(*mine, slot, counts[me], coding, false, values + displs[me]);
    for (std::vector<int> pending = Peers(); !pending.empty();) {
      int q = 0;
      Call::Message m = call_.ReceiveFirst(&pending, &q);
      if (call_.failed()) {
        call_.Payload(q, m, nullptr, nullptr);
      } else {
        Decode(ReceivedCodes(q, m, slot, coding), slot, counts[q], coding, false, values + displs[q]);
      }
    }
    call_.WaitSends();
  }

  void Allreduce(int64_t dst, int64_t src) {
    // MPI cannot sum bfloat16; the dense definition records DSAR's phases on that wire.
    if (call_.half()) throw std::runtime_error("an MPI_Allreduce on a bfloat16 wire");
    const Stream s = Reg(src);
    int p = call_.nprocs();
    int64_t n = s.n;
    if (!call_.agreed()) call_.Agree(s.nnz);  // a collective MPI call: no rank may enter it with other sizes
    Stream out = Empty(n, n);
    if (!call_.failed()) {
      Writable w = Allocate(out, dst, n, 0, true);
      // A dense source is reduced from where it lies (MPI copies it as its algorithm needs); pairs
      // are densified in the result, which is then reduced in place.
      bool from_source = s.dense && p > 1 && s.val != w.val;
      if (!from_source) StoreDense(s, w.val);
      const void* send = from_source ? s.val : MPI_IN_PLACE;
      if (p > 1 && !call_.background()) {
        MPI_Allreduce(send, w.val, static_cast<int>(n), MPI_FLOAT, MPI_SUM, call_.comm());
      } else if (p > 1) {
        MPI_Request request;
        MPI_Iallreduce(send, w.val, static_cast<int>(n), MPI_FLOAT, MPI_SUM, call_.comm(), &request);
        call_.Await(&request, 1);
      }
      // The volume of a reduce-scatter + allgather (Rabenseifner / ring), which MPICH uses for large vectors.
      call_.CountSent(2.0 * (p - 1) / p * 4 * n);
      out.nnz = n;
    }
    Reg(dst) = out;
    AfterRound(dst, true);
  }

  // s cut into `parts` ranges (0: one per rank).
  void Split(int64_t first, const Stream s, int64_t cap, int64_t parts) {
    int p = parts > 0 ? static_cast<int>(parts) : call_.nprocs();
    for (int r = 0; r < p; ++r) {
      int64_t lo = PartStart(s.n, p, r), hi = PartStart(s.n, p, r + 1), length = hi - lo;
      int64_t segment_cap = std::min(cap, length);
      Stream seg = Empty(length, segment_cap);
      if (!call_.failed()) {
        Range range = RangeOf(s, lo, hi);
        seg = AsStream(range, length, segment_cap);
        // The segment may view the source's values: it keeps the source's storage too.
        seg.storage = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(seg.storage, s.storage);
      }
      Reg(first + r) = seg;
    }
  }

  // Ok-Topk's regions: s cut at the run-time starts of regions 1..P-1 (operands first..), each
  // segment keeping its indices over the whole vector (the regions' lengths are not static).
  void SplitRegions(int64_t first, const Stream s, int64_t cap, int64_t operand) {
    int p = call_.nprocs();
    int64_t n = s.n, lo = 0;
    for (int r = 0; r < p; ++r) {
      int64_t hi = r == p - 1 ? n : std::clamp<int64_t>(Operand(operand + r), lo, n);
      Stream seg = Empty(n, std::min(cap, n));
      if (!call_.failed() && s.dense) {
        Writable w = Allocate(seg, first + r, n, hi - lo, false);
        for (int64_t i = lo; i < hi; ++i) w.idx[i - lo] = static_cast<int32_t>(i);
        std::memcpy(w.val, s.val + lo, (hi - lo) * sizeof(float));
        seg.nnz = hi - lo;
      } else if (!call_.failed()) {
        int64_t begin = std::lower_bound(s.idx, s.idx + s.nnz, lo) - s.idx;
        int64_t end = std::lower_bound(s.idx, s.idx + s.nnz, hi) - s.idx;
        seg.idx = s.idx + begin;
        seg.val = s.val + begin;
        seg.nnz = end - begin;
        seg.storage = s.storage;
      }
      seg.capacity = std::min(cap, n);
      Reg(first + r) = seg;
      lo = hi;
    }
  }

  int64_t Operand(int64_t i) const {
    if (i < 0 || i >= static_cast<int64_t>(args_.operands.size()))
      throw std::runtime_error("operand " + std::to_string(i) + " is missing");
    return args_.operands[i];
  }

  float OperandFloat(int64_t i) const {
    uint32_t bits = static_cast<uint32_t>(Operand(i));
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }

  void Concat(int64_t dst, int64_t cap, int64_t first, int64_t parts) {
    int p = parts > 0 ? static_cast<int>(parts) : call_.nprocs();
    int64_t n = args_.n, total = 0;
    for (int r = 0; r < p; ++r) total += Reg(first + r).dense ? Reg(first + r).n : Reg(first + r).nnz;
    Stream out = Empty(n, cap);
    if (!call_.failed()) {
      bool to_dense = total >= DenseThreshold(n, args_.delta) && cap >= n;
      Writable w = Allocate(out, dst, n, total, to_dense);
      if (to_dense) std::memset(w.val, 0, n * sizeof(float));
      int64_t offset = 0;
      for (int r = 0; r < p; ++r) {
        const Stream& seg = Reg(first + r);
        Place(seg, PartStart(n, p, r), to_dense, w, offset);
        offset += seg.dense ? seg.n : seg.nnz;
      }
      out.nnz = to_dense ? n : total;
    }
    Reg(dst) = out;
  }

  // The sum of the streams of this rank's column of teams of `width` (0: of every rank), in rank order.
  void Gather(int64_t dst, int64_t cap, int64_t src, int64_t width) {
    AsOnTheWire(src);
    const Stream s = Reg(src);
    int p = call_.nprocs(), me = call_.rank();
    std::vector<int> column = width > 0 ? Group(width, true) : Group(0, false);  // 0: every rank
    for (int q : RingOf(column, true)) call_.Send(q, HeaderOf(s), s.idx, s.val);
    std::vector<Stream> streams(p);
    streams[me] = s;
    for (std::vector<int> pending = RingOf(column, false); !pending.empty();) {
      int q = 0;
      Call::Message m = call_.ReceiveFirst(&pending, &q);
      streams[q] = Received(q, m, s.n, m.h.count, -1);
    }
    call_.WaitSends();
    if (static_cast<int>(column.size()) == p) call_.MarkAgreed();
    Stream out = streams[column[0]];
    for (size_t i = 1; i < column.size(); ++i)
      out = Add(out, streams[column[i]], cap, i + 1 == column.size() ? dst : -1);
    out.capacity = cap;
    if (call_.failed()) out = Empty(s.n, cap);
    Reg(dst) = out;
    AfterRound(dst, true);
  }

  // The top `cap` entries of a register by magnitude (ties to the lower index), as pairs; the
  // rest stays in its representation: a dense register with those entries zeroed, or the pairs
  // without them. With a threshold (operand `threshold` - 1) only the nonzero entries of at least
  // its magnitude: all of them in one pass when no more than `cap` qualify (else the top `cap`,
  // which then all qualify).
  void Select(int64_t kept_reg, int64_t cap, int64_t src, int64_t rest_reg, int64_t threshold) {
    const Stream s = Reg(src);
    int64_t count = s.dense ? s.n : s.nnz, take = std::min(cap, count);
    Stream kept = Empty(s.n, cap), rest = Empty(s.n, s.capacity);
    if (!call_.failed()) {
      bool scanned = false;
      float least = threshold > 0 ? OperandFloat(threshold - 1) : 0.0f;
      if (threshold > 0) {
        int64_t above = 0;
        for (int64_t i = 0; i < count; ++i) above += s.val[i] != 0.0f && std::fabs(s.val[i]) >= least;
        scanned = above <= cap;
        if (scanned) take = above;
      }
      Scratch<int32_t> position(std::max<int64_t>(take, 1));
      Writable k = Allocate(kept, kept_reg, s.n, take, false);
      char err[SPARCML_ERRLEN] = {0};
      if (scanned) {
        for (int64_t i = 0, j = 0; i < count && j < take; ++i) {
          if (s.val[i] != 0.0f && std::fabs(s.val[i]) >= least) {
            position[j] = static_cast<int32_t>(i);
            k.val[j++] = s.val[i];
          }
        }
      }
      if (!scanned && sparcml_topk(s.val, count, take, position.data(), k.val, err)) {
        Fail(err);
      } else {
        for (int64_t j = 0; j < take; ++j) k.idx[j] = s.dense ? position[j] : s.idx[position[j]];
        kept.nnz = take;
        Writable r = Allocate(rest, rest_reg, s.n, s.dense ? 0 : count - take, s.dense);
        if (s.dense) {
          std::memcpy(r.val, s.val, s.n * sizeof(float));
          for (int64_t j = 0; j < take; ++j) r.val[position[j]] = 0.0f;
          rest.nnz = s.n;
        } else {
          int64_t out = 0;
          for (int64_t i = 0, j = 0; i < count; ++i) {
            if (j < take && position[j] == i) {
              ++j;
              continue;
            }
            r.idx[out] = s.idx[i];
            r.val[out++] = s.val[i];
          }
          rest.nnz = out;
        }
      }
    }
    kept.capacity = cap;
    rest.capacity = s.capacity;
    Reg(kept_reg) = kept;
    Reg(rest_reg) = rest;
  }

  void Residual(int64_t dst, int64_t input, int64_t held_reg, int64_t total_reg) {
    const Stream x = Reg(input), held = Reg(held_reg), total = Reg(total_reg);
    int64_t n = x.n;
    Stream out = Empty(n, n);
    if (!call_.failed()) {
      Writable w = Allocate(out, dst, n, 0, true);
      StoreDense(x, w.val);
      Scratch<float> densified(held.dense ? 1 : std::max<int64_t>(n, 1));  // SparDL's held blocks are dense
      if (!held.dense) StoreDense(held, densified.data());
      const float* kept = held.dense ? held.val : densified.data();
      int64_t count = total.dense ? total.n : total.nnz;
      for (int64_t j = 0; j < count; ++j) {
        int64_t i = total.dense ? j : total.idx[j];
        if (total.val[j] != 0.0f) w.val[i] = kept[i];
      }
      out.nnz = n;
    }
    Reg(dst) = out;
  }

  const ProgramArgs& args_;
  Call& call_;
  Output output_;
  std::vector<Stream> regs_;
  int64_t result_alias_ = -1;  // the chosen branch's result register
  int round_ = 0;

 public:
  std::string error_;
};

}  // namespace

void StoreStream(const Stream& s, const Output& out) {
  int64_t count = s.dense ? s.n : s.nnz;
  if (out.index_capacity == 0) {  // a result dense by construction: its n values, nothing else
    StoreDense(s, out.val);
    return;
  }
  if (s.dense) {
    if (out.val != s.val) std::memcpy(out.val, s.val, s.n * sizeof(float));
    if (out.idx != s.idx)  // (a stream densified in place already holds its indices)
      for (int64_t i = 0; i < s.n; ++i) out.idx[i] = static_cast<int32_t>(i);
  } else if (count > 0) {
    if (out.idx != s.idx) std::memmove(out.idx, s.idx, count * sizeof(int32_t));
    if (out.val != s.val) std::memmove(out.val, s.val, count * sizeof(float));
  }
  sparcml_pad_tail(out.idx, out.val, count, out.capacity, s.n);
}

void StoreDense(const Stream& s, float* out) { sparcml_densify(s.idx, s.val, s.dense ? s.n : s.nnz, s.n, out); }

ProgramResult RunProgram(const ProgramArgs& args, Stream input, const std::string& input_error, Output output) {
  Call call(args.channel, args.tag, args.signature, args.background);
  ProgramResult result;
  if (!input_error.empty()) {
    call.Fail(kBadInput, call.rank());
    input = Stream{};
    input.n = args.n;
  }
  if (!args.rejected.empty()) call.Fail(kRejected, call.rank());
  Interpreter run(args, call, output);
  run.algorithm = args.algorithm;
  run.Reg(0) = input;
  try {
    run.Run(args.code.data(), static_cast<int64_t>(args.code.size()) / kWords);
    // A rank that handed the total on (a non-power of two's unfold) ends with it as sent.
    if (args.result_register >= 0) run.AsOnTheWire(args.result_register);
    call.WaitSends();
  } catch (const Aborted&) {
    call.Abort();
  } catch (const std::exception& e) {  // a malformed program: a bug, reported on this rank
    call.WaitSends();
    result.error = std::string("internal error: ") + e.what();
    return result;
  }
  result.algorithm = run.algorithm;
  result.dense_round = run.dense_round;
  result.sent = call.sent();
  result.nnz_max = call.nnz_max();
  if (call.aborted()) {
    result.error = call.Diagnose();
  } else if (call.failed()) {
    int me = call.rank();
    if (call.flags() & kBadInput) {
      result.error = call.bad_rank() == me ? (input_error.empty() ? run.error_ : input_error)
                                           : "invalid input stream on rank " + std::to_string(call.bad_rank()) +
                                                 " (another rank; see its error)";
    } else {
      result.error = "another rank rejected its arguments (see its error)";
    }
  } else if (args.result_register >= 0) {
    if (args.residual_register >= 0) {
      result.residual = run.Reg(args.residual_register);
      // A branch of a choice that computes no residual (an exact algorithm beside quantized DSAR)
      // leaves it unwritten: nothing to feed back.
      if (result.residual.n == 0) {
        result.residual = Stream{};
        result.residual.n = args.n;
      }
    }
    result.stream = run.Reg(args.result_register);
    int64_t count = result.stream.dense ? result.stream.n : result.stream.nnz;
    if (output.val && count > output.capacity) {
      result.error = "internal error: a result of " + std::to_string(count) + " entries exceeds its capacity " +
                     std::to_string(output.capacity);
    }
  }
  return result;
}

}  // namespace sparcml
