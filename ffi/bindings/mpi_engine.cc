// Progress engine of the non-blocking sparse allreduce (SparCML §7): `start` copies the stream
// into a job and returns its id at once; one background thread per process runs the jobs' whole
// schedules (agreement, sends, receives, merges) in submission order; `wait` blocks until its
// job is done and hands back the result or the job's error.
//
// Why this cannot deadlock (see also sparcml_jax/collectives/nonblocking.py):
//  * The engine talks on its own duplicate of each communicator, so its messages never match a
//    receive of any other op, and it never waits for the main thread.
//  * start and wait are ordered-effect ops, so every rank submits the jobs of a communicator in
//    program order: each engine runs the same sequence of collectives, like blocking calls.
//  * A rank blocked in wait(j) needs only its peers to have *started* jobs <= j. They did so
//    before any later op in program order, including any op the blocked rank's peers wait on.
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "merge.h"
#include "partition.h"
#include "qsgd.h"
#include "mpi_wire.h"

namespace {

using sparcml::Bytes;
using sparcml::DenseThreshold;
using sparcml::Header;
using sparcml::Scratch;
using sparcml::Segment;
using sparcml::Status;

enum Algorithm : int32_t { kDense = 0, kRecursiveDoubling = 1, kSplitAllgather = 2, kDsar = 3 };  // = ALGORITHMS

struct Stream {
  Scratch<int32_t> idx;
  Scratch<float> val;
  int64_t nnz = 0;
  int64_t n = 0;
  bool dense() const { return nnz == n; }
};

struct Job {
  int32_t id = 0;
  MPI_Comm comm = MPI_COMM_NULL;
  int tag_base = 0;
  double delta = 1.0;
  std::vector<int64_t> signature;
  std::vector<std::string> field_names;
  std::vector<int64_t> choice_nnz, choice_algorithm;  // auto: the cost model tabulated over max nnz
  int quantize_bits = 0;                               // QSGD on DSAR's dense allgather (0: none)
  int64_t bucket_size = 1024;
  int scale_kind = SPARCML_QSGD_SCALE_MAX;
  uint32_t key[2] = {0, 0};                            // this rank's key words
  Stream input;
  std::string input_error;  // this rank's stream failed validation

  Stream result;
  int32_t algorithm = -1;
  double sent = 0;
  int32_t dense_round = -1;
  std::string error;
  bool done = false;
};

// --- waiting without monopolising a core: the engine shares it with the computation it hides.
// A short spin, 20 us naps for the first millisecond (small messages), then naps of
// SPARCML_JAX_ENGINE_NAP_US (default 200) so that a long transfer over a slow link leaves the CPU
// to the computation. Measured on 2 cores: 20 us naps throughout hid 0.30 of a 100 Mbit reduction
// where 200 us hid 0.46; 200 us from the start tripled the step of a latency-bound model.
class Backoff {
 public:
  void Pause() {
    if (++polls_ <= kSpinPolls) return;
    auto waited = std::chrono::steady_clock::now() - start_;
    std::this_thread::sleep_for(waited < std::chrono::milliseconds(1) ? kShortNap : LongNap());
  }

