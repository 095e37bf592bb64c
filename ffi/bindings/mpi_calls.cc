// The native transport's FFI handlers. Each runs one recorded program (mpi_program.h):
//   run:   on the calling thread, writing the result straight into XLA's output buffers;
//   start: copies the stream into a job for the progress engine's thread and returns its id;
//   wait:  blocks until that job is done and hands back its result or its error.
// Every handler takes and returns an XLA token: Python puts them on mpi4jax's ordered effect, so
// one token chain orders all MPI calls of a program.
//
// Why the engine cannot deadlock (see also sparcml_jax/collectives/nonblocking.py):
//  * It talks on its own duplicate of each communicator, so its messages never match a receive
//    of any other op, and it never waits for the main thread.
//  * start and wait are ordered-effect ops, so every rank submits the jobs of a communicator in
//    program order: each engine runs the same sequence of collectives, like blocking calls.
//  * A rank blocked in wait(j) needs only its peers to have *started* jobs <= j. They did so
//    before any later op in program order, including any op the blocked rank's peers wait on.
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ffi_common.h"
#include "mpi_program.h"
#include "partition.h"

namespace {

using sparcml::Length;
using sparcml::ProgramArgs;
using sparcml::ProgramResult;
using sparcml::Stream;

constexpr int kTagSpan = 30000;  // tags 1..kTagSpan: one per call, in turn (MPI_TAG_UB >= 32767)

ProgramArgs MakeArgs(MPI_Comm channel, int64_t seq, bool background, int64_t n, double delta,
                     ffi::Span<const int64_t> program, int64_t result, int64_t algorithm,
                     ffi::Span<const int64_t> signature, int64_t hash, std::string_view fields, int64_t rejected,
                     ffi::Buffer<ffi::U32> key) {
  ProgramArgs a;
  a.channel = channel;
  a.tag = 1 + static_cast<int>(seq % kTagSpan);
  a.background = background;
  a.signature.hash = static_cast<uint64_t>(hash);
  a.signature.fields.assign(signature.begin(), signature.end());
  a.signature.names = sparcml::SplitFieldNames(fields);
  a.code.assign(program.begin(), program.end());
  a.result_register = result;
  a.algorithm = static_cast<int32_t>(algorithm);
  a.n = n;
  a.delta = delta;
  // The key buffer holds QSGD's two key words, then the program's run-time operands (thresholds, bounds).
  const uint32_t* words = key.typed_data();
  a.key[0] = words[0];
  a.key[1] = words[1];
  a.operands.assign(words + 2, words + key.element_count());
  if (rejected) a.rejected = "rejected";
  return a;
}

// The stream of XLA's input buffers, validated: an invalid one fails the call on every rank.
Stream InputStream(const int32_t* idx, const float* val, int64_t nnz, int64_t capacity, int64_t n, int rank,
                   std::string* error) {
  char err[SPARCML_ERRLEN] = {0};
  if (sparcml_check_stream("stream", idx, nnz, capacity, n, err)) *error = "rank " + std::to_string(rank) + ": " + err;
  Stream s;
  s.n = n;
  s.capacity = capacity;
  s.nnz = nnz;
  s.dense = nnz == n;
  s.idx = idx;
  s.val = val;
  return s;
}

// run's value buffers hold float32 or bfloat16. The engine sums in float32: bfloat16 values are
// widened on the way in and the result rounded to nearest even on the way out, so that a bfloat16
// gradient needs no float32 copy in the caller's program.
bool HalfValues(const ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::BF16; }

bool ValueType(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::F32 || b.element_type() == ffi::DataType::BF16;
}
const ffi::Error kValueType = ffi::Error::InvalidArgument("stream values must be float32 or bfloat16");

// The first `count` input values as float32: the buffer itself, or its bfloat16 values widened into `widened`.
const float* InputValues(const ffi::AnyBuffer& val, int64_t count, sparcml::Scratch<float>* widened) {
  if (!HalfValues(val)) return val.typed_data<float>();
  count = std::clamp<int64_t>(count, 0, Length(val));
  widened->resize(count);
  sparcml::FromBf16(val.typed_data<uint16_t>(), count, widened->data());
  return widened->data();
}

// Where the engine writes the result's values: the caller's float32 buffer, or `staged`, which
// StoreValues rounds into the caller's bfloat16 buffer.
float* ResultValues(ffi::Result<ffi::AnyBuffer>& rval, sparcml::Scratch<float>* staged) {
  if (!HalfValues(*rval)) return rval->typed_data<float>();
  staged->resize(Length(*rval));
  return staged->data();
}
// The result's values as the caller takes them: a float32 buffer (the engine wrote it) or the
// staged sum rounded into a bfloat16 one; with a divisor, the mean. It is the sum times the
// float32 reciprocal, as XLA's CPU backend divides by a constant, so that it equals `sum / P` in
// the caller's program, and it is taken before the one rounding to bfloat16, in the same pass.
void StoreValues(float* values, ffi::Result<ffi::AnyBuffer>& rval, double divisor) {
  const float reciprocal = 1.0f / static_cast<float>(divisor);
  const int64_t n = Length(*rval);
  if (!HalfValues(*rval)) {
    if (divisor != 1.0)
      for (int64_t i = 0; i < n; ++i) values[i] *= reciprocal;
    return;
  }
  uint16_t* out = rval->typed_data<uint16_t>();
  if (divisor == 1.0) {
    sparcml::ToBf16(values, n, out);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = sparcml::Bf16Bits(values[i] * reciprocal);
  }
}

int RankOf(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

ffi::Error Failure(const std::string& what, int rank, const std::string& error) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, what + " failed on rank " + std::to_string(rank) + ": " + error);
}

