// Native MPI transport: variable-length messages carry only the valid entries (SparCML §5).
// Every handler takes and returns an XLA token: Python puts them on mpi4jax's ordered effect,
// so one token chain orders all MPI calls of a program.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "merge.h"
#include "partition.h"
#include "mpi_wire.h"

namespace {

using sparcml::Header;
using sparcml::Segment;
using sparcml::DenseThreshold;
using sparcml::Status;

struct Range {
  int64_t lo, hi;
};
Range PartOf(int64_t n, int parts, int r) { return {sparcml_part_start(n, parts, r), sparcml_part_start(n, parts, r + 1)}; }

// Writes a received segment into a stream buffer of capacity `cap` over a length-`length` range.
void StoreSegment(const Segment& s, int64_t length, int32_t* idx, float* val, int64_t cap, int32_t* nnz,
                  Status* status) {
  int64_t count = s.header.count;
  if (count > cap) {
    sparcml::SetError(status, sparcml::kOverflow,
                      "received " + std::to_string(count) + " entries but the receive capacity is " +
                          std::to_string(cap));
    count = 0;
  } else if (s.header.dense) {
    std::memcpy(val, s.val, count * sizeof(float));
    for (int64_t i = 0; i < count; ++i) idx[i] = static_cast<int32_t>(i);
  } else if (count > 0) {
    std::memcpy(idx, s.idx, count * sizeof(int32_t));
    std::memcpy(val, s.val, count * sizeof(float));
  }
  sparcml_pad_tail(idx, val, count, cap, length);
  *nnz = static_cast<int32_t>(count);
}

// --- exchange: the step of SSAR recursive doubling, and the fold / unfold of non-powers of two.
ffi::Error ExchangeImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                        ffi::BufferR0<ffi::S32> status_in, ffi::Token, ffi::ResultBuffer<ffi::S32> ridx,
                        ffi::ResultBuffer<ffi::F32> rval, ffi::ResultBufferR0<ffi::S32> rnnz,
                        ffi::ResultBufferR0<ffi::S32> status_out, ffi::ResultBufferR0<ffi::F32> bytes_sent,
                        ffi::Result<ffi::Token>, int64_t comm_handle, int64_t dest, int64_t source, int64_t tag,
                        int64_t n) {
  // The header travels first, then the payload straight from the input buffers and into the
  // result buffers, in the same order under the same tag (MPI does not let them overtake).
  // Packing both sides into one message cost two more copies of the stream (exchanges took
  // 7.5 ms of recursive doubling's 18 ms at N = 2^22, 10 %, P = 4).
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  Status status = static_cast<Status>(status_in.typed_data()[0]);
  int64_t count = nnz.typed_data()[0];
  bool dense = count == n;
  Header out{status, status == sparcml::kOk ? static_cast<int32_t>(count) : 0, dense, 0};
  std::vector<MPI_Request> sends;
  sparcml::PostParts(out, idx.typed_data(), val.typed_data(), sparcml::Peer(dest), static_cast<int>(tag), comm,
                     &sends);

  int64_t cap = static_cast<int64_t>(ridx->element_count());
  int32_t* got_idx = ridx->typed_data();
  float* got_val = rval->typed_data();
  Header in = source >= 0 ? sparcml::ReceiveHeader(static_cast<int>(source), static_cast<int>(tag), comm)
                          : Header{sparcml::kOk, 0, 0, 0};
  status = sparcml::Incoming(status, in);
  int64_t received = in.count;
  if (received > cap) {  // drain the payload, then fail on every rank at the final check
    sparcml::SetError(&status, sparcml::kOverflow,
                      "received " + std::to_string(received) + " entries but the receive capacity is " +
                          std::to_string(cap));
    sparcml::Scratch<int32_t> drain_idx(in.dense ? 0 : received);
    sparcml::Scratch<float> drain_val(received);
    sparcml::ReceivePayload(in, drain_idx.data(), drain_val.data(), static_cast<int>(source), static_cast<int>(tag),
                            comm);
    received = 0;
  } else if (received > 0) {
    sparcml::ReceivePayload(in, got_idx, got_val, static_cast<int>(source), static_cast<int>(tag), comm);
    if (in.dense) {
      for (int64_t i = 0; i < received; ++i) got_idx[i] = static_cast<int32_t>(i);
    }
  }
  if (status != sparcml::kOk) received = 0;
  sparcml_pad_tail(got_idx, got_val, received, cap, n);
  rnnz->typed_data()[0] = static_cast<int32_t>(received);
  MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
  status_out->typed_data()[0] = status;
  bytes_sent->typed_data()[0] = dest < 0 ? 0.0f : static_cast<float>(sparcml::PayloadBytes(out));
  return ffi::Error::Success();
}

