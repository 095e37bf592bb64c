#include "merge.h"

#include <stdio.h>
#include <string.h>

void sparcml_densify_inplace(int32_t *idx, float *val, int64_t nnz, int64_t n) {
  /* idx[j] >= j for a sorted unique stream, so walking backwards never overwrites an unread pair. */
  int64_t hole_end = n;
  for (int64_t j = nnz - 1; j >= 0; --j) {
    int64_t at = idx[j];
    float v = val[j];
    if (hole_end > at + 1) memset(val + at + 1, 0, (size_t)(hole_end - at - 1) * sizeof(float));
    val[at] = v;
    hole_end = at;
  }
  if (hole_end > 0) memset(val, 0, (size_t)hole_end * sizeof(float));
  for (int64_t i = 0; i < n; ++i) idx[i] = (int32_t)i;
}

/* The portable merge, one pair per iteration (about 4 ns per pair on random supports: the branch
 * is unpredictable). Returns the union's count; only the first out_cap pairs are stored. */
static int64_t merge_sparse(const int32_t *ai, const float *av, int64_t an, const int32_t *bi,
                            const float *bv, int64_t bn, int32_t *oi, float *ov, int64_t out_cap) {
  int64_t i = 0, j = 0, o = 0;
  while (i < an && j < bn) {
    int32_t idx = ai[i] <= bi[j] ? ai[i] : bi[j];
    float v = ai[i] < bi[j] ? av[i++] : bi[j] < ai[i] ? bv[j++] : av[i++] + bv[j++];
    if (o < out_cap) {
      oi[o] = idx;
      ov[o] = v;
    }
    ++o;
  }
  for (int k = 0; k < 2; ++k) {
    const int32_t *ri = k ? bi + j : ai + i;
    const float *rv = k ? bv + j : av + i;
    int64_t rest = k ? bn - j : an - i, stored = o >= out_cap ? 0 : out_cap - o < rest ? out_cap - o : rest;
    if (stored > 0) {
      memcpy(oi + o, ri, (size_t)stored * sizeof(int32_t));
      memcpy(ov + o, rv, (size_t)stored * sizeof(float));
    }
    o += rest;
  }
  return o;
}