// --- run: the blocking call.
ffi::Error RunImpl(ffi::Buffer<ffi::S32> idx, ffi::AnyBuffer val, ffi::BufferR0<ffi::S32> nnz,
                   ffi::Buffer<ffi::U32> key, ffi::Token, ffi::ResultBuffer<ffi::S32> ridx,
                   ffi::Result<ffi::AnyBuffer> rval, ffi::ResultBufferR0<ffi::S32> rnnz,
                   ffi::ResultBufferR0<ffi::S32> ralgorithm, ffi::ResultBufferR0<ffi::F32> rsent,
                   ffi::ResultBufferR0<ffi::S32> rdense_round, ffi::ResultBuffer<ffi::F32> rresidual,
                   ffi::Result<ffi::Token>, int64_t comm, int64_t n, double delta, ffi::Span<const int64_t> program,
                   int64_t result, int64_t algorithm, ffi::Span<const int64_t> signature, int64_t hash,
                   std::string_view fields, int64_t rejected, int64_t residual, double divisor) {
  if (!ValueType(val) || !ValueType(*rval)) return kValueType;
  std::shared_ptr<sparcml::Channels> channels = sparcml::ChannelsOf(sparcml::CommFromF(comm));
  ProgramArgs args = MakeArgs(channels->blocking, channels->blocking_calls++, false, n, delta, program, result, algorithm,
                              signature, hash, fields, rejected, key);
  args.residual_register = residual;
  int rank = RankOf(channels->blocking);
  std::string input_error;
  int64_t count = nnz.typed_data()[0];
  sparcml::Scratch<float> widened, staged;
  Stream input = InputStream(idx.typed_data(), InputValues(val, count, &widened), count,
                             sparcml::StreamCapacity(idx.element_count(), Length(val), count, n), n, rank,
                             &input_error);
  sparcml::Output out{ridx->typed_data(), ResultValues(rval, &staged), Length(*rval),
                      static_cast<int64_t>(ridx->element_count())};
  ProgramResult r = sparcml::RunProgram(args, input, input_error, out);
  if (!r.error.empty()) return Failure("sparse collective", rank, r.error);
  if (residual >= 0) {
    if (static_cast<int64_t>(rresidual->element_count()) != r.residual.n)
      return Failure("sparse collective", rank, "internal error: the residual's buffer does not match its length");
    sparcml::StoreDense(r.residual, rresidual->typed_data());
  }
  if (result >= 0) {
    sparcml::StoreStream(r.stream, out);
    StoreValues(out.val, rval, divisor);
    rnnz->typed_data()[0] = static_cast<int32_t>(r.stream.dense ? r.stream.n : r.stream.nnz);
  } else {  // an agreement: its result is the largest count
    rnnz->typed_data()[0] = static_cast<int32_t>(r.nnz_max);
  }
  ralgorithm->typed_data()[0] = r.algorithm;
  rsent->typed_data()[0] = static_cast<float>(r.sent);
  rdense_round->typed_data()[0] = r.dense_round;
  return ffi::Error::Success();
}