// --- reduce-scatter: the split phase of SSAR/DSAR_Split_allgather. Rank r sends the pairs of
// range r to rank r and sums what it receives for its own range, in rank order.
ffi::Error ReduceScatterImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                             ffi::BufferR0<ffi::S32> status_in, ffi::Token, ffi::ResultBuffer<ffi::S32> pidx,
                             ffi::ResultBuffer<ffi::F32> pval, ffi::ResultBufferR0<ffi::S32> pnnz,
                             ffi::ResultBufferR0<ffi::S32> status_out, ffi::ResultBufferR0<ffi::F32> bytes_sent,
                             ffi::Result<ffi::Token>, int64_t comm_handle, int64_t tag, int64_t n, double delta) {
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  int parts, me;
  MPI_Comm_size(comm, &parts);
  MPI_Comm_rank(comm, &me);
  Status status = static_cast<Status>(status_in.typed_data()[0]);
  sparcml::RangeMessages posted = sparcml::PostRanges(comm, static_cast<int>(tag), idx.typed_data(), val.typed_data(),
                                                      nnz.typed_data()[0], n, status, delta);
  std::vector<sparcml::Bytes> received = sparcml::ReceiveRanges(comm, static_cast<int>(tag), &posted);
  double sent = posted.sent;

  Range mine = PartOf(n, parts, me);
  int64_t length = mine.hi - mine.lo, threshold = DenseThreshold(length, delta), total = 0;
  for (int r = 0; r < parts; ++r) total += sparcml::UnpackSegment(received[r]).header.count;
  // Room for the union; the whole range only when the sum may turn dense.
  int64_t room = total >= threshold ? length : std::min(total, length);
  sparcml::Scratch<int32_t> acc_idx(room), tmp_idx(room);
  sparcml::Scratch<float> acc_val(room), tmp_val(room);
  int64_t acc_nnz = 0;
  char err[SPARCML_ERRLEN] = {0};
  for (int r = 0; r < parts; ++r) {
    Segment s = sparcml::UnpackSegment(received[r]);
    status = sparcml::Incoming(status, s);
    if (status != sparcml::kOk) break;
    int64_t merged = 0;
    // A dense segment has nnz == length; merge never reads its indices.
    if (sparcml_merge(acc_idx.data(), acc_val.data(), acc_nnz, room, s.idx, s.val, s.header.count,
                      s.header.count, length, threshold, tmp_idx.data(), tmp_val.data(), room, &merged, err)) {
      sparcml::SetError(&status, sparcml::kBadInput, err);
      break;
    }
    std::swap(acc_idx, tmp_idx);
    std::swap(acc_val, tmp_val);
    acc_nnz = merged;
  }
  if (status != sparcml::kOk) acc_nnz = 0;
  Segment result;
  result.header = Header{sparcml::kOk, static_cast<int32_t>(acc_nnz), acc_nnz == length, 0};
  result.idx = acc_idx.data();
  result.val = acc_val.data();
  StoreSegment(result, length, pidx->typed_data(), pval->typed_data(), static_cast<int64_t>(pidx->element_count()),
               pnnz->typed_data(), &status);
  status_out->typed_data()[0] = status;
  bytes_sent->typed_data()[0] = static_cast<float>(sent);
  return ffi::Error::Success();
}

