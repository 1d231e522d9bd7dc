/* Paged decode attention on the CPU: one query token per sequence attends to its context
   read in place from the block-paged K/V cache (no gather, no padding mask).

Layout (workers/model/kv_cache.py): a layer's keys and values are [slots, kv_heads,
head_dim], slot = block * block_size + offset; `tables` [D, width] holds each sequence's
blocks and `lens` [D] its context length, the new token included. q [D, heads, head_dim]
(rows `q_stride` elements apart), out [D, heads, head_dim] contiguous.

One task a (sequence, KV head, partition of 256 keys): the key and value rows are read
once for the query heads that share them (grouped-query attention), keys are scored 8 at a
time, and the softmax runs online, block by block in position order, in float32 whatever
the cache's dtype; a sequence's partitions are then merged in order. The partitions let one
long context use every thread; they are cut by the row's length alone, so a sequence's
result depends only on its own query and context, never on the batch around it or on the
thread count. A prompt attended as decode rows (a speculative verification, a chunk under
engine.deterministic) has its consecutive queries tiled 8 at a time: each block is read
once for the tile, and each query's sums stay those it would have alone (2,000 queries of
the default model's shape: 360 -> 138 ms a layer on a 2-core AVX2 EPYC, SDPA's causal
product 115 ms).

Built by workers/native/build.py with the host's gcc (-O3 -march=native -fopenmp); torch's
OpenMP runtime runs the tasks. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include "../native/vector_math.h"

enum { DT_FLOAT32 = 0, DT_BFLOAT16 = 1, DT_FLOAT16 = 2 };
#define MAX_BLOCK 256  /* block sizes up to this many tokens */
#define SERIAL_WORK (1 << 15)  /* ~10 us of products on one core: below, a team costs more than it saves */

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef __F16C__
static inline float f16_to_float(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t float_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#endif

/* Elements [index, index + n) of a tensor of `dtype` as floats. */
static inline void widen_row(int dtype, const void *base, int64_t index, int64_t n, float *dst) {
    if (dtype == DT_FLOAT32) {
        memcpy(dst, (const float *)base + index, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)base + index;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        _mm256_storeu_ps(dst + i, dtype == DT_FLOAT16 ? _mm256_cvtph_ps(h)
                                  : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#endif
#ifdef __F16C__
    if (dtype == DT_FLOAT16) {
        for (; i < n; i++) dst[i] = f16_to_float(src[i]);
        return;
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static inline void store_row(int dtype, const float *src, int64_t n, void *base, int64_t index) {
    if (dtype == DT_FLOAT32) {
        memcpy((float *)base + index, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)base + index;
#ifdef __F16C__
    if (dtype == DT_FLOAT16) {
        for (int64_t i = 0; i < n; i++) dst[i] = float_to_f16(src[i]);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* a . b over n floats in a fixed summation order. */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float acc = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 sum = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        acc = _mm_cvtss_f32(s);
    }
#endif
    for (; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
#define VECTOR_PATH 1
/* q . each of 8 rows `stride` floats apart (n a multiple of 8), as one vector: the 8
   accumulators summed across by a fixed tree of hadds (no per-row horizontal sum). */
static inline __m256 dot8(const float *q, const float *rows, int64_t stride, int64_t n) {
    __m256 a[8];
#ifdef __AVX512F__
    /* 16 lanes where the head's width allows (64, 128: a model's every call takes the same
       path, so a row's sums stay its own): half the products and loads of 8 lanes; each
       accumulator's halves are then added into the 8-lane sums the tree below takes. */
    if (n % 16 == 0) {
        __m512 w[8];
        for (int j = 0; j < 8; j++) w[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 qv = _mm512_loadu_ps(q + i);
            for (int j = 0; j < 8; j++) w[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows + j * stride + i), w[j]);
        }
        for (int j = 0; j < 8; j++)
            a[j] = _mm256_add_ps(_mm512_castps512_ps256(w[j]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[j]), 1)));
    } else
#endif
    {
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + j * stride + i), a[j]);
        }
    }
    __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
#endif

/* scores[h * MAX_BLOCK + t] = the scaled (and capped) q_h . key t for the block's n keys,
   key t at keys + t * stride (float32: in the cache, or widened from it). */
static inline void block_scores(const float *qf, const float *keys, int64_t stride, int64_t head_dim, int64_t n,
                                int64_t group, float scale, float softcap, float *scores) {
    int64_t t = 0;
#ifdef VECTOR_PATH
    if (head_dim % 8 == 0 && softcap <= 0.0f) {
        const __m256 scale8 = _mm256_set1_ps(scale);
        for (; t + 8 <= n; t += 8)
            for (int64_t h = 0; h < group; h++)
                _mm256_storeu_ps(scores + h * MAX_BLOCK + t,
                                 _mm256_mul_ps(dot8(qf + h * head_dim, keys + t * stride, stride, head_dim), scale8));
    }
#endif
    for (; t < n; t++) {
        const float *key = keys + t * stride;
        for (int64_t h = 0; h < group; h++) {
            float s = dot(qf + h * head_dim, key, head_dim) * scale;
            scores[h * MAX_BLOCK + t] = softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
        }
    }
}

/* x[t] = e^(x[t] - max) for t < n; returns their sum (in a fixed order). */
static inline float exponentiate(float *x, int64_t n, float max) {
    int64_t t = 0;
    float sum = 0.0f;
#ifdef VECTOR_PATH
    const __m256 max8 = _mm256_set1_ps(max);
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), max8));
        _mm256_storeu_ps(x + t, e);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        sum += _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
#endif
    for (; t < n; t++) {
        x[t] = expf(x[t] - max);
        sum += x[t];
    }
    return sum;
}

