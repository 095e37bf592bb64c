#include "mpi_wire.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace sparcml {

namespace {

// Messages up to this size carry their payload inside the header's message: one message instead
// of three for the latency-bound calls; larger payloads go straight from the sender's buffers.
constexpr int64_t kInlineBytes = 32 << 10;
constexpr int kSpinPolls = 64;

// Waiting without monopolising a core on the engine's thread: a short spin, 20 us naps for the
// first millisecond (small messages), then naps of SPARCML_JAX_ENGINE_NAP_US (default 200) so
// that a long transfer over a slow link leaves the CPU to the computation. Measured on 2 cores:
// 20 us naps throughout hid 0.30 of a 100 Mbit reduction where 200 us hid 0.46; 200 us from the
// start tripled the step of a latency-bound model.
class Backoff {
 public:
  void Pause() {
    if (++polls_ <= kSpinPolls) return;
    auto waited = std::chrono::steady_clock::now() - start_;
    std::this_thread::sleep_for(waited < std::chrono::milliseconds(1) ? kShortNap : LongNap());
  }

 private:
  static constexpr std::chrono::microseconds kShortNap{20};
  static std::chrono::microseconds LongNap() {
    static const std::chrono::microseconds nap([] {
      const char* text = std::getenv("SPARCML_JAX_ENGINE_NAP_US");
      return text ? std::max(1, std::atoi(text)) : 200;
    }());
    return nap;
  }
  int polls_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

std::string RenderField(const std::string& name, int64_t value) {
  if (name == "delta" || name == "alpha" || name == "beta") {
    double d;
    std::memcpy(&d, &value, sizeof d);
    return std::to_string(d);
  }
  return std::to_string(value);
}

}  // namespace

int64_t DenseThreshold(int64_t size, double delta) {
  double threshold = std::ceil(delta * size * 4 / 8);
  if (threshold >= static_cast<double>(std::numeric_limits<int64_t>::max())) return std::numeric_limits<int64_t>::max();
  return std::max<int64_t>(1, static_cast<int64_t>(threshold));
}

Channels::~Channels() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (blocking != MPI_COMM_NULL) MPI_Comm_free(&blocking);
  if (engine != MPI_COMM_NULL) MPI_Comm_free(&engine);
}

namespace {

int DropChannels(MPI_Comm, int, void* attribute, void*) {
  delete static_cast<std::shared_ptr<Channels>*>(attribute);
  return MPI_SUCCESS;
}

int ChannelsKeyval() {
  static const int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, DropChannels, &k, nullptr);
    return k;
  }();
  return keyval;
}

}  // namespace

std::shared_ptr<Channels> ChannelsOf(MPI_Comm user) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  void* attribute = nullptr;
  int found = 0;
  MPI_Comm_get_attr(user, ChannelsKeyval(), &attribute, &found);
  if (found) return *static_cast<std::shared_ptr<Channels>*>(attribute);
  auto channels = std::make_shared<Channels>();
  MPI_Comm_dup(user, &channels->blocking);
  MPI_Comm_dup(user, &channels->engine);
  MPI_Comm_set_attr(user, ChannelsKeyval(), new std::shared_ptr<Channels>(channels));
  return channels;
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

Call::Call(MPI_Comm comm, int tag, Signature signature, bool background)
    : comm_(comm), tag_(tag), signature_(std::move(signature)), background_(background) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &nprocs_);
  abort_seen_.assign(nprocs_, 0);
  early_.resize(nprocs_);
  payloads_due_.assign(nprocs_, 0);
}

Call::~Call() {
  if (!sends_.empty()) MPI_Waitall(static_cast<int>(sends_.size()), sends_.data(), MPI_STATUSES_IGNORE);
}

void Call::Fail(int32_t flag, int32_t bad_rank) {
  flags_ |= flag;
  bad_rank_ = std::min(bad_rank_, bad_rank);
}

Header Call::Make(int64_t count, bool dense) const {
  Header h;
  h.signature = signature_.hash;
  h.flags = flags_;
  h.bad_rank = bad_rank_;
  h.count = failed() ? 0 : static_cast<int32_t>(count);
  h.dense = dense;
  return h;
}