// --- allgather: every rank contributes the stream of its own range; the result concatenates them.
// Every part's header travels first; the payloads follow under the same tag (MPI keeps them in
// order) and land straight in the result where they can: the values of every part, and the
// indices, which are re-based in place. Only a result that turns dense takes a staging buffer.
ffi::Error AllgatherImpl(ffi::Buffer<ffi::S32> pidx, ffi::Buffer<ffi::F32> pval, ffi::BufferR0<ffi::S32> pnnz,
                         ffi::BufferR0<ffi::S32> status_in, ffi::Token, ffi::ResultBuffer<ffi::S32> oidx,
                         ffi::ResultBuffer<ffi::F32> oval, ffi::ResultBufferR0<ffi::S32> onnz,
                         ffi::ResultBufferR0<ffi::S32> status_out, ffi::ResultBufferR0<ffi::F32> bytes_sent,
                         ffi::Result<ffi::Token>, int64_t comm_handle, int64_t tag, int64_t n, double delta) {
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  int parts, me;
  MPI_Comm_size(comm, &parts);
  MPI_Comm_rank(comm, &me);
  Status status = static_cast<Status>(status_in.typed_data()[0]);
  Range mine = PartOf(n, parts, me);
  int64_t length = mine.hi - mine.lo, count = pnnz.typed_data()[0];

  // This rank's part: its pairs, or the dense slice of its range once that is no larger (SparCML's rule).
  std::vector<Header> headers(parts, Header{sparcml::kOk, 0, 0, 0});
  Header& own = headers[me];
  own.status = status;
  const int32_t* own_idx = pidx.typed_data();
  const float* own_val = pval.typed_data();
  sparcml::Bytes slice;
  if (status == sparcml::kOk) {
    bool dense = count == length || (length > 0 && count >= DenseThreshold(length, delta));
    if (dense && count != length) {
      slice = sparcml::PackSegment(own_idx, own_val, 0, count, 0, length, false, status, delta);
      own_val = reinterpret_cast<const float*>(slice.data() + sizeof(Header));
    }
    own.dense = dense;
    own.count = static_cast<int32_t>(dense ? length : count);
  }
  std::vector<MPI_Request> sends;
  for (int r = 0; r < parts; ++r) {
    if (r != me) sparcml::PostParts(own, own_idx, own_val, r, static_cast<int>(tag), comm, &sends);
  }
  for (int i = 1; i < parts; ++i) {
    int source = (me + parts - i) % parts;  // a ring order: every rank starts with a different peer
    headers[source] = sparcml::ReceiveHeader(source, static_cast<int>(tag), comm);
  }
  int64_t total = 0;
  for (int r = 0; r < parts; ++r) {
    status = sparcml::Incoming(status, headers[r]);
    total += headers[r].count;
  }

  int32_t* out_idx = oidx->typed_data();
  float* out_val = oval->typed_data();
  int64_t cap = static_cast<int64_t>(oidx->element_count());
  bool to_dense = status == sparcml::kOk && total >= DenseThreshold(n, delta) && cap >= n;
  if (status == sparcml::kOk && !to_dense && total > cap) {
    sparcml::SetError(&status, sparcml::kOverflow,
                      "allgather: " + std::to_string(total) + " entries exceed the result capacity " +
                          std::to_string(cap));
  }
  bool in_place = status == sparcml::kOk;
  if (to_dense) std::memset(out_val, 0, n * sizeof(float));
  sparcml::Scratch<int32_t> staged_idx;
  sparcml::Scratch<float> staged_val;
  int64_t out_nnz = 0;
  for (int r = 0; r < parts; ++r) {
    const Header& h = headers[r];
    Range range = PartOf(n, parts, r);
    int64_t c = h.count;
    const int32_t* idx = own_idx;
    const float* val = own_val;
    if (r != me && c > 0) {  // where this part's payload lands
      bool straight = in_place && (!to_dense || h.dense);
      int32_t* idx_to = straight && !to_dense ? out_idx + out_nnz : nullptr;
      float* val_to = straight ? (to_dense ? out_val + range.lo : out_val + out_nnz) : nullptr;
      if (!idx_to && !h.dense) {
        staged_idx.resize(c);
        idx_to = staged_idx.data();
      }
      if (!val_to) {
        staged_val.resize(c);
        val_to = staged_val.data();
      }
      sparcml::ReceivePayload(h, idx_to, val_to, r, static_cast<int>(tag), comm);
      idx = idx_to;
      val = val_to;
    }
    if (!in_place || c == 0) continue;
    if (to_dense) {
      if (h.dense && r != me) continue;  // received in place
      if (h.dense) {
        std::memcpy(out_val + range.lo, val, c * sizeof(float));
      } else {
        for (int64_t j = 0; j < c; ++j) out_val[range.lo + idx[j]] = val[j];
      }
      continue;
    }
    int32_t* oi = out_idx + out_nnz;
    if (h.dense) {
      for (int64_t j = 0; j < c; ++j) oi[j] = static_cast<int32_t>(range.lo + j);
    } else if (r != me) {
      for (int64_t j = 0; j < c; ++j) oi[j] += static_cast<int32_t>(range.lo);
    } else {
      for (int64_t j = 0; j < c; ++j) oi[j] = static_cast<int32_t>(range.lo + idx[j]);
    }
    if (r == me) std::memcpy(out_val + out_nnz, val, c * sizeof(float));
    out_nnz += c;
  }
  if (to_dense) {
    for (int64_t i = 0; i < n; ++i) out_idx[i] = static_cast<int32_t>(i);
    out_nnz = n;
  }
  if (status != sparcml::kOk) out_nnz = 0;
  sparcml_pad_tail(out_idx, out_val, out_nnz, cap, n);
  MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
  onnz->typed_data()[0] = static_cast<int32_t>(out_nnz);
  status_out->typed_data()[0] = status;
  bytes_sent->typed_data()[0] = static_cast<float>(sparcml::PayloadBytes(own)) * (parts - 1);
  return ffi::Error::Success();
}