#define MERGE_INVALID (-2) /* the fast merge found an input that is not a valid stream */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* AVX-512 merge, picked at run time: on random supports about 0.5 ns per merged pair where the
 * portable merge takes about 4 ns.
 *
 * Keys: pair i of a gets key 2*idx, pair j of b gets 2*idx+1. Keys are unique, their order is the
 * index order with a before b on equal indices, and the low bit names the source. The output is
 * built one tile of TILE merged keys at a time, in two passes:
 * 1. Merge the keys, 16 per step: the next 16 merged keys are the lowest 16 of the next 16 of each
 *    input (merge_step). A step depends on the previous one through its count of a keys, a chain
 *    of ~25 cycles, so the tile is cut at merge-path splits into CHAINS pieces whose steps run
 *    interleaved. They write into the tile's key buffer. The loads also validate the inputs.
 * 2. Emit the pairs in one pass over the key buffer (emit_keys). Values never go through the
 *    merge: the a-values of a block of keys are the next ones of a, in order, so they are expanded
 *    into the lanes of even keys; likewise b. An index present in both inputs gives two adjacent
 *    keys, a first; the pair is emitted once, with av + bv (the portable merge's order). */
#define LANES 16
#define CHAINS 4
#define TILE (CHAINS * 1024) /* merged keys per tile: the key buffer (16 KiB) stays in L1 */
#define NO_KEY UINT32_MAX   /* key of lanes past an input's end: above every real key */

#define AVX512 __attribute__((target("avx512f,avx512vbmi2,bmi,bmi2,popcnt")))
#define INLINE __attribute__((always_inline)) inline

typedef struct {
  const int32_t *idx;
  const float *val;
  int64_t nnz;
} stream;

typedef struct {         /* one of the interleaved merges of a tile */
  const int32_t *next_a; /* first pair of a not merged yet */
  const int32_t *next_b; /* and of b */
  uint32_t *out;         /* where the next 16 merged keys go */
  __mmask16 unsorted;    /* lanes of loaded blocks that were not above their predecessor */
} chain;

typedef struct {     /* the emitting pass, carried from tile to tile */
  uint32_t last_key; /* the last key emitted (NO_KEY before the first) */
  int64_t count;     /* pairs emitted so far (may pass out_cap: nothing is stored past it) */
} emitter;

AVX512 static INLINE __mmask16 first_lanes(int64_t count) {
  count = count < 0 ? 0 : count > LANES ? LANES : count;
  return (__mmask16)_bzhi_u32(0xffffu, (unsigned)count);
}

/* Keys of the 16 pairs from `at` of an input (NO_KEY past end); src is the key's low bit. Each is
 * also compared with its predecessor in the input: this is the inputs' validation. Away from the
 * inputs' starts and ends (edge == 0, a constant) no load needs a bound. */
AVX512 static INLINE __m512i load_keys(const int32_t *start, const int32_t *end, const int32_t *at,
                                       int src, __mmask16 *unsorted, int edge) {
  __m512i src_bits = _mm512_set1_epi32(-src); /* (x << 1) | src by a VBMI2 double shift */
  if (!edge) {
    __m512i x = _mm512_loadu_si512(at);
    *unsorted |= _mm512_cmple_epi32_mask(x, _mm512_loadu_si512(at - 1));
    return _mm512_shldi_epi32(x, src_bits, 1);
  }
  __mmask16 live = first_lanes(end - at);
  __m512i x = _mm512_maskz_loadu_epi32(live, at < end ? at : end);
  int32_t before = at > start && at <= end ? at[-1] : INT32_MIN;
  *unsorted |= _mm512_mask_cmple_epi32_mask(live, x, _mm512_alignr_epi32(x, _mm512_set1_epi32(before), 15));
  return _mm512_mask_shldi_epi32(_mm512_set1_epi32((int)NO_KEY), live, x, src_bits, 1);
}

/* Sorts a bitonic vector of 16 keys: half-cleaners at distances 8, 4, 2, 1, where the lane whose
 * distance bit is clear keeps the smaller of itself and its partner. */
AVX512 static INLINE __m512i sort_bitonic(__m512i v) {
  __m512i p = _mm512_shuffle_i64x2(v, v, 0x4e); /* partner: lane ^ 8 */
  v = _mm512_mask_min_epu32(_mm512_max_epu32(v, p), 0x00ff, v, p);
  p = _mm512_shuffle_i64x2(v, v, 0xb1); /* lane ^ 4 */
  v = _mm512_mask_min_epu32(_mm512_max_epu32(v, p), 0x0f0f, v, p);
  p = _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0x4e); /* lane ^ 2 */
  v = _mm512_mask_min_epu32(_mm512_max_epu32(v, p), 0x3333, v, p);
  p = _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0xb1); /* lane ^ 1 */
  return _mm512_mask_min_epu32(_mm512_max_epu32(v, p), 0x5555, v, p);
}

/* The next 16 merged keys of chain c, sorted. They are the lowest 16 of x (the next 16 keys of a)
 * and y (of b). Against y reversed, x[i] < y[15 - i] holds exactly for the a keys among them (the
 * merge-path split), so the lane-wise minimum gathers them in a bitonic sequence, and the count
 * of those lanes advances the inputs. Only a's real keys can win a lane, so next_a stays inside a;
 * b's advance is bounded near its end. */
AVX512 static INLINE __m512i merge_step(const stream *a, const stream *b, chain *c, int edge) {
  const __m512i reverse = _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int32_t *b_end = b->idx + b->nnz;
  __m512i x = load_keys(a->idx, a->idx + a->nnz, c->next_a, 0, &c->unsorted, edge);
  __m512i y = load_keys(b->idx, b_end, c->next_b, 1, &c->unsorted, edge);
  y = _mm512_permutexvar_epi32(reverse, y);
  __mmask16 from_a = _mm512_cmplt_epu32_mask(x, y);
  int taken = _mm_popcnt_u32(from_a);
  c->next_a += taken;
  c->next_b += edge && b_end - c->next_b < LANES - taken ? b_end - c->next_b : LANES - taken;
  return sort_bitonic(_mm512_mask_blend_epi32(from_a, y, x));
}

/* The chains of a tile in lockstep, `steps` steps each; chain c stores its first len[c] keys (only
 * the last chain of the last tile ends in a partial block: the key buffer has room behind it).
 * A chain done before the others runs on harmlessly. */