 private:
  static constexpr int kSpinPolls = 64;
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

void Await(MPI_Request* requests, int count) {
  for (Backoff backoff;; backoff.Pause()) {
    int done = 0;
    MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
    if (done) return;
  }
}

Bytes Receive(MPI_Comm comm, int source, int tag, int* actual_source) {
  if (source == MPI_PROC_NULL) return {};
  MPI_Message message;
  MPI_Status st;
  for (Backoff backoff;; backoff.Pause()) {
    int found = 0;
    MPI_Improbe(source, tag, comm, &found, &message, &st);
    if (found) break;
  }
  int bytes = 0;
  MPI_Get_count(&st, MPI_BYTE, &bytes);
  Bytes buffer(bytes);
  MPI_Request request;
  MPI_Imrecv(buffer.data(), bytes, MPI_BYTE, &message, &request);
  Await(&request, 1);
  if (actual_source) *actual_source = st.MPI_SOURCE;
  return buffer;
}

Status Incoming(Status local, const Segment& s, std::string* error) {
  if (local != sparcml::kOk) return local;
  if (s.header.status == sparcml::kOk) return sparcml::kOk;
  *error = "a peer rank failed earlier in this collective";
  return sparcml::kPeerFailed;
}

Stream FromSegment(const Segment& s, int64_t n) {
  Stream out;
  out.n = n;
  out.nnz = s.header.count;
  out.idx.resize(out.nnz);
  out.val.resize(out.nnz);
  if (s.header.dense) {
    for (int64_t i = 0; i < n; ++i) out.idx[i] = static_cast<int32_t>(i);
  } else if (out.nnz) {
    std::memcpy(out.idx.data(), s.idx, out.nnz * sizeof(int32_t));
  }
  if (out.nnz) std::memcpy(out.val.data(), s.val, out.nnz * sizeof(float));
  return out;
}

// a + b with SparCML's switch to dense on the actual count (the same kernel as the blocking path).
Stream Merge(const Stream& a, const Stream& b, double delta, Status* status, std::string* error) {
  int64_t n = a.n, threshold = DenseThreshold(n, delta), bound = a.nnz + b.nnz;
  Stream out;
  out.n = n;
  int64_t capacity = bound >= threshold ? std::max(n, int64_t{1}) : std::max(bound, int64_t{1});
  out.idx.resize(capacity);
  out.val.resize(capacity);
  char err[SPARCML_ERRLEN] = {0};
  if (sparcml_merge(a.idx.data(), a.val.data(), a.nnz, a.nnz, b.idx.data(), b.val.data(), b.nnz, b.nnz, n,
                    threshold, out.idx.data(), out.val.data(), capacity, &out.nnz, err)) {
    if (*status == sparcml::kOk) *error = err;
    *status = sparcml::kBadInput;
    out.nnz = 0;
  }
  return out;
}

struct Schedule {
  MPI_Comm comm;
  int rank, nprocs, tag;
  double delta;
  Status status = sparcml::kOk;
  std::string error;
  double sent = 0;
  int32_t dense_round = -1;

  void After(int round, bool dense) {
    if (dense_round < 0 && dense) dense_round = round;
  }

  // Sends s to dest while receiving from source (either may be MPI_PROC_NULL).
  Stream Exchange(const Stream& s, int dest, int source, int round) {
    Bytes message = sparcml::PackSegment(s.idx.data(), s.val.data(), 0, s.nnz, 0, s.n, s.dense(), status, 1e300);
    MPI_Request request;
    MPI_Isend(message.data(), static_cast<int>(message.size()), MPI_BYTE, dest, tag + round, comm, &request);
    Bytes received = Receive(comm, source, tag + round, nullptr);
    Await(&request, 1);
    if (dest != MPI_PROC_NULL) sent += message.size() - sizeof(Header);
    Segment segment = sparcml::UnpackSegment(received);
    status = Incoming(status, segment, &error);
    if (status != sparcml::kOk) segment.header.count = 0;
    return FromSegment(segment, s.n);
  }

  // SSAR_Recursive_double (Algorithm 1); a non-power of two folds into the lower power first.
  Stream RecursiveDoubling(Stream s) {
    int lower = 1;
    while (lower * 2 <= nprocs) lower *= 2;
    int extra = nprocs - lower, round = 0;
    if (extra) {
      if (rank >= lower) Exchange(s, rank - lower, MPI_PROC_NULL, round);
      if (rank < extra) s = Merge(s, Exchange(s, MPI_PROC_NULL, rank + lower, round), delta, &status, &error);
      After(round++, s.dense());
    }
    for (int distance = 1; distance < lower; distance *= 2, ++round) {
      if (rank >= lower) continue;
      s = Merge(s, Exchange(s, rank ^ distance, rank ^ distance, round), delta, &status, &error);
      After(round, s.dense());
    }
    if (extra && rank < extra) {
      Exchange(s, rank + lower, MPI_PROC_NULL, round);
      After(round, s.dense());
    } else if (extra && rank >= lower) {
      s = Exchange(s, MPI_PROC_NULL, rank - lower, round);
      After(round, s.dense());
    }
    return s;
  }