/* acc[0..d) += sum over t < n, in order, of p[t] * row t (rows `stride` floats apart). Each
   acc element takes its n products one after another, as a loop over t would add them, but
   up to 64 of them stay in registers for the whole block (one load and store of acc a
   block, not one a key). */
static inline void add_weighted_rows(float *acc, const float *p, const float *rows, int64_t stride, int64_t n,
                                     int64_t d) {
    int64_t i = 0;
#ifdef __AVX512F__
    /* The same products in the same order for each element as the 8-lane loop below, in
       half the instructions: the lane width does not change any element's sum. */
    for (; i + 64 <= d; i += 64) {
        __m512 a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm512_loadu_ps(acc + i + 16 * j);
        for (int64_t t = 0; t < n; t++) {
            const __m512 pt = _mm512_set1_ps(p[t]);
            const float *row = rows + t * stride + i;
            for (int j = 0; j < 4; j++) a[j] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(row + 16 * j), a[j]);
        }
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + i + 16 * j, a[j]);
    }
#endif
#ifdef VECTOR_PATH
    for (; i + 64 <= d; i += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + i + 8 * j);
        for (int64_t t = 0; t < n; t++) {
            const __m256 pt = _mm256_set1_ps(p[t]);
            const float *row = rows + t * stride + i;
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(row + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + i + 8 * j, a[j]);
    }
    for (; i + 8 <= d; i += 8) {
        __m256 a = _mm256_loadu_ps(acc + i);
        for (int64_t t = 0; t < n; t++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(rows + t * stride + i), a);
        _mm256_storeu_ps(acc + i, a);
    }
#endif
    for (; i < d; i++) {
        float a = acc[i];
        for (int64_t t = 0; t < n; t++) a = fmaf(p[t], rows[t * stride + i], a);
        acc[i] = a;
    }
}

/* One query's running softmax over KV head `kv_head` for its query heads (`group` of them):
   acc (group x head_dim) = sum of e^(s - max) v, and per head its max and the sum of
   e^(s - max), left unnormalized. */
typedef struct {
    const float *q;  /* the group's query rows, widened */
    float *acc, *maxes, *sums;
    int64_t end;     /* its keys end here */
} query_state;

static void start_query(query_state *query, int64_t group, int64_t head_dim) {
    for (int64_t h = 0; h < group; h++) {
        query->maxes[h] = -INFINITY;
        query->sums[h] = 0.0f;
    }
    memset(query->acc, 0, (size_t)(group * head_dim) * sizeof(float));
}

/* The query takes n keys (`keys` and `values` rows `stride` floats apart: both in the
   cache, or both widened): scores, the running maxima, the exponentials, the weighted values. */
