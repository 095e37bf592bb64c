// The native transport runs an algorithm's schedule as one program: sparcml_jax/comm/native.py
// records the transport operations that the algorithm's single definition makes (exchanges,
// reduce-scatters, allgathers, ...) as fixed-width instructions over stream registers, and this
// interpreter executes them for this rank. The blocking path runs it on the calling thread; the
// progress engine runs the same program on its own thread between start and wait.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpi_wire.h"

namespace sparcml {

// Instruction words: {op, dst, capacity, a, b, c, d, e}; keep in step with comm/native.py.
enum Op : int64_t {
  kExchange = 1,       // a: send register, b: into register, c: dest, d: source, e: combine (1 add, 2 replace)
  kReduceScatter = 2,  // a: source register, b: dense slice result (bit 0) and 1 + the register of this rank's
                       // coding error (b >> 1; 0: none), c: QSGD bits of dense segments (0: none), d: bucket,
                       // e: scale kind
  kAllgather = 3,      // a: part register, b: mode (0 pairs, 1 dense, 2 QSGD), c: bits, d: bucket, e: scale kind
  kAllreduce = 4,      // a: source register
  kSplit = 5,          // dst: first of nprocs registers, a: source register, b: 1 + operand of run-time region starts
  kConcat = 6,         // a: first of nprocs registers
  kGather = 7,         // a: source register (every rank's whole stream, summed)
  kAgree = 8,          // every rank learns every rank's flags and counts
  kChoose = 9,         // a: choices; then one row {bound, algorithm, instructions} per choice, then the branches
  kMove = 10,          // a: source register (a new name, a new capacity, the same data)
  kFree = 11,          // a: register (left empty)
  kSelect = 12,        // dst: the top `capacity` entries (pairs), a: source register, b: register of the rest,
                       // c: 1 + operand of a run-time threshold (then only entries of at least its magnitude)
  kAddLocal = 13,      // a + b on this rank: a: register, b: register
  kResidual = 14,      // a: input, b: held, c: result; dense: b where c is nonzero, a elsewhere
  kNonzeros = 15,      // a: a dense register, as its nonzeros' pairs unless their count reaches the threshold;
                       // b: a NonzerosStep
  kWire = 16,          // a: bits of the values on the wire from here on (16: bfloat16; 32, the default: float32)
};
// kNonzeros in one step, or counted before a choice (a dense register whose nnz is its count) and
// compacted in the branches that take pairs, so that the dense allreduce reads the vector as it is.
enum NonzerosStep : int64_t { kCountAndCompact = 0, kCountOnly = 1, kCompactCounted = 2 };
constexpr int kWords = 8;
// kExchange's combine; with kHandOver a rank that sends is left with what it receives, or nothing;
// with kPairsOnly the sum stays pairs (an Ok-Topk region: its entries lie in a sub-range).
enum Combine : int64_t { kAdd = 1, kReplace = 2, kHandOver = 4, kPairsOnly = 8 };
// kSelectedPairs: parts travel as their pairs (a global top-k's selections), never as dense slices;
// kRegionPairs: so do parts of run-time regions, whose indices are already over the whole vector.
enum GatherMode : int64_t { kPairs = 0, kDenseSlices = 1, kQuantized = 2, kSelectedPairs = 3, kRegionPairs = 4 };

// A stream register: sorted pairs over [0, n), or a dense array of n values (no indices).
struct Stream {
  int64_t n = 0, nnz = 0, capacity = 0;
  bool dense = false;
  const int32_t* idx = nullptr;
  const float* val = nullptr;
  std::shared_ptr<void> storage;  // keeps idx and val alive (none: a view of the caller's buffers)
  bool as_sent = false;           // on a bfloat16 wire: its values are as a message delivers them
};

// Where the result goes: the caller's output buffers (blocking path), or nowhere (the engine keeps it).
// A result dense by construction has no index buffer (index_capacity 0).
struct Output {
  int32_t* idx = nullptr;
  float* val = nullptr;
  int64_t capacity = 0;
  int64_t index_capacity = 0;
};

struct ProgramResult {
  Stream stream;          // the result (in `Output` when given)
  Stream residual;        // a global top-k's dense residual (when the program has one)
  int32_t algorithm = -1;
  int32_t dense_round = -1;
  double sent = 0;
  int64_t nnz_max = 0;    // the largest input count over ranks, when the program agreed on it
  std::string error;      // empty on success; identical in kind on every rank
};

struct ProgramArgs {
  MPI_Comm channel;
  int tag;
  bool background;
  Signature signature;
  std::vector<int64_t> code;
  int64_t result_register = 0;  // -1: the program has no result (an agreement)
  int64_t residual_register = -1;  // a global top-k's residual; -1: none
  int32_t algorithm = -1;  // reported unless a kChoose picks one
  int64_t n = 0;
  double delta = 1.0;
  uint32_t key[2] = {0, 0};  // QSGD's key words (this rank's)
  std::vector<uint32_t> operands;  // run-time operands: thresholds (float bits), region starts
  std::string rejected;      // this rank rejected its arguments (the rank's Python error follows)
};

// Runs the program on `input` (validated first; an invalid stream fails the call on every rank).
ProgramResult RunProgram(const ProgramArgs& args, Stream input, const std::string& input_error, Output output);

// Writes a result stream into the caller's buffers: pairs, or the n values (and indices 0..n-1
// where there is an index buffer); into a result dense by construction (no index buffer), the
// stream's n values, densified.
void StoreStream(const Stream& s, const Output& out);

// Writes s as its n dense values.
void StoreDense(const Stream& s, float* out);

}  // namespace sparcml