AVX512 static INLINE void run_chains(const stream *a, const stream *b, chain *ch, const int64_t *len,
                                     int64_t steps, int edge) {
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 8
    for (int c = 0; c < CHAINS; ++c) {
      __m512i low = merge_step(a, b, &ch[c], edge);
      if (s * LANES < len[c]) _mm512_storeu_si512(ch[c].out + s * LANES, low);
    }
  }
}

AVX512 static void merge_keys(const stream *a, const stream *b, chain *ch, const int64_t *len, int edge) {
  int64_t longest = 0;
  for (int c = 0; c < CHAINS; ++c) longest = len[c] > longest ? len[c] : longest;
  if (edge)
    run_chains(a, b, ch, len, (longest + LANES - 1) / LANES, 1);
  else
    run_chains(a, b, ch, len, (longest + LANES - 1) / LANES, 0);
}

/* The values of the lanes `lanes`, taken in order from val[*at..end). */
AVX512 static INLINE __m512 expand_values(const float *val, int64_t end, int64_t *at, __mmask16 lanes,
                                          int edge) {
  __m512 v = edge ? _mm512_maskz_loadu_ps(first_lanes(end - *at), val + (*at < end ? *at : end))
                  : _mm512_loadu_ps(val + *at);
  *at += _mm_popcnt_u32(lanes);
  return _mm512_maskz_expand_ps(lanes, v);
}

/* Stores 16 pairs at out[at..), those below out_cap. */
AVX512 static INLINE void store_pairs(int32_t *oi, float *ov, int64_t at, int64_t out_cap, __m512i idx,
                                      __m512 val) {
  if (out_cap - at >= LANES) {
    _mm512_storeu_si512(oi + at, idx);
    _mm512_storeu_ps(ov + at, val);
  } else if (out_cap > at) {
    _mm512_mask_storeu_epi32(oi + at, first_lanes(out_cap - at), idx);
    _mm512_mask_storeu_ps(ov + at, first_lanes(out_cap - at), val);
  }
}

/* Emits the m merged keys of a tile (keys[-1] holds the key emitted before them) whose values
 * start at ea in a and eb in b. A b key right after its a twin (key - 1) takes the twin's value
 * too: a's values go to the twins' b lanes instead of their a lanes, which are dropped. When the
 * twin ended the previous block, its value is read again and its output slot overwritten. Most
 * blocks have no twin (a lane has one with about the inputs' density) and skip all that. The
 * state lives in locals: as far as the compiler knows, the stores may alias anything. */
AVX512 static INLINE void emit_keys(const stream *a, const stream *b, const uint32_t *keys, int64_t m,
                                    int64_t ea, int64_t eb, emitter *e, int32_t *oi, float *ov,
                                    int64_t out_cap, int edge) {
  const float *av = a->val, *bv = b->val;
  int64_t an = a->nnz, bn = b->nnz, count = e->count;
  const __m512i one = _mm512_set1_epi32(1);
  for (int64_t p = 0; p < m; p += LANES) {
    __mmask16 live = edge ? first_lanes(m - p) : 0xffff;
    __m512i key = _mm512_loadu_si512(keys + p), prev = _mm512_loadu_si512(keys + p - 1);
    __m512i idx = _mm512_srli_epi32(key, 1);
    __mmask16 from_a = _mm512_mask_testn_epi32_mask(live, key, one), from_b = live & ~from_a;
    __mmask16 twin_b = _mm512_mask_cmpeq_epi32_mask(from_b, key, _mm512_add_epi32(prev, one));
    if (!twin_b) {
      __m512 va = expand_values(av, an, &ea, from_a, edge), vb = expand_values(bv, bn, &eb, from_b, edge);
      store_pairs(oi, ov, count, out_cap, idx, _mm512_mask_mov_ps(va, from_b, vb));
      count += _mm_popcnt_u32(live);
      continue;
    }
    __mmask16 a_lanes = (from_a & ~(twin_b >> 1)) | twin_b, keep = live & ~(twin_b >> 1);
    ea -= twin_b & 1;
    count -= twin_b & 1;
    __m512 va = expand_values(av, an, &ea, a_lanes, edge), vb = expand_values(bv, bn, &eb, from_b, edge);
    __m512 val = _mm512_mask_add_ps(_mm512_mask_mov_ps(va, from_b, vb), twin_b, va, vb); /* a + b */
    store_pairs(oi, ov, count, out_cap, _mm512_maskz_compress_epi32(keep, idx),
                _mm512_maskz_compress_ps(keep, val));
    count += _mm_popcnt_u32(keep);
  }
  e->count = count;
  e->last_key = keys[m - 1];
}