void Call::Send(int dest, Header h, const int32_t* idx, const float* val) {
  h.coded = 0;
  h.half = half_ && h.kind == kData;
  const void* pieces[2] = {idx, val};
  int64_t bytes[2] = {h.dense ? 0 : int64_t{h.count} * 4, int64_t{h.count} * (h.half ? 2 : 4)};
  if (h.half && h.count > 0) {  // the bfloat16 values, kept until WaitSends
    auto halves = std::make_unique<Bytes>(bytes[1]);
    uint16_t* out = reinterpret_cast<uint16_t*>(halves->data());
    ToBf16(val, h.count, out);
    pieces[1] = halves->data();
    send_buffers_.push_back(std::move(halves));
  }
  Post(dest, h, pieces, bytes, 2);
}

void Call::SendCoded(int dest, Header h, SharedBytes codes) {
  const void* pieces[1] = {codes->data()};
  held_.push_back(std::move(codes));
  int64_t bytes[1] = {h.coded};
  Post(dest, h, pieces, bytes, 1);
}

// The header's message (with the pieces inline when they are small), else one more message per
// nonempty piece, straight from the sender's buffer.
void Call::Post(int dest, Header h, const void* const* pieces, const int64_t* bytes, int count) {
  int64_t payload = h.count > 0 ? PayloadBytes(h) : 0;
  auto post = [&](const void* data, int64_t size) {
    sends_.emplace_back();
    MPI_Isend(data, static_cast<int>(size), MPI_BYTE, dest, tag_, comm_, &sends_.back());
  };
  h.inline_payload = payload <= kInlineBytes;
  auto message = std::make_unique<Bytes>(sizeof(Header) + (h.inline_payload ? payload : 0));
  std::memcpy(message->data(), &h, sizeof h);
  char* p = message->data() + sizeof(Header);
  for (int i = 0; h.inline_payload && payload > 0 && i < count; ++i) {
    if (bytes[i]) std::memcpy(p, pieces[i], bytes[i]);
    p += bytes[i];
  }
  post(message->data(), static_cast<int64_t>(message->size()));
  send_buffers_.push_back(std::move(message));
  for (int i = 0; !h.inline_payload && i < count; ++i)
    if (bytes[i]) post(pieces[i], bytes[i]);
  if (h.kind == kData) sent_ += static_cast<double>(payload);
}

void Call::WaitSends() {
  Await(sends_.data(), static_cast<int>(sends_.size()));
  sends_.clear();
  send_buffers_.clear();
  held_.clear();
}

void Call::Progress() {
  int done = 0;
  if (!sends_.empty()) MPI_Testall(static_cast<int>(sends_.size()), sends_.data(), &done, MPI_STATUSES_IGNORE);
}

void Call::Await(MPI_Request* requests, int count) {
  if (count == 0) return;
  if (!background_) {
    MPI_Waitall(count, requests, MPI_STATUSES_IGNORE);
    return;
  }
  for (Backoff backoff;; backoff.Pause()) {
    int done = 0;
    MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
    if (done) return;
  }
}

Call::Message Call::Take(MPI_Message* message, const MPI_Status& status) {
  int bytes = 0;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  Message m;
  m.data.resize(bytes);
  MPI_Request request;
  MPI_Imrecv(m.data.data(), bytes, MPI_BYTE, message, &request);
  Await(&request, 1);
  std::memcpy(&m.h, m.data.data(), std::min<size_t>(sizeof m.h, m.data.size()));
  if (m.h.count > 0 && !m.h.inline_payload) ++payloads_due_[status.MPI_SOURCE];
  return m;
}

Call::Message Call::ReceiveRaw(int source) {
  if (!early_[source].empty()) {
    Message m = std::move(early_[source].front());
    early_[source].pop_front();
    return m;
  }
  MPI_Message message;
  MPI_Status st;
  Backoff backoff;
  for (int polls = 1;; ++polls) {
    int found = 0;
    MPI_Improbe(source, tag_, comm_, &found, &message, &st);
    if (found) return Take(&message, st);
    if (polls % kSpinPolls == 0 && !aborted_) WatchOthers({source});  // (a drain takes everything anyway)
    if (background_) {
      backoff.Pause();
    } else if (polls >= kSpinPolls) {
      std::this_thread::yield();  // a peer that shares this core may need it to send
    }
  }
}