  // The split phase: range r of every stream goes to rank r, which sums them in rank order.
  Stream ReduceScatter(const Stream& s) {
    int tag0 = tag + 30;
    sparcml::RangeMessages posted = sparcml::PostRanges(comm, tag0, s.idx.data(), s.val.data(), s.nnz, s.n, status,
                                                        delta);
    sent += posted.sent;
    std::vector<Bytes> received(nprocs);
    for (int i = 0; i < nprocs - 1; ++i) {
      int source = 0;
      Bytes buffer = Receive(comm, MPI_ANY_SOURCE, tag0, &source);
      received[source] = std::move(buffer);
    }
    received[rank] = std::move(posted.messages[rank]);
    Await(posted.requests.data(), static_cast<int>(posted.requests.size()));

    Stream sum;
    sum.n = sparcml_part_start(s.n, nprocs, rank + 1) - sparcml_part_start(s.n, nprocs, rank);
    for (int r = 0; r < nprocs && status == sparcml::kOk; ++r) {
      Segment segment = sparcml::UnpackSegment(received[r]);
      status = Incoming(status, segment, &error);
      if (status == sparcml::kOk) sum = Merge(sum, FromSegment(segment, sum.n), delta, &status, &error);
    }
    if (status != sparcml::kOk) sum.nnz = 0;
    After(0, sum.dense());
    return sum;
  }

  // Concatenates every rank's part of its own range, dense where the count says so.
  Stream AllgatherParts(const Stream& part, int64_t n) {
    Bytes message = sparcml::PackSegment(part.idx.data(), part.val.data(), 0, part.nnz, 0, part.n, part.dense(),
                                         status, delta);
    std::vector<Segment> segments;
    Bytes all = AllgatherBytes(message, &segments);
    int64_t total = 0;
    for (const Segment& segment : segments) {
      status = Incoming(status, segment, &error);
      total += segment.header.count;
    }
    Stream out;
    out.n = n;
    if (status != sparcml::kOk) return out;
    bool dense = total >= DenseThreshold(n, delta);
    out.idx.resize(dense ? n : total);
    out.val.resize(dense ? n : total);
    if (dense) std::fill(out.val.begin(), out.val.end(), 0.0f);
    for (int r = 0; r < nprocs; ++r) {
      int64_t lo = sparcml_part_start(n, nprocs, r);
      const Segment& segment = segments[r];
      for (int64_t j = 0; j < segment.header.count; ++j) {
        int64_t at = lo + (segment.header.dense ? j : segment.idx[j]);
        if (dense) {
          out.val[at] = segment.val[j];
        } else {
          out.idx[out.nnz] = static_cast<int32_t>(at);
          out.val[out.nnz++] = segment.val[j];
        }
      }
    }
    if (dense) {
      for (int64_t i = 0; i < n; ++i) out.idx[i] = static_cast<int32_t>(i);
      out.nnz = n;
    }
    After(1, out.dense());
    return out;
  }

  Bytes AllgatherBytes(const Bytes& message, std::vector<Segment>* segments) {
    int my_bytes = static_cast<int>(message.size());
    std::vector<int> sizes(nprocs), displs(nprocs + 1, 0);
    MPI_Request request;
    MPI_Iallgather(&my_bytes, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm, &request);
    Await(&request, 1);
    for (int r = 0; r < nprocs; ++r) displs[r + 1] = displs[r] + sizes[r];
    Bytes all(displs[nprocs]);
    MPI_Iallgatherv(message.data(), my_bytes, MPI_BYTE, all.data(), sizes.data(), displs.data(), MPI_BYTE, comm,
                    &request);
    Await(&request, 1);
    sent += static_cast<double>(message.size() - sizeof(Header)) * (nprocs - 1);
    for (int r = 0; r < nprocs; ++r)
      segments->push_back(sparcml::UnpackSegment(all.data() + displs[r], static_cast<size_t>(sizes[r])));
    return all;
  }