/* split[c] = number of a pairs among the first d[c] merged pairs of a[a0..) and b[b0..): binary
 * searches on the merge path, advanced together so that their loads overlap. */
static void merge_path_splits(const stream *a, const stream *b, int64_t a0, int64_t b0, const int64_t *d,
                              int64_t *split) {
  int64_t base[CHAINS], len[CHAINS], ra = a->nnz - a0, rb = b->nnz - b0;
  for (int c = 0; c < CHAINS; ++c) {
    base[c] = d[c] > rb ? d[c] - rb : 0;
    len[c] = (d[c] < ra ? d[c] : ra) - base[c];
  }
  for (int busy = 1; busy;) {
    busy = 0;
    for (int c = 0; c < CHAINS; ++c) {
      if (len[c] <= 0) continue;
      int64_t half = len[c] / 2, p = base[c] + half;
      int a_first = a->idx[a0 + p] <= b->idx[b0 + d[c] - 1 - p];
      base[c] = a_first ? p + 1 : base[c];
      len[c] = a_first ? len[c] - half - 1 : half;
      busy = 1;
    }
  }
  for (int c = 0; c < CHAINS; ++c) split[c] = base[c];
}

/* Merges the next m pairs (from a0 in a, b0 in b) into the output; *na receives how many come from
 * a. Returns 0, or MERGE_INVALID when an input turns out not to be strictly increasing. */
AVX512 static int merge_tile(const stream *a, const stream *b, int64_t a0, int64_t b0, int64_t m,
                             emitter *e, int32_t *oi, float *ov, int64_t out_cap, int64_t *na) {
  /* Aligned, so that the chains' stores never straddle cache lines; keys[-1] is the slot before. */
  _Alignas(64) uint32_t buffer[LANES + TILE + LANES];
  uint32_t *keys = buffer + LANES;
  int64_t d[CHAINS], split[CHAINS], len[CHAINS];
  chain ch[CHAINS];
  for (int c = 0; c < CHAINS; ++c) d[c] = c + 1 < CHAINS ? m * (c + 1) / CHAINS / LANES * LANES : m;
  merge_path_splits(a, b, a0, b0, d, split);
  for (int c = 0; c < CHAINS; ++c) {
    int64_t d0 = c ? d[c - 1] : 0, s0 = c ? split[c - 1] : 0;
    ch[c] = (chain){a->idx + a0 + s0, b->idx + b0 + d0 - s0, keys + d0, 0};
    len[c] = d[c] - d0;
  }
  /* A chain reads from one pair before its piece to TILE + LANES pairs past the tile's start. */
  merge_keys(a, b, ch, len, a0 == 0 || b0 == 0 || a0 + 2 * TILE > a->nnz || b0 + 2 * TILE > b->nnz);
  /* The loads compared every pair of the tile with its predecessor if each chain got through its
   * piece (always so when the inputs are sorted). */
  for (int c = 0; c < CHAINS; ++c) {
    if (ch[c].unsorted || ch[c].next_a < a->idx + a0 + split[c] || ch[c].next_b < b->idx + b0 + d[c] - split[c])
      return MERGE_INVALID;
  }
  keys[-1] = e->last_key;
  if (m % LANES == 0 && a0 + m + LANES <= a->nnz && b0 + m + LANES <= b->nnz)
    emit_keys(a, b, keys, m, a0, b0, e, oi, ov, out_cap, 0);
  else
    emit_keys(a, b, keys, m, a0, b0, e, oi, ov, out_cap, 1);
  *na = split[CHAINS - 1];
  return 0;
}

/* The AVX-512 merge of two non-empty streams, validating them on the way (sorted, unique, inside
 * [0, n) with n < INT32_MAX so that every key is below NO_KEY). Returns the union's count (only
 * the first out_cap pairs are stored), or MERGE_INVALID for an invalid input. */
AVX512 static int64_t merge_avx512(const stream *a, const stream *b, int64_t n, int32_t *oi, float *ov,
                                   int64_t out_cap) {
  if (a->idx[0] < 0 || a->idx[a->nnz - 1] >= n || b->idx[0] < 0 || b->idx[b->nnz - 1] >= n)
    return MERGE_INVALID;
  emitter e = {NO_KEY, 0};
  int64_t a0 = 0, b0 = 0, total = a->nnz + b->nnz;
  while (a0 + b0 < total) {
    int64_t m = total - a0 - b0 < TILE ? total - a0 - b0 : TILE, na;
    if (merge_tile(a, b, a0, b0, m, &e, oi, ov, out_cap, &na)) return MERGE_INVALID;
    a0 += na;
    b0 += m - na;
  }
  return e.count;
}