// A rank that waits for one peer also looks at the headers the others have sent it: when ranks run
// different schedules, the message that tells them so may come from a peer this rank would only
// hear from later (it may wait for a rank that waits for it). A legitimate header is kept for its
// turn; a header of another signature, or an abort notice, aborts the call here.
void Call::WatchOthers(const std::vector<int>& awaited) {
  for (int q = 0; q < nprocs_; ++q) {
    if (q == rank_ || abort_seen_[q] || payloads_due_[q] || !early_[q].empty() ||
        std::find(awaited.begin(), awaited.end(), q) != awaited.end())
      continue;
    MPI_Message message;
    MPI_Status st;
    int found = 0;
    MPI_Improbe(q, tag_, comm_, &found, &message, &st);
    if (found) early_[q].push_back(Check(q, Take(&message, st)));
  }
}

Call::Message Call::Check(int source, Message m) {
  if (m.h.kind == kAbort) {
    abort_seen_[source] = 1;
    throw Aborted{};
  }
  if (m.h.signature != signature_.hash) {
    Payload(source, m, nullptr, nullptr);
    throw Aborted{};
  }
  Fail(m.h.flags, m.h.bad_rank);
  return m;
}

Call::Message Call::Receive(int source) { return Check(source, ReceiveRaw(source)); }

Call::Message Call::ReceiveFirst(std::vector<int>* pending, int* source) {
  MPI_Message message;
  MPI_Status st;
  Backoff backoff;
  for (size_t i = 0; i < pending->size(); ++i) {
    if (early_[(*pending)[i]].empty()) continue;
    *source = (*pending)[i];
    pending->erase(pending->begin() + static_cast<std::ptrdiff_t>(i));
    return Receive(*source);
  }
  for (int sweeps = 1;; ++sweeps) {
    for (size_t i = 0; i < pending->size(); ++i) {
      int found = 0;
      MPI_Improbe((*pending)[i], tag_, comm_, &found, &message, &st);
      if (!found) continue;
      *source = (*pending)[i];
      pending->erase(pending->begin() + static_cast<std::ptrdiff_t>(i));
      return Check(*source, Take(&message, st));
    }
    if (sweeps % kSpinPolls == 0 && !aborted_) WatchOthers(*pending);
    if (background_) {
      backoff.Pause();
    } else if (sweeps >= kSpinPolls) {
      std::this_thread::yield();  // a peer that shares this core may need it to send
    }
  }
}

void Call::Payload(int source, const Message& m, int32_t* idx, float* val) {
  const Header& h = m.h;
  if (h.coded > 0) {  // (taken here only to be dropped)
    PayloadCoded(source, m, nullptr);
    return;
  }
  void* pieces[2] = {idx, val};
  int64_t bytes[2] = {h.dense ? 0 : int64_t{h.count} * 4, int64_t{h.count} * (h.half ? 2 : 4)};
  Scratch<uint16_t> halves(h.half && val ? std::max<int64_t>(h.count, 0) : 0);
  if (h.half && val) pieces[1] = halves.data();
  Read(source, m, pieces, bytes, 2);
  if (h.half && val) FromBf16(halves.data(), h.count, val);
}

void Call::PayloadCoded(int source, const Message& m, char* codes) {
  void* pieces[1] = {codes};
  int64_t bytes[1] = {m.h.coded};
  Read(source, m, pieces, bytes, 1);
}

// A null piece is received and dropped.
void Call::Read(int source, const Message& m, void* const* pieces, const int64_t* bytes, int count) {
  if (m.h.count <= 0) return;
  if (m.h.inline_payload) {
    const char* p = m.data.data() + sizeof(Header);
    for (int i = 0; i < count; ++i) {
      if (pieces[i] && bytes[i]) std::memcpy(pieces[i], p, bytes[i]);
      p += bytes[i];
    }
    return;
  }
  std::vector<Bytes> dropped(count);
  std::vector<MPI_Request> requests;
  for (int i = 0; i < count; ++i) {
    if (!bytes[i]) continue;
    void* into = pieces[i];
    if (!into) {
      dropped[i].resize(bytes[i]);
      into = dropped[i].data();
    }
    requests.emplace_back();
    MPI_Irecv(into, static_cast<int>(bytes[i]), MPI_BYTE, source, tag_, comm_, &requests.back());
  }
  Await(requests.data(), static_cast<int>(requests.size()));
  --payloads_due_[source];
}

