#include "mpi_wire.h"

#include <algorithm>

#include "partition.h"

namespace sparcml {

std::string& LastError() {
  static std::string message;
  return message;
}

void SetError(Status* status, Status code, const std::string& message) {
  if (*status == kOk) {
    *status = code;
    LastError() = message;
  }
}

Bytes PackSegment(const int32_t* idx, const float* val, int64_t begin, int64_t end, int64_t offset,
                              int64_t length, bool source_dense, int32_t status, double delta) {
  Header h{status, 0, 0, 0};
  if (status != kOk) {
    Bytes out(sizeof(Header));
    std::memcpy(out.data(), &h, sizeof h);
    return out;
  }
  int64_t count = end - begin;
  bool dense = source_dense || (length > 0 && count >= DenseThreshold(length, delta));
  h.dense = dense;
  h.count = static_cast<int32_t>(dense ? length : count);
  size_t payload = dense ? length * sizeof(float) : count * (sizeof(int32_t) + sizeof(float));
  Bytes out(sizeof(Header) + payload);
  std::memcpy(out.data(), &h, sizeof h);
  char* p = out.data() + sizeof(Header);
  if (dense) {
    float* d = reinterpret_cast<float*>(p);
    if (source_dense) {
      std::memcpy(d, val + offset, length * sizeof(float));
    } else {
      std::memset(d, 0, length * sizeof(float));
      for (int64_t j = begin; j < end; ++j) d[idx[j] - offset] = val[j];
    }
  } else {
    int32_t* oi = reinterpret_cast<int32_t*>(p);
    for (int64_t j = begin; j < end; ++j) oi[j - begin] = static_cast<int32_t>(idx[j] - offset);
    std::memcpy(p + count * sizeof(int32_t), val + begin, count * sizeof(float));
  }
  return out;
}

Segment UnpackSegment(const char* data, size_t size) {
  Segment s;
  if (size < sizeof(Header)) {
    s.header.status = kOk;  // MPI_PROC_NULL: nothing arrived
    return s;
  }
  std::memcpy(&s.header, data, sizeof(Header));
  const char* p = data + sizeof(Header);
  if (s.header.dense) {
    s.val = reinterpret_cast<const float*>(p);
  } else {
    s.idx = reinterpret_cast<const int32_t*>(p);
    s.val = reinterpret_cast<const float*>(p + s.header.count * sizeof(int32_t));
  }
  return s;
}

std::vector<std::string> SplitFieldNames(std::string_view names) {
  std::vector<std::string> out;
  for (size_t start = 0; start <= names.size();) {
    size_t comma = std::min(names.find(',', start), names.size());
    out.emplace_back(names.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

std::string RenderField(const std::string& name, int64_t value) {
  if (name == "delta" || name == "alpha" || name == "beta") {
    double d;
    std::memcpy(&d, &value, sizeof d);
    return std::to_string(d);
  }
  return std::to_string(value);
}

Disagreement FirstDisagreement(const int64_t* all, int row, int fields, int parts,
                               const std::vector<std::string>& names) {
  for (int f = 0; f < fields; ++f) {
    bool same = true;
    for (int r = 1; r < parts; ++r) same = same && all[r * row + f] == all[f];
    if (same) continue;
    Disagreement d;
    d.field = f < static_cast<int>(names.size()) ? names[f] : std::to_string(f);
    for (int r = 0; r < parts && r < 8; ++r)
      d.listing += (r ? ", rank " : "rank ") + std::to_string(r) + ": " + RenderField(d.field, all[r * row + f]);
    return d;
  }
  return {};
}

Status Incoming(Status local, const Header& peer) {
  if (local != kOk || peer.status == kOk) return local;
  LastError() = "a peer rank failed earlier in this collective";
  return kPeerFailed;
}

void PostParts(const Header& h, const int32_t* idx, const float* val, int dest, int tag, MPI_Comm comm,
               std::vector<MPI_Request>* sends) {
  auto post = [&](const void* data, int64_t bytes) {
    sends->emplace_back();
    MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, dest, tag, comm, &sends->back());
  };
  post(&h, sizeof h);
  if (h.count > 0 && !h.dense) post(idx, h.count * sizeof(int32_t));
  if (h.count > 0) post(val, h.count * sizeof(float));
}

Header ReceiveHeader(int source, int tag, MPI_Comm comm) {
  Header h{};
  MPI_Recv(&h, sizeof h, MPI_BYTE, source, tag, comm, MPI_STATUS_IGNORE);
  return h;
}

void ReceivePayload(const Header& h, int32_t* idx, float* val, int source, int tag, MPI_Comm comm) {
  if (h.count <= 0) return;
  if (!h.dense) MPI_Recv(idx, h.count * static_cast<int>(sizeof(int32_t)), MPI_BYTE, source, tag, comm,
                         MPI_STATUS_IGNORE);
  MPI_Recv(val, h.count * static_cast<int>(sizeof(float)), MPI_BYTE, source, tag, comm, MPI_STATUS_IGNORE);
}

Bytes ReceiveAny(MPI_Comm comm, int source, int tag, int* actual_source) {
  MPI_Message message;
  MPI_Status st;
  MPI_Mprobe(source, tag, comm, &message, &st);
  int bytes = 0;
  MPI_Get_count(&st, MPI_BYTE, &bytes);
  Bytes buffer(bytes);
  MPI_Mrecv(buffer.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE);
  if (actual_source) *actual_source = st.MPI_SOURCE;
  return buffer;
}

std::vector<Bytes> AllgatherBytes(MPI_Comm comm, int tag, Bytes mine) {
  int parts, me;
  MPI_Comm_size(comm, &parts);
  MPI_Comm_rank(comm, &me);
  std::vector<MPI_Request> requests(parts, MPI_REQUEST_NULL);
  for (int r = 0; r < parts; ++r) {
    if (r != me) MPI_Isend(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, r, tag, comm, &requests[r]);
  }
  std::vector<Bytes> received(parts);
  for (int i = 1; i < parts; ++i) {
    int source = (me + parts - i) % parts;  // a ring order: every rank starts with a different peer
    received[source] = ReceiveAny(comm, source, tag, nullptr);
  }
  MPI_Waitall(parts, requests.data(), MPI_STATUSES_IGNORE);
  received[me] = std::move(mine);
  return received;
}

RangeMessages PostRanges(MPI_Comm comm, int tag, const int32_t* idx, const float* val, int64_t count, int64_t n,
                         int32_t status, double delta) {
  int parts, me;
  MPI_Comm_size(comm, &parts);
  MPI_Comm_rank(comm, &me);
  bool dense = count == n;
  RangeMessages out;
  out.messages.resize(parts);
  for (int r = 0; r < parts; ++r) {
    int64_t lo = sparcml_part_start(n, parts, r), hi = sparcml_part_start(n, parts, r + 1);
    int64_t begin = dense ? lo : std::lower_bound(idx, idx + count, lo) - idx;
    int64_t end = dense ? hi : std::lower_bound(idx, idx + count, hi) - idx;
    out.messages[r] = PackSegment(idx, val, begin, end, lo, hi - lo, dense, status, delta);
    if (r == me) continue;
    out.requests.emplace_back();
    MPI_Isend(out.messages[r].data(), static_cast<int>(out.messages[r].size()), MPI_BYTE, r, tag, comm,
              &out.requests.back());
    out.sent += out.messages[r].size() - sizeof(Header);
  }
  return out;
}

std::vector<Bytes> ReceiveRanges(MPI_Comm comm, int tag, RangeMessages* posted) {
  int parts, me;
  MPI_Comm_size(comm, &parts);
  MPI_Comm_rank(comm, &me);
  std::vector<Bytes> received(parts);
  for (int i = 0; i < parts - 1; ++i) {
    int source = 0;
    Bytes buffer = ReceiveAny(comm, MPI_ANY_SOURCE, tag, &source);
    received[source] = std::move(buffer);
  }
  received[me] = std::move(posted->messages[me]);
  MPI_Waitall(static_cast<int>(posted->requests.size()), posted->requests.data(), MPI_STATUSES_IGNORE);
  return received;
}

}  // namespace sparcml