static int have_avx512(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vbmi2") &&
         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
}
#endif

/* Merge-sum of two sparse streams: the union's count (the first out_cap pairs stored), or -1
 * after writing the error. The inputs are checked by the fast merge on the way; a failure there
 * reruns the checks for their message. */
static int64_t merge_sparse_checked(const int32_t *a_idx, const float *a_val, int64_t a_nnz, int64_t a_cap,
                                    const int32_t *b_idx, const float *b_val, int64_t b_nnz, int64_t b_cap,
                                    int64_t n, int32_t *out_idx, float *out_val, int64_t out_cap, char *err) {
  int64_t count = MERGE_INVALID;
#if defined(__x86_64__) && defined(__GNUC__)
  if (a_nnz > 0 && a_nnz <= a_cap && b_nnz > 0 && b_nnz <= b_cap && n < INT32_MAX && have_avx512()) {
    stream a = {a_idx, a_val, a_nnz}, b = {b_idx, b_val, b_nnz};
    count = merge_avx512(&a, &b, n, out_idx, out_val, out_cap);
  }
#endif
  if (count == MERGE_INVALID) {
    if (sparcml_check_stream("a", a_idx, a_nnz, a_cap, n, err)) return -1;
    if (sparcml_check_stream("b", b_idx, b_nnz, b_cap, n, err)) return -1;
    count = merge_sparse(a_idx, a_val, a_nnz, b_idx, b_val, b_nnz, out_idx, out_val, out_cap);
  }
  return count;
}

/* The first m entries of dense + other (other dense, or sparse) as a stream's first m pairs. */
static void add_dense_prefix(const float *dense, const int32_t *other_idx, const float *other_val,
                             int64_t other_nnz, int64_t n, int64_t m, int32_t *out_idx, float *out_val) {
  if (other_nnz == n) {
    for (int64_t i = 0; i < m; ++i) out_val[i] = dense[i] + other_val[i];
  } else {
    if (m > 0) memcpy(out_val, dense, (size_t)m * sizeof(float));
    for (int64_t j = 0; j < other_nnz && other_idx[j] < m; ++j) out_val[other_idx[j]] += other_val[j];
  }
  for (int64_t i = 0; i < m; ++i) out_idx[i] = (int32_t)i;
}

int sparcml_merge(const int32_t *a_idx, const float *a_val, int64_t a_nnz, int64_t a_cap,
                  const int32_t *b_idx, const float *b_val, int64_t b_nnz, int64_t b_cap,
                  int64_t n, int64_t dense_threshold,
                  int32_t *out_idx, float *out_val, int64_t out_cap, int64_t *out_nnz, char *err) {
  int a_dense = a_nnz == n, b_dense = b_nnz == n;

  if (a_dense || b_dense) {
    if (sparcml_check_stream("a", a_idx, a_nnz, a_cap, n, err)) return 1;
    if (sparcml_check_stream("b", b_idx, b_nnz, b_cap, n, err)) return 1;
    const float *dense = a_dense ? a_val : b_val;
    const int32_t *other_idx = a_dense ? b_idx : a_idx;
    const float *other_val = a_dense ? b_val : a_val;
    int64_t other_nnz = a_dense ? b_nnz : a_nnz;
    /* When the n entries do not fit: the first out_cap, with the true count. */
    add_dense_prefix(dense, other_idx, other_val, other_nnz, n, out_cap < n ? out_cap : n, out_idx, out_val);
    sparcml_pad_tail(out_idx, out_val, n, out_cap, n);
    *out_nnz = n;
    return 0;
  }

  int64_t count = merge_sparse_checked(a_idx, a_val, a_nnz, a_cap, b_idx, b_val, b_nnz, b_cap, n, out_idx,
                                       out_val, out_cap, err);
  if (count < 0) return 1;
  if (count >= dense_threshold && out_cap >= n) {
    sparcml_densify_inplace(out_idx, out_val, count, n);
    count = n;
  }
  if (count < out_cap) sparcml_pad_tail(out_idx, out_val, count, out_cap, n);
  *out_nnz = count;
  return 0;
}