// Recursive doubling of headers (ranks past the largest power of two fold into it first): every
// rank ends with every rank's flags and the largest, smallest and summed count.
void Call::Agree(int64_t nnz) {
  Header mine = Make(0, false);
  mine.nnz_max = mine.nnz_min = mine.nnz_sum = failed() ? 0 : nnz;
  auto combine = [&](const Header& h) {
    mine.flags |= h.flags;
    mine.bad_rank = std::min(mine.bad_rank, h.bad_rank);
    mine.nnz_max = std::max(mine.nnz_max, h.nnz_max);
    mine.nnz_min = std::min(mine.nnz_min, h.nnz_min);
    mine.nnz_sum += h.nnz_sum;
  };
  auto exchange = [&](int dest, int source, bool take) {
    if (dest >= 0) Send(dest, mine, nullptr, nullptr);
    Header h;
    if (source >= 0) h = Receive(source).h;
    WaitSends();
    if (source < 0) return;
    if (take) {
      mine = h;
    } else {
      combine(h);
    }
  };
  int lower = 1;
  while (lower * 2 <= nprocs_) lower *= 2;
  int extra = nprocs_ - lower;
  if (rank_ >= lower) exchange(rank_ - lower, -1, false);
  if (rank_ < extra) exchange(-1, rank_ + lower, false);
  for (int distance = 1; distance < lower; distance *= 2) {
    if (rank_ < lower) exchange(rank_ ^ distance, rank_ ^ distance, false);
  }
  if (rank_ < extra) exchange(rank_ + lower, -1, false);
  if (rank_ >= lower) exchange(-1, rank_ - lower, true);
  Fail(mine.flags, mine.bad_rank);
  nnz_max_ = mine.nnz_max;
  agreed_ = true;
}

void Call::Drain(int source) {
  while (!abort_seen_[source]) {
    Message m = ReceiveRaw(source);
    if (m.h.kind == kAbort) {
      abort_seen_[source] = 1;
    } else {
      Payload(source, m, nullptr, nullptr);
    }
  }
}

// Why every rank joins: a rank aborts when a message of this call has another signature, or is an
// abort notice. Every schedule here posts its sends before it waits, and every rank's result
// depends on every other rank's messages, so a rank that would otherwise finish receives, along
// some chain of messages, either a message of another schedule or a notice from a rank that
// aborted; the notices go to every rank, so every rank that waits is reached.
void Call::Abort() {
  if (aborted_) return;
  aborted_ = true;
  Header notice = Make(0, false);
  notice.kind = kAbort;
  for (int q = 0; q < nprocs_; ++q)
    if (q != rank_) Send(q, notice, nullptr, nullptr);
  for (int q = 0; q < nprocs_; ++q)
    if (q != rank_) Drain(q);
  WaitSends();
}

std::string Call::Diagnose() {
  int fields = static_cast<int>(signature_.fields.size());
  std::vector<int64_t> all(static_cast<size_t>(fields) * nprocs_);
  MPI_Request request;
  MPI_Iallgather(signature_.fields.data(), fields, MPI_INT64_T, all.data(), fields, MPI_INT64_T, comm_, &request);
  Await(&request, 1);
  for (int f = 0; f < fields; ++f) {
    bool same = true;
    for (int r = 1; r < nprocs_; ++r) same = same && all[r * fields + f] == all[f];
    if (same) continue;
    std::string name = f < static_cast<int>(signature_.names.size()) ? signature_.names[f] : std::to_string(f);
    std::string listing;
    for (int r = 0; r < nprocs_ && r < 8; ++r)
      listing += (r ? ", rank " : "rank ") + std::to_string(r) + ": " + RenderField(name, all[r * fields + f]);
    if (name == "argument error") return "another rank rejected its arguments (see its error); " + listing;
    return "ranks disagree on " + name + " (" + listing + "); every rank must pass the same " + name;
  }
  return "ranks called different collectives at the same point of their programs";
}

}  // namespace sparcml