static inline void take_keys(query_state *query, const float *keys, const float *values, int64_t stride,
                             int64_t head_dim, int64_t n, int64_t group, float scale, float softcap, float *scores) {
    float *acc = query->acc, *maxes = query->maxes, *sums = query->sums;
    block_scores(query->q, keys, stride, head_dim, n, group, scale, softcap, scores);
    for (int64_t h = 0; h < group; h++) {  /* the running maxima take the block's */
        float *sh = scores + h * MAX_BLOCK, block_max = -INFINITY;
        for (int64_t t = 0; t < n; t++) block_max = sh[t] > block_max ? sh[t] : block_max;
        if (block_max > maxes[h]) {
            float rescale = expf(maxes[h] - block_max);  /* 0 on the first block (exp(-inf)) */
            for (int64_t i = 0; i < head_dim; i++) acc[h * head_dim + i] *= rescale;
            sums[h] *= rescale;
            maxes[h] = block_max;
        }
        sums[h] += exponentiate(sh, n, maxes[h]);
    }
    for (int64_t h = 0; h < group; h++)
        add_weighted_rows(acc + h * head_dim, scores + h * MAX_BLOCK, values, stride, n, head_dim);
}

/* Queries of one sequence over KV head `kv_head`, keys [first, each query's end): block by
   block in position order, each block's key and value rows read (and widened) once for all
   the queries and their query heads, while they are in the core's nearest cache. Each
   query's sums are taken in the same order as were it alone (`count` 1: a decode row), so
   a prompt's queries tiled here equal the same queries decoded one at a time. */
static void attend_range(int dtype, query_state *queries, int count, const void *k, const void *v, int64_t kv_heads,
                         int64_t kv_head, int64_t head_dim, int64_t block_size, const int64_t *table, int64_t first,
                         int64_t group, float scale, float softcap, float *work) {
    float *scores = work;
    /* a block's widened keys and values (a cache not in float32): widened once for the
       tile's queries, not once a query (2,000 bfloat16 queries of the default model's
       shape: 58-66 -> 46-55 ms, tools.bench.prompt_attention on a 2-core AMX Xeon) */
    float *block_keys = scores + group * MAX_BLOCK, *block_values = block_keys + MAX_BLOCK * head_dim;
    int64_t end = first;
    for (int r = 0; r < count; r++) {
        start_query(&queries[r], group, head_dim);
        end = queries[r].end > end ? queries[r].end : end;
    }
    for (int64_t b = first / block_size; b * block_size < end; b++) {
        int64_t from = b * block_size < first ? first : b * block_size;
        int64_t to = (b + 1) * block_size < end ? (b + 1) * block_size : end;
        int64_t slot = table[b] * block_size + (from - b * block_size);
        const float *keys = (const float *)k + (slot * kv_heads + kv_head) * head_dim;
        const float *values = (const float *)v + (slot * kv_heads + kv_head) * head_dim;
        int64_t stride = kv_heads * head_dim;
        if (dtype != DT_FLOAT32) {
            for (int64_t t = 0; t < to - from; t++) {
                int64_t row = ((slot + t) * kv_heads + kv_head) * head_dim;
                widen_row(dtype, k, row, head_dim, block_keys + t * head_dim);
                widen_row(dtype, v, row, head_dim, block_values + t * head_dim);
            }
            keys = block_keys, values = block_values;
            stride = head_dim;
        }
        for (int r = 0; r < count; r++) {
            int64_t n = (to < queries[r].end ? to : queries[r].end) - from;
            if (n > 0)
                take_keys(&queries[r], keys, values, stride, head_dim, n, group, scale, softcap, scores);
        }
    }
}

/* The keys a decode row sees: [first, len), cut into partitions of PARTITION keys from
   `first`. A long context is split so that one sequence's attention spreads over the
   threads; the cut depends on the row's length and window only, so the sums do too. */
#define PARTITION 256

static inline int64_t first_key(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }
static inline int64_t partitions(int64_t len, int64_t window) {
    return (len - first_key(len, window) + PARTITION - 1) / PARTITION;
}

/* Floats of scratch: a thread's (scores, a block's widened keys and values, the tile's
   queries), a partition's result. */