  // DSAR_Split_allgather (Algorithm 3): the dense allgather of every rank's summed range.
  Stream DenseAllgather(const Stream& part, int64_t n, const Job& job) {
    std::vector<int> counts(nprocs), displs(nprocs);
    int slot = 0;
    for (int r = 0; r < nprocs; ++r) {
      displs[r] = static_cast<int>(sparcml_part_start(n, nprocs, r));
      counts[r] = static_cast<int>(sparcml_part_start(n, nprocs, r + 1)) - displs[r];
      slot = std::max(slot, counts[r]);
    }
    Stream out;
    out.n = n;
    out.idx.resize(n);
    out.val.resize(n);
    float* mine = out.val.data() + displs[rank];
    std::fill(mine, mine + counts[rank], 0.0f);
    if (part.dense()) {
      std::copy(part.val.begin(), part.val.begin() + part.nnz, mine);
    } else {
      for (int64_t j = 0; j < part.nnz; ++j) mine[part.idx[j]] = part.val[j];
    }
    if (job.quantize_bits) {
      QuantizedAllgather(out.val.data(), counts, displs, slot, job);
    } else {
      MPI_Request request;
      MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, out.val.data(), counts.data(), displs.data(), MPI_FLOAT, comm,
                      &request);
      Await(&request, 1);
      sent += 4.0 * slot * (nprocs - 1);  // as the blocking DSAR reports its equal-slot allgather
    }
    for (int64_t i = 0; i < n; ++i) out.idx[i] = static_cast<int32_t>(i);
    out.nnz = n;
    After(1, true);
    return out;
  }

  // SparCML §6: every rank QSGD-codes its slice (zero-padded to the slot), the codes travel,
  // and every rank decodes the same bytes, exactly as the blocking DSAR does.
  void QuantizedAllgather(float* values, const std::vector<int>& counts, const std::vector<int>& displs, int slot,
                          const Job& job) {
    int bits = job.quantize_bits;
    int64_t nbytes = sparcml_qsgd_packed_bytes(slot, bits), nscales = sparcml_qsgd_num_buckets(slot, job.bucket_size);
    Scratch<float> padded(slot);
    std::fill(padded.begin(), padded.end(), 0.0f);
    std::copy(values + displs[rank], values + displs[rank] + counts[rank], padded.begin());
    Scratch<uint8_t> packed(nbytes * nprocs);
    Scratch<float> scales(nscales * nprocs);
    char err[SPARCML_ERRLEN] = {0};
    if (slot > 0 && sparcml_qsgd_quantize(padded.data(), slot, bits, job.bucket_size, job.scale_kind, job.key[0],
                                          job.key[1], packed.data() + nbytes * rank, scales.data() + nscales * rank,
                                          err)) {
      if (status == sparcml::kOk) error = err;
      status = sparcml::kBadInput;
    }
    MPI_Request requests[2];
    MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, packed.data(), static_cast<int>(nbytes), MPI_BYTE, comm, &requests[0]);
    MPI_Iallgather(MPI_IN_PLACE, 0, MPI_FLOAT, scales.data(), static_cast<int>(nscales), MPI_FLOAT, comm,
                   &requests[1]);
    Await(requests, 2);
    for (int r = 0; r < nprocs; ++r)
      if (counts[r] > 0)
        sparcml_qsgd_dequantize(packed.data() + nbytes * r, scales.data() + nscales * r, counts[r], bits,
                                job.bucket_size, values + displs[r], err);
    sent += static_cast<double>(nbytes + 4 * nscales) * (nprocs - 1);
  }