// --- allgather of whole streams (any indices): row r of the result is rank r's stream.
ffi::Error GatherStreamsImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                             ffi::BufferR0<ffi::S32> status_in, ffi::Token, ffi::ResultBuffer<ffi::S32> oidx,
                             ffi::ResultBuffer<ffi::F32> oval, ffi::ResultBuffer<ffi::S32> onnz,
                             ffi::ResultBufferR0<ffi::S32> status_out, ffi::ResultBufferR0<ffi::F32> bytes_sent,
                             ffi::Result<ffi::Token>, int64_t comm_handle, int64_t tag, int64_t n) {
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  int parts;
  MPI_Comm_size(comm, &parts);
  Status status = static_cast<Status>(status_in.typed_data()[0]);
  int64_t count = nnz.typed_data()[0], cap = static_cast<int64_t>(idx.element_count());
  sparcml::Bytes message = sparcml::PackSegment(idx.typed_data(), val.typed_data(), 0, count, 0, n, count == n,
                                                   status, /*delta=*/1e300);
  double sent = static_cast<double>(message.size() - sizeof(Header)) * (parts - 1);
  std::vector<sparcml::Bytes> all = sparcml::AllgatherBytes(comm, static_cast<int>(tag), std::move(message));
  for (int r = 0; r < parts; ++r) {
    Segment s = sparcml::UnpackSegment(all[r]);
    status = sparcml::Incoming(status, s);
    if (status != sparcml::kOk) s.header.count = 0;
    StoreSegment(s, n, oidx->typed_data() + r * cap, oval->typed_data() + r * cap, cap, onnz->typed_data() + r,
                 &status);
  }
  status_out->typed_data()[0] = status;
  bytes_sent->typed_data()[0] = static_cast<float>(sent);
  return ffi::Error::Success();
}