#define TILE_ROWS 8  /* a prompt's consecutive queries attended together, each block read once for them */
static int64_t thread_work(int64_t group, int64_t head_dim) {
    return group * MAX_BLOCK + 2 * MAX_BLOCK * head_dim + TILE_ROWS * group * head_dim;
}
static int64_t part_floats(int64_t group, int64_t head_dim) { return group * head_dim + 2 * group; }

/* The partitions of one (sequence, KV head) merged in order into its output rows. */
static void merge_partitions(int dtype, const float *parts, int64_t count, int64_t group, int64_t head_dim, void *out,
                             int64_t out_row, float *acc) {
    const int64_t stride = part_floats(group, head_dim);
    for (int64_t h = 0; h < group; h++) {
        float max = -INFINITY, sum = 0.0f;
        for (int64_t p = 0; p < count; p++) {
            float m = parts[p * stride + group * head_dim + h];
            max = m > max ? m : max;
        }
        memset(acc, 0, (size_t)head_dim * sizeof(float));
        for (int64_t p = 0; p < count; p++) {
            const float *part = parts + p * stride;
            float weight = expf(part[group * head_dim + h] - max);  /* exactly 1 for the largest (a lone one) */
            sum += weight * part[group * head_dim + group + h];
            for (int64_t i = 0; i < head_dim; i++) acc[i] += weight * part[h * head_dim + i];
        }
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t i = 0; i < head_dim; i++) acc[i] *= inv;
        store_row(dtype, acc, head_dim, out, out_row + h * head_dim);
    }
}

static inline int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* How one call's work is cut: its tasks (sequence, "KV head", partition), run in units,
   and scratch, the same for every layer of a step with the same window (cpu_decoder.c plans
   once a step). A task takes the query heads of one KV head; with fewer tasks than two a
   thread (one stream's short context: 3 on 2 threads for the default model), one query
   head each, so that the threads share the work evenly (a step at batch 1 is 10-15 %
   faster). A unit is one task, or the same (KV head, partition) task of up to TILE_ROWS
   rows that are one prompt's consecutive queries (the same block table, each row's length
   one more than the previous; no window): its blocks are read once for all of them. A
   head's sums are its own either way. */
typedef struct {
    int64_t tasks, units, split, kv_heads, group, per_thread, per_part, products, team;  /* team: threads with scratch */
    int64_t *seq_first;  /* task numbers of each sequence's first partition (num_seqs + 1) */
    int64_t *unit_seq;   /* each unit's first row, then its row count, "KV head" and partition (4 a unit) */
    float *work;         /* per_thread floats a thread, then per_part floats a task */
} attention_plan;

static void free_plan(attention_plan *plan) {
    free(plan->seq_first), free(plan->unit_seq), free(plan->work);
    plan->seq_first = plan->unit_seq = NULL, plan->work = NULL;
}

/* Rows `seq` - 1 and `seq`: consecutive queries of one prompt. */
static int next_query(const int64_t *tables, int64_t width, const int32_t *lens, int64_t seq) {
    return lens[seq] == lens[seq - 1] + 1 &&
           memcmp(tables + seq * width, tables + (seq - 1) * width, (size_t)width * sizeof(int64_t)) == 0;
}

/* The units: runs of consecutive queries (TILE_ROWS at most; single rows under a window),
   then each run's (KV head, partition) pairs. */
static int64_t plan_units(int64_t *unit_seq, const int64_t *tables, int64_t width, const int32_t *lens,
                          int64_t num_seqs, int64_t kv_heads, int64_t window) {
    int64_t units = 0;
    for (int64_t seq = 0, end; seq < num_seqs; seq = end) {
        for (end = seq + 1; window <= 0 && end < num_seqs && end - seq < TILE_ROWS && next_query(tables, width, lens, end);
             end++) {}
        int64_t count = partitions(lens[end - 1], window);  /* the run's longest row has the most */
        for (int64_t kv_head = 0; kv_head < kv_heads; kv_head++)
            for (int64_t part = 0; part < count; part++, units++) {
                int64_t *unit = unit_seq + 4 * units;
                unit[0] = seq, unit[1] = end - seq, unit[2] = kv_head, unit[3] = part;
            }
    }
    return units;
}

