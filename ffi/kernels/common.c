#include "common.h"

#include <stdio.h>
#include <string.h>

void sparcml_pad_tail(int32_t *indices, float *values, int64_t nnz, int64_t capacity, int64_t n) {
  for (int64_t i = nnz; i < capacity; ++i) indices[i] = (int32_t)n;
  if (capacity > nnz) memset(values + nnz, 0, (size_t)(capacity - nnz) * sizeof(float));
}

/* coalesce passes an out-of-range index on (see partition.h), so this is where users meet it. */
#define OUT_OF_RANGE_HINT " (coalesce keeps the first index outside [0, size] it finds); fix the indices"

int sparcml_check_stream(const char *name, const int32_t *indices, int64_t nnz, int64_t capacity,
                         int64_t n, char *err) {
  if (capacity < 0) {
    snprintf(err, SPARCML_ERRLEN,
             "%s: a stream without indices is dense: its nnz must be its size %lld, got %lld; build it with "
             "SparseStream.dense(x), or pass indices",
             name, (long long)n, (long long)nnz);
    return 1;
  }
  if (nnz < 0) {
    snprintf(err, SPARCML_ERRLEN, "%s: nnz=%lld is negative", name, (long long)nnz);
    return 1;
  }
  if (nnz > capacity) {
    snprintf(err, SPARCML_ERRLEN,
             "%s: nnz=%lld exceeds its capacity %lld (from_dense, coalesce and merge return the true count when it "
             "does not fit); pass a larger capacity where the stream is built",
             name, (long long)nnz, (long long)capacity);
    return 1;
  }
  if (nnz == n) return 0; /* dense representation: indices are implicit */
  if (nnz > 0 && indices[0] < 0) {
    snprintf(err, SPARCML_ERRLEN, "%s: indices must lie in [0, n=%lld); found %lld%s", name, (long long)n,
             (long long)indices[0], OUT_OF_RANGE_HINT);
    return 1;
  }
  /* The common case (valid) runs as one branch-free pass; the position is found only on failure. */
  int unsorted = 0;
  for (int64_t i = 1; i < nnz; ++i) unsorted |= indices[i] <= indices[i - 1];
  if (unsorted) {
    for (int64_t i = 1; i < nnz; ++i) {
      if (indices[i] <= indices[i - 1]) {
        snprintf(err, SPARCML_ERRLEN,
                 "%s: indices must be strictly increasing (sorted, no duplicates); violated at position %lld (%lld after %lld)",
                 name, (long long)i, (long long)indices[i], (long long)indices[i - 1]);
        return 1;
      }
    }
  }
  if (nnz > 0 && indices[nnz - 1] >= n) {
    snprintf(err, SPARCML_ERRLEN, "%s: indices must lie in [0, n=%lld); found %lld%s", name, (long long)n,
             (long long)indices[nnz - 1], OUT_OF_RANGE_HINT);
    return 1;
  }
  return 0;
}