// --- summary: the first MPI call of every collective. Ranks agree on the static signature
// (size, capacity, algorithm, ...), validate their streams and agree on counts before anything
// is sent, so a mismatch or a bad input on one rank makes every rank raise instead of leaving
// peers blocked. A rank that rejected its arguments in Python joins with its error flag set.
ffi::Error SummaryImpl(ffi::Buffer<ffi::S32> idx, ffi::BufferR0<ffi::S32> nnz, ffi::Token,
                       ffi::ResultBuffer<ffi::S32> summary, ffi::Result<ffi::Token>, int64_t comm_handle, int64_t n,
                       ffi::Span<const int64_t> signature, std::string_view field_names) {
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  int parts, rank;
  MPI_Comm_size(comm, &parts);
  MPI_Comm_rank(comm, &rank);
  // One MPI call: every rank's signature, then its stream check and nnz.
  char err[SPARCML_ERRLEN] = {0};
  int64_t count = nnz.typed_data()[0];
  int bad = sparcml_check_stream("stream", idx.typed_data(), count, static_cast<int64_t>(idx.element_count()), n, err);
  int fields = static_cast<int>(signature.size()), row = fields + 2;
  std::vector<int64_t> mine(signature.begin(), signature.end()), all(static_cast<size_t>(row) * parts);
  mine.push_back(bad);
  mine.push_back(bad ? 0 : count);
  MPI_Allgather(mine.data(), row, MPI_INT64_T, all.data(), row, MPI_INT64_T, comm);
  sparcml::Disagreement d =
      sparcml::FirstDisagreement(all.data(), row, fields, parts, sparcml::SplitFieldNames(field_names));
  if (d.field == "argument error") {
    return ffi::Error::InvalidArgument("rank " + std::to_string(rank) +
                                       ": another rank rejected its arguments (see its error); " + d.listing);
  }
  if (!d.field.empty()) {
    return ffi::Error::InvalidArgument("ranks disagree on " + d.field + " (" + d.listing +
                                       "); every rank must pass the same " + d.field);
  }

  int64_t any_bad = 0, max_nnz = 0, min_nnz = INT64_MAX, sum_nnz = 0;
  for (int r = 0; r < parts; ++r) {
    int64_t r_bad = all[r * row + fields], r_nnz = all[r * row + fields + 1];
    any_bad = std::max(any_bad, r_bad);
    max_nnz = std::max(max_nnz, r_nnz);
    min_nnz = std::min(min_nnz, r_nnz);
    sum_nnz += r_nnz;
  }
  if (bad) return ffi::Error::InvalidArgument("rank " + std::to_string(rank) + ": " + err);
  if (any_bad) return ffi::Error::InvalidArgument("invalid input stream on another rank (see that rank's error)");
  int32_t* out = summary->typed_data();
  out[0] = static_cast<int32_t>(max_nnz);
  out[1] = static_cast<int32_t>(min_nnz);
  out[2] = static_cast<int32_t>(std::min<int64_t>(sum_nnz, INT32_MAX));
  return ffi::Error::Success();
}

// --- check: the last step of every collective; all ranks raise when any rank failed.
ffi::Error CheckImpl(ffi::BufferR0<ffi::S32> status_in, ffi::Token, ffi::Result<ffi::Token>, int64_t comm_handle) {
  MPI_Comm comm = sparcml::CommFromF(comm_handle);
  int local = status_in.typed_data()[0], global = 0, rank = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, comm);
  MPI_Comm_rank(comm, &rank);
  if (global == sparcml::kOk) return ffi::Error::Success();
  std::string why = local != sparcml::kOk ? sparcml::LastError() : "another rank failed (see its error)";
  return ffi::Error(ffi::ErrorCode::kOutOfRange, "sparse collective failed on rank " + std::to_string(rank) + ": " + why);
}

}  // namespace

#define STREAM_IN                                                                                \
  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::BufferR0<ffi::S32>>().Arg< \
      ffi::BufferR0<ffi::S32>>().Arg<ffi::Token>()
#define STREAM_OUT                                                                               \
  .Ret<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::BufferR0<ffi::S32>>().Ret< \
      ffi::BufferR0<ffi::S32>>().Ret<ffi::BufferR0<ffi::F32>>().Ret<ffi::Token>()

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiExchange(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiExchange, ExchangeImpl,
                              ffi::Ffi::Bind() STREAM_IN STREAM_OUT.Attr<int64_t>("comm")
                                  .Attr<int64_t>("dest")
                                  .Attr<int64_t>("source")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiReduceScatter(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiReduceScatter, ReduceScatterImpl,
                              ffi::Ffi::Bind() STREAM_IN STREAM_OUT.Attr<int64_t>("comm")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n")
                                  .Attr<double>("delta"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiAllgather(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiAllgather, AllgatherImpl,
                              ffi::Ffi::Bind() STREAM_IN STREAM_OUT.Attr<int64_t>("comm")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n")
                                  .Attr<double>("delta"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiGatherStreams(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiGatherStreams, GatherStreamsImpl,
                              ffi::Ffi::Bind() STREAM_IN.Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::F32>>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("n"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiSummary(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiSummary, SummaryImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("n")
                                  .Attr<ffi::Span<const int64_t>>("signature")
                                  .Attr<std::string_view>("fields"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiCheck(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiCheck, CheckImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm"));