  Stream DenseAllreduce(const Stream& s) {
    Stream out;
    out.n = s.n;
    out.idx.resize(s.n);
    out.val.assign(s.n, 0.0f);
    for (int64_t j = 0; j < s.nnz; ++j) out.val[s.idx[j]] = s.val[j];
    MPI_Request request;
    MPI_Iallreduce(MPI_IN_PLACE, out.val.data(), static_cast<int>(s.n), MPI_FLOAT, MPI_SUM, comm, &request);
    Await(&request, 1);
    for (int64_t i = 0; i < s.n; ++i) out.idx[i] = static_cast<int32_t>(i);
    out.nnz = s.n;
    sent = 2.0 * (nprocs - 1) / nprocs * 4 * s.n;
    After(0, true);
    return out;
  }
};

// Ranks agree on the call's signature and validate their streams before anything is sent.
// Returns the largest nnz over ranks, or -1 after setting job->error on every rank.
int64_t Agree(Job* job, int rank, int nprocs) {
  std::vector<int64_t> mine = job->signature;
  mine.push_back(job->input_error.empty() ? 0 : 1);
  mine.push_back(job->input.nnz);
  int fields = static_cast<int>(mine.size());
  std::vector<int64_t> all(static_cast<size_t>(fields) * nprocs);
  MPI_Request request;
  MPI_Iallgather(mine.data(), fields, MPI_INT64_T, all.data(), fields, MPI_INT64_T, job->comm, &request);
  Await(&request, 1);
  sparcml::Disagreement d = sparcml::FirstDisagreement(all.data(), fields, fields - 2, nprocs, job->field_names);
  if (d.field == "argument error") {
    job->error = "another rank rejected its arguments to sparse_allreduce_start (see its error); " + d.listing;
    return -1;
  }
  if (!d.field.empty()) {
    job->error = "ranks disagree on " + d.field + " (" + d.listing + "); every rank must pass the same " + d.field +
                 " to sparse_allreduce_start";
    return -1;
  }
  int64_t max_nnz = 0;
  for (int r = 0; r < nprocs; ++r) {
    max_nnz = std::max(max_nnz, all[r * fields + fields - 1]);
    if (all[r * fields + fields - 2] && job->error.empty())
      job->error = r == rank ? job->input_error : "invalid input stream on rank " + std::to_string(r) + " (see its error)";
  }
  return job->error.empty() ? max_nnz : -1;
}

void Run(Job* job) {
  int rank, nprocs;
  MPI_Comm_rank(job->comm, &rank);
  MPI_Comm_size(job->comm, &nprocs);
  int64_t max_nnz = Agree(job, rank, nprocs);
  if (max_nnz < 0) return;
  size_t pick = 0;
  while (pick + 1 < job->choice_nnz.size() && job->choice_nnz[pick] < max_nnz) ++pick;
  job->algorithm = static_cast<int32_t>(job->choice_algorithm[pick]);

  Schedule schedule{job->comm, rank, nprocs, job->tag_base, job->delta};
  int64_t n = job->input.n;
  Stream& s = job->input;
  switch (job->algorithm) {
    case kDense: job->result = schedule.DenseAllreduce(s); break;
    case kRecursiveDoubling: job->result = schedule.RecursiveDoubling(std::move(s)); break;
    case kSplitAllgather: job->result = schedule.AllgatherParts(schedule.ReduceScatter(s), n); break;
    case kDsar: job->result = schedule.DenseAllgather(schedule.ReduceScatter(s), n, *job); break;
    default: job->error = "unknown algorithm code " + std::to_string(job->algorithm); return;
  }
  // Like the blocking path's final check: every rank learns whether any rank failed.
  int local = schedule.status, global = 0;
  MPI_Request request;
  MPI_Iallreduce(&local, &global, 1, MPI_INT, MPI_MAX, job->comm, &request);
  Await(&request, 1);
  if (global != sparcml::kOk)
    job->error = local != sparcml::kOk ? schedule.error : "another rank failed (see its error)";
  job->sent = schedule.sent;
  job->dense_round = schedule.dense_round;
}