/* 0, or 1 (nothing allocated) for a shape the kernel does not take or no memory. */
static int plan_attention(attention_plan *plan, int dtype, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          int64_t block_size, const int64_t *tables, int64_t width, const int32_t *lens,
                          int64_t num_seqs, int64_t window, int threads) {
#ifndef __F16C__
    if (dtype == DT_FLOAT16) return 1;
#endif
    if (dtype < DT_FLOAT32 || dtype > DT_FLOAT16 || block_size > MAX_BLOCK || kv_heads <= 0 || heads % kv_heads)
        return 1;
    int64_t tasks = 0, products = 0, split = 1;
    for (int64_t seq = 0; seq < num_seqs; seq++) tasks += kv_heads * partitions(lens[seq], window);
    if (tasks < 2 * (int64_t)threads) split = heads / kv_heads;
    kv_heads *= split;  /* from here on, "KV heads" of `group` query heads; `split` of them read one cache head */
    const int64_t group = heads / kv_heads, per_thread = thread_work(group, head_dim);
    const int64_t per_part = part_floats(group, head_dim), team = threads > 0 ? threads : 1;
    tasks = 0;
    int64_t *seq_first = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (seq_first == NULL) return 1;
    for (int64_t seq = 0; seq < num_seqs; seq++) {
        seq_first[seq] = tasks;
        tasks += kv_heads * partitions(lens[seq], window);
        products += (int64_t)lens[seq] * heads * head_dim;
    }
    seq_first[num_seqs] = tasks;
    int64_t *unit_seq = malloc((size_t)(4 * (tasks > 0 ? tasks : 1)) * sizeof(int64_t));  /* units <= tasks */
    float *work = malloc((size_t)(per_thread * team + per_part * tasks) * sizeof(float));
    if (unit_seq == NULL || work == NULL) {
        free(seq_first), free(unit_seq), free(work);
        return 1;
    }
    int64_t units = plan_units(unit_seq, tables, width, lens, num_seqs, kv_heads, window);
    *plan = (attention_plan){tasks, units, split, kv_heads, group, per_thread, per_part, products, team, seq_first,
                             unit_seq, work};
    return 0;
}

/* The planned units, then the merges, each an orphaned `omp for` shared by the calling
   team (outside a parallel region, all done by the calling thread). */
static void attend_shared(const attention_plan *plan, int dtype, const void *q, int64_t q_stride, const void *k,
                          const void *v, int64_t heads, int64_t head_dim, int64_t block_size, const int64_t *tables,
                          int64_t width, const int32_t *lens, int64_t num_seqs, float scale, int64_t window,
                          float softcap, void *out) {
    const int64_t group = plan->group, kv_heads = plan->kv_heads, split = plan->split, per_part = plan->per_part;
    const int64_t *seq_first = plan->seq_first;
    float *mine = plan->work + thread_index() * plan->per_thread;
    float *qf = mine + group * MAX_BLOCK + 2 * MAX_BLOCK * head_dim;
    float *results = plan->work + plan->per_thread * plan->team;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < plan->units; u++) {
        const int64_t *unit = plan->unit_seq + 4 * u;
        const int64_t kv_head = unit[2], part = unit[3];
        query_state queries[TILE_ROWS];
        int count = 0;
        int64_t first = 0;
        for (int64_t seq = unit[0]; seq < unit[0] + unit[1]; seq++) {
            int64_t len = lens[seq], parts = partitions(len, window);
            if (part >= parts) continue;  /* a shorter row of the run: no such partition */
            first = first_key(len, window) + part * PARTITION;  /* the same for every row of a run */
            float *qr = qf + count * group * head_dim, *result = results + (seq_first[seq] + kv_head * parts + part) * per_part;
            for (int64_t h = 0; h < group; h++)
                widen_row(dtype, q, seq * q_stride + (kv_head * group + h) * head_dim, head_dim, qr + h * head_dim);
            queries[count++] = (query_state){qr, result, result + group * head_dim, result + group * head_dim + group,
                                             first + PARTITION < len ? first + PARTITION : len};
        }
        attend_range(dtype, queries, count, k, v, kv_heads / split, kv_head / split, head_dim, block_size,
                     tables + unit[0] * width, first, group, scale, softcap, mine);
    }
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < num_seqs * kv_heads; pair++) {
        int64_t seq = pair / kv_heads, kv_head = pair % kv_heads, count = partitions(lens[seq], window);
        merge_partitions(dtype, results + (seq_first[seq] + kv_head * count) * per_part, count, group, head_dim,
                         out, seq * heads * head_dim + kv_head * group * head_dim, mine);
    }
}