// --- the progress engine: one background thread per process runs the jobs in submission order.
struct Job {
  int32_t id = 0;
  std::shared_ptr<sparcml::Channels> channels;  // alive until the job is waited on
  ProgramArgs args;
  sparcml::Scratch<int32_t> idx;
  sparcml::Scratch<float> val;
  Stream input;
  std::string input_error;
  ProgramResult result;
  bool done = false;
};

class Engine {
 public:
  static Engine& Get() {
    static Engine* engine = new Engine();  // never destroyed: Shutdown() ends the thread at exit
    return *engine;
  }

  int32_t Submit(std::unique_ptr<Job> job) {
    std::unique_lock<std::mutex> lock(mu_);
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
      job->result = sparcml::RunProgram(job->args, job->input, job->input_error, sparcml::Output{});
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
  std::thread thread_;
  int32_t next_id_ = 1;
  bool stopping_ = false, running_ = false;
};

ffi::Error StartImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> val, ffi::BufferR0<ffi::S32> nnz,
                     ffi::Buffer<ffi::U32> key, ffi::Token, ffi::ResultBufferR0<ffi::S32> job_id,
                     ffi::Result<ffi::Token>, int64_t comm, int64_t n, double delta, ffi::Span<const int64_t> program,
                     int64_t result, int64_t algorithm, ffi::Span<const int64_t> signature, int64_t hash,
                     std::string_view fields, int64_t rejected) {
  int thread_level = 0;
  MPI_Query_thread(&thread_level);
  if (thread_level != MPI_THREAD_MULTIPLE)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "sparse_allreduce_start needs MPI initialised with MPI_THREAD_MULTIPLE (mpi4py's default; do not lower "
        "mpi4py.rc.thread_level)");
  // Runs on the calling (XLA) thread, in program order: the job's tag is taken here.
  auto job = std::make_unique<Job>();
  job->channels = sparcml::ChannelsOf(sparcml::CommFromF(comm));
  job->args = MakeArgs(job->channels->engine, job->channels->engine_calls++, true, n, delta, program, result, algorithm, signature,
                       hash, fields, rejected, key);
  int64_t count = nnz.typed_data()[0];
  int64_t capacity = sparcml::StreamCapacity(idx.element_count(), val.element_count(), count, n);
  job->input = InputStream(idx.typed_data(), val.typed_data(), count, capacity, n, RankOf(job->channels->engine),
                           &job->input_error);
  if (!job->input_error.empty()) count = 0;
  bool dense = count == n;
  // XLA's buffers live only during this call.
  if (!dense) job->idx.assign(idx.typed_data(), idx.typed_data() + count);
  job->val.assign(val.typed_data(), val.typed_data() + count);
  job->input.nnz = count;
  job->input.capacity = count;
  job->input.dense = dense;
  job->input.idx = dense ? nullptr : job->idx.data();
  job->input.val = job->val.data();
  job_id->typed_data()[0] = Engine::Get().Submit(std::move(job));
  return ffi::Error::Success();
}