class Engine {
 public:
  static Engine& Get() {
    static Engine* engine = new Engine();  // never destroyed: Shutdown() ends the thread at exit
    return *engine;
  }

  // Runs on the calling (XLA) thread, in program order: the first job on a communicator
  // duplicates it here, where every rank makes the same call at the same point.
  int32_t Submit(std::unique_ptr<Job> job, MPI_Comm user_comm) {
    std::unique_lock<std::mutex> lock(mu_);
    auto found = comms_.find(user_comm);
    if (found == comms_.end()) {
      lock.unlock();  // a collective call: the engine thread may need the lock meanwhile
      MPI_Comm dup;
      MPI_Comm_dup(user_comm, &dup);
      lock.lock();
      found = comms_.emplace(user_comm, Channel{dup, 0}).first;
    }
    job->comm = found->second.comm;
    job->tag_base = 64 * (found->second.jobs++ % 512);
    job->id = next_id_++;
    if (next_id_ <= 0) next_id_ = 1;
    int32_t id = job->id;
    queue_.push_back(job.get());
    jobs_[id] = std::move(job);
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    wake_.notify_all();
    return id;
  }

  std::unique_ptr<Job> Wait(int32_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    auto found = jobs_.find(id);
    if (found == jobs_.end()) return nullptr;
    Job* job = found->second.get();
    done_.wait(lock, [job] { return job->done; });
    std::unique_ptr<Job> out = std::move(found->second);
    jobs_.erase(found);
    return out;
  }

  // At interpreter exit: lets queued jobs finish (their peers run them too), then stops the thread.
  bool Shutdown(double timeout_seconds) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!thread_.joinable()) return true;
    stopping_ = true;
    wake_.notify_all();
    bool drained = done_.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
                                  [this] { return queue_.empty() && !running_; });
    lock.unlock();
    if (drained) thread_.join();
    return drained;
  }

 private:
  struct Channel {
    MPI_Comm comm;
    int64_t jobs;
  };

  void Loop() {
    prctl(PR_SET_TIMERSLACK, 1UL);  // naps as asked, not 50 us longer (the default timer slack)
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      Job* job = queue_.front();
      queue_.pop_front();
      running_ = true;
      lock.unlock();
      Run(job);
      lock.lock();
      running_ = false;
      job->done = true;
      done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::deque<Job*> queue_;
  std::map<int32_t, std::unique_ptr<Job>> jobs_;
  std::map<MPI_Comm, Channel> comms_;
  std::thread thread_;
  int32_t next_id_ = 1;
  bool stopping_ = false, running_ = false;
};

ffi::Error StartImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                     ffi::Buffer<ffi::U32> key, ffi::Token, ffi::ResultBufferR0<ffi::S32> job_id,
                     ffi::Result<ffi::Token>, int64_t comm_handle, int64_t n, double delta,
                     ffi::Span<const int64_t> signature, std::string_view fields, ffi::Span<const int64_t> choice_nnz,
                     ffi::Span<const int64_t> choice_algorithm, int64_t quantize_bits, int64_t bucket_size,
                     std::string_view quantize_scale) {
  int thread_level = 0;
  MPI_Query_thread(&thread_level);
  if (thread_level != MPI_THREAD_MULTIPLE)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "sparse_allreduce_start needs MPI initialised with MPI_THREAD_MULTIPLE (mpi4py's default; do not lower "
        "mpi4py.rc.thread_level)");
  auto job = std::make_unique<Job>();
  job->delta = delta;
  job->signature.assign(signature.begin(), signature.end());
  job->field_names = sparcml::SplitFieldNames(fields);
  job->choice_nnz.assign(choice_nnz.begin(), choice_nnz.end());
  job->choice_algorithm.assign(choice_algorithm.begin(), choice_algorithm.end());
  job->quantize_bits = static_cast<int>(quantize_bits);
  job->bucket_size = bucket_size;
  job->scale_kind = quantize_scale == "l2" ? SPARCML_QSGD_SCALE_L2 : SPARCML_QSGD_SCALE_MAX;
  job->key[0] = key.typed_data()[0];
  job->key[1] = key.typed_data()[1];
  int64_t count = nnz.typed_data()[0], capacity = static_cast<int64_t>(idx.element_count());
  char err[SPARCML_ERRLEN] = {0};
  if (sparcml_check_stream("stream", idx.typed_data(), count, capacity, n, err)) {
    job->input_error = std::string("sparse_allreduce_start: ") + err;
    count = 0;
  }
  job->input.n = n;
  job->input.nnz = count;
  job->input.idx.assign(idx.typed_data(), idx.typed_data() + count);
  job->input.val.assign(val.typed_data(), val.typed_data() + count);
  job_id->typed_data()[0] = Engine::Get().Submit(std::move(job), sparcml::CommFromF(comm_handle));
  return ffi::Error::Success();
}