/* 0 on success; 1: an unsupported dtype, block size or head grouping (the caller takes
   its general path). `window` <= 0: none; `softcap` <= 0: none. */
int paged_decode_attention(int dtype, const void *q, int64_t q_stride, const void *k, const void *v, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, const int64_t *tables,
                           int64_t width, const int32_t *lens, int64_t num_seqs, float scale, int64_t window,
                           float softcap, void *out, int threads) {
    attention_plan plan;
    if (plan_attention(&plan, dtype, heads, kv_heads, head_dim, block_size, tables, width, lens, num_seqs, window,
                       threads))
        return 1;
#pragma omp parallel num_threads(threads) if (plan.products >= SERIAL_WORK)  /* below, a team costs more than it saves */
    attend_shared(&plan, dtype, q, q_stride, k, v, heads, head_dim, block_size, tables, width, lens, num_seqs, scale,
                  window, softcap, out);
    free_plan(&plan);
    return 0;
}

/* ---- The attention's inputs: rotary positions and the cache write, in one pass ----
   qkv [T, heads + 2 kv_heads, head_dim] float32 (a fused q/k/v product's rows): q and k
   heads rotated in place as transformers rotates them, x * cos + roll(x, head_dim / 2) *
   signed_sin (the sine's first half negated: direct_forward.py), each product and the sum
   rounded on its own as torch's three operators round them (no fused multiply-add: the
   same bits); then each token's k and v heads copied to its cache slot. cos / signed_sin
   [T, head_dim]; slots [T] int64, each below num_slots (else 1, nothing done); caches
   [num_slots, kv_heads, head_dim]. */
#define MAX_HEAD_DIM 1024
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void rotate_row(float *x, const float *cos, const float *signed_sin, int64_t head_dim, float *tmp) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) tmp[i] = x[i] * cos[i] + x[i + half] * signed_sin[i];
    for (int64_t i = half; i < head_dim; i++) tmp[i] = x[i] * cos[i] + x[i - half] * signed_sin[i];
    memcpy(x, tmp, (size_t)head_dim * sizeof(float));
}
#pragma GCC pop_options

static int rotation_takes(int64_t head_dim, const int64_t *slots, int64_t tokens, int64_t num_slots) {
    if (head_dim % 2 || head_dim > MAX_HEAD_DIM) return 0;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 0;  /* nothing written: torch's path raises */
    return 1;
}

/* The tokens' rotations and cache writes, an orphaned `omp for` (see attend_shared). */
static void rotate_and_cache_shared(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    const float *cos, const float *signed_sin, const int64_t *slots, float *k_cache,
                                    float *v_cache) {
    const int64_t width = (heads + 2 * kv_heads) * head_dim, kv_width = kv_heads * head_dim;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        float tmp[MAX_HEAD_DIM], *row = qkv + t * width;
        for (int64_t h = 0; h < heads + kv_heads; h++)
            rotate_row(row + h * head_dim, cos + t * head_dim, signed_sin + t * head_dim, head_dim, tmp);
        memcpy(k_cache + slots[t] * kv_width, row + heads * head_dim, (size_t)kv_width * sizeof(float));
        memcpy(v_cache + slots[t] * kv_width, row + (heads + kv_heads) * head_dim, (size_t)kv_width * sizeof(float));
    }
}

int rotate_and_cache(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     const float *cos, const float *signed_sin, const int64_t *slots, int64_t num_slots,
                     float *k_cache, float *v_cache, int threads) {
    if (!rotation_takes(head_dim, slots, tokens, num_slots)) return 1;
    const int64_t width = (heads + 2 * kv_heads) * head_dim;
#pragma omp parallel num_threads(threads) if (tokens * width >= SERIAL_WORK)
    rotate_and_cache_shared(qkv, tokens, heads, kv_heads, head_dim, cos, signed_sin, slots, k_cache, v_cache);
    return 0;
}