// `after` holds the outputs of the computation to overlap (and the token): operands only so that
// XLA must finish that computation before this op runs.
ffi::Error WaitImpl(ffi::BufferR0<ffi::S32> job_id, ffi::RemainingArgs after, ffi::ResultBuffer<ffi::S32> ridx,
                    ffi::ResultBuffer<ffi::F32> rval, ffi::ResultBufferR0<ffi::S32> rnnz,
                    ffi::ResultBufferR0<ffi::S32> ralgorithm, ffi::ResultBufferR0<ffi::F32> rsent,
                    ffi::ResultBufferR0<ffi::S32> rdense_round, ffi::Result<ffi::Token>) {
  int32_t id = job_id.typed_data()[0];
  std::unique_ptr<Job> job = Engine::Get().Wait(id);
  if (!job)
    return ffi::Error::InvalidArgument("sparse_allreduce_wait: no reduction in flight with handle " +
                                       std::to_string(id) + " (each handle is waited on exactly once)");
  int rank = RankOf(job->args.channel);
  const ProgramResult& r = job->result;
  if (!r.error.empty()) return Failure("non-blocking sparse allreduce", rank, r.error);
  sparcml::Output out{ridx->typed_data(), rval->typed_data(), static_cast<int64_t>(rval->element_count()),
                      static_cast<int64_t>(ridx->element_count())};
  int64_t count = r.stream.dense ? r.stream.n : r.stream.nnz;
  if (count > out.capacity || (!r.stream.dense && count > out.index_capacity))
    return ffi::Error::Internal("sparse_allreduce_wait: result of " + std::to_string(count) +
                                " entries exceeds the capacity " + std::to_string(out.capacity));
  sparcml::StoreStream(r.stream, out);
  rnnz->typed_data()[0] = static_cast<int32_t>(count);
  ralgorithm->typed_data()[0] = r.algorithm;
  rsent->typed_data()[0] = static_cast<float>(r.sent);
  rdense_round->typed_data()[0] = r.dense_round;
  return ffi::Error::Success();
}

}  // namespace

// Called from Python's atexit (before mpi4py finalizes MPI). Returns 1 when the engine drained.
SPARCML_EXPORT int SparcmlEngineShutdown(double timeout_seconds) {
  return Engine::Get().Shutdown(timeout_seconds) ? 1 : 0;
}

#define PROGRAM_ATTRS                                                                                \
  .Attr<int64_t>("comm").Attr<int64_t>("n").Attr<double>("delta").Attr<ffi::Span<const int64_t>>( \
      "program").Attr<int64_t>("result").Attr<int64_t>("algorithm").Attr<ffi::Span<const int64_t>>( \
      "signature").Attr<int64_t>("hash").Attr<std::string_view>("fields").Attr<int64_t>("rejected")
#define STREAM_IN \
  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::BufferR0<ffi::S32>>().Arg<ffi::Buffer<ffi::U32>>()
#define RESULTS                                                                                          \
  .Ret<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::BufferR0<ffi::S32>>().Ret<         \
      ffi::BufferR0<ffi::S32>>().Ret<ffi::BufferR0<ffi::F32>>().Ret<ffi::BufferR0<ffi::S32>>().Ret<ffi::Token>()

// run also returns a global top-k's dense residual (an empty buffer for the other programs); its
// stream's values, in and out, are float32 or bfloat16.
#define RUN_RESULTS                                                                                      \
  .Ret<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>().Ret<ffi::BufferR0<ffi::S32>>().Ret<                \
      ffi::BufferR0<ffi::S32>>().Ret<ffi::BufferR0<ffi::F32>>().Ret<ffi::BufferR0<ffi::S32>>().Ret<      \
      ffi::Buffer<ffi::F32>>().Ret<ffi::Token>()

SPARCML_EXPORT XLA_FFI_Error* SparcmlMpiRun(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlMpiRun, RunImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Token>() RUN_RESULTS PROGRAM_ATTRS
                                  .Attr<int64_t>("residual")
                                  .Attr<double>("divisor"));

SPARCML_EXPORT XLA_FFI_Error* SparcmlEngineStart(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlEngineStart, StartImpl,
                              ffi::Ffi::Bind() STREAM_IN.Arg<ffi::Token>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Token>() PROGRAM_ATTRS);

SPARCML_EXPORT XLA_FFI_Error* SparcmlEngineWait(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparcmlEngineWait, WaitImpl,
                              ffi::Ffi::Bind().Arg<ffi::BufferR0<ffi::S32>>().RemainingArgs() RESULTS);