// `after` holds the outputs of the computation to overlap (and the token): operands only so that
// XLA must finish that computation before this op runs.
ffi::Error WaitImpl(ffi::BufferR0<ffi::S32> job_id, ffi::RemainingArgs after, ffi::ResultBuffer<ffi::S32> ridx,
                    ffi::ResultBuffer<ffi::F32> rval, ffi::ResultBufferR0<ffi::S32> rnnz,
                    ffi::ResultBufferR0<ffi::S32> algorithm, ffi::ResultBufferR0<ffi::F32> bytes_sent,
                    ffi::ResultBufferR0<ffi::S32> dense_round, ffi::Result<ffi::Token>) {
  int32_t id = job_id.typed_data()[0];
  std::unique_ptr<Job> job = Engine::Get().Wait(id);
  if (!job)
    return ffi::Error::InvalidArgument("sparse_allreduce_wait: no reduction in flight with handle " +
                                       std::to_string(id) + " (each handle is waited on exactly once)");
  int rank = 0;
  MPI_Comm_rank(job->comm, &rank);
  if (!job->error.empty())
    return ffi::Error(ffi::ErrorCode::kOutOfRange,
                      "non-blocking sparse allreduce failed on rank " + std::to_string(rank) + ": " + job->error);
  const Stream& s = job->result;
  int64_t capacity = static_cast<int64_t>(ridx->element_count());
  if (s.nnz > capacity)
    return ffi::Error::Internal("sparse_allreduce_wait: result of " + std::to_string(s.nnz) +
                                " entries exceeds the capacity " + std::to_string(capacity));
  std::copy(s.idx.begin(), s.idx.begin() + s.nnz, ridx->typed_data());
  std::copy(s.val.begin(), s.val.begin() + s.nnz, rval->typed_data());
  sparcml_pad_tail(ridx->typed_data(), rval->typed_data(), s.nnz, capacity, s.n);
  rnnz->typed_data()[0] = static_cast<int32_t>(s.nnz);
  algorithm->typed_data()[0] = job->algorithm;
  bytes_sent->typed_data()[0] = static_cast<float>(job->sent);
  dense_round->typed_data()[0] = job->dense_round;
  return ffi::Error::Success();
}

}  // namespace

// Called from Python's atexit (before mpi4py finalizes MPI). Returns 1 when the engine drained.
SPARCML_EXPORT int SparcmlEngineShutdown(double timeout_seconds) {
  return Engine::Get().Shutdown(timeout_seconds) ? 1 : 0;
}

SPARCML_EXPORT XLA_FFI_Error* SparcmlEngineStart(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlEngineStart, StartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("n")
                                  .Attr<double>("delta")
                                  .Attr<ffi::Span<const int64_t>>("signature")
                                  .Attr<std::string_view>("fields")
                                  .Attr<ffi::Span<const int64_t>>("choice_nnz")
                                  .Attr<ffi::Span<const int64_t>>("choice_algorithm")
                                  .Attr<int64_t>("quantize_bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<std::string_view>("quantize_scale"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlEngineWait(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlEngineWait, WaitImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::F32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Token>());
