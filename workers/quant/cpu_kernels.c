/* Products with block-quantized weights on the CPU (GGUF's Q4_0, Q4_1, Q8_0, Q4_F32 /
   Q8_F32 holding K-quants and GPTQ/AWQ weights, and F8_F32 holding FP8 checkpoints).

The weights stay in the file's blocks (32 weights each, with an fp16 scale and, for Q4_1,
an fp16 minimum): a decode step reads 4.5-8.5 bits a weight from memory instead of 32.
Two products:
- `quantized_matmul`: one row of blocks per output feature (the file's layout), each
  block widened to float32 in registers times float32 activations: the dequantized float
  product up to summation order (the output head, and `quantized_activations: float32`).
- `interleaved_matmul`: rows interleaved by 8 (packed_weights.interleave_rows), the
  activations rounded to 8 bits a block and multiplied as integers (llama.cpp's way):
  2-3x faster at every row count, with the activations' rounding.

Built by workers/quant/native_kernels.py with the host's gcc (-O3 -march=native -fopenmp);
without AVX2 the portable loops below run instead (same numbers up to float rounding).
The OpenMP runtime is torch's own (libgomp.so.1 is already loaded when this library is),
so both share one thread pool. */

#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include "../native/vector_math.h"

/* ggml's type ids, and two of our own that hold GGUF's K-quants exactly, one block of 32
   weights with float32 fields (packed_weights.py converts them at load):
   Q4_F32 (Q4_K): f32 scale d, f32 minimum m, 16 bytes of 4-bit q (Q4_1's order): w = d q + m;
   Q8_F32 (Q5_K, Q6_K): f32 scales d_lo (columns 0-15) and d_hi (16-31), f32 minimum m, 32
   signed bytes q: w = d q + m;
   F8_F32 (an FP8 checkpoint's weights): f32 scale d, 32 float8 e4m3 codes e: w = d e.
   Its codes are not integers, so it has only the float products (never interleaved). */
enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8, FMT_Q4_F32 = 103, FMT_Q8_F32 = 108, FMT_F8_F32 = 130 };
#define QK 32
#define MAX_ROWS 8  /* activation rows that share one widening of a block */

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);  /* one instruction where the CPU has it (every AVX2 x86 does) */
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {  /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7f800000 | (mant << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (mant << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float read_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }

static inline int is_q8(int fmt) { return fmt == FMT_Q8_0 || fmt == FMT_Q8_F32; }

/* An e4m3 code (sign, 4 exponent bits with bias 7, 3 mantissa bits) as the fp16 bits of
   its value / 256: the exponent and mantissa moved into fp16's fields (bias 15), so the
   8 more of bias is a factor 2^-8 for normal and subnormal codes alike. The 256 goes
   into the block's scale (exact: a power of two), so widening is one F16C conversion
   and the product d * e is rounded once, as torch's `weight.float() * scale`. */
static inline uint16_t e4m3_half_bits(uint8_t e) { return (uint16_t)(((e & 0x80) << 8) | ((e & 0x7f) << 7)); }
#define E4M3_HALF_SCALE 256.0f

/* Bytes of the scale and minimum fields ahead of a block's quants (file's row layout). */
static inline int fields_bytes(int fmt) {
    switch (fmt) {
        case FMT_Q4_1: return 4;
        case FMT_Q4_F32: return 8;
        case FMT_Q8_F32: return 12;
        case FMT_F8_F32: return 4;
        default: return 2;
    }
}

/* A row-layout block's scale for columns 0-15 and 16-31, and its minimum. */
static inline void block_fields(int fmt, const uint8_t *b, float *d_lo, float *d_hi, float *m) {
    switch (fmt) {
        case FMT_Q4_F32: *d_lo = *d_hi = read_f32(b); *m = read_f32(b + 4); return;
        case FMT_Q8_F32: *d_lo = read_f32(b); *d_hi = read_f32(b + 4); *m = read_f32(b + 8); return;
        case FMT_F8_F32: *d_lo = *d_hi = read_f32(b) * E4M3_HALF_SCALE; *m = 0.0f; return;
        default:
            *d_lo = *d_hi = half_to_float(read_u16(b));
            *m = fmt == FMT_Q4_1 ? half_to_float(read_u16(b + 2)) : fmt == FMT_Q4_0 ? -8.0f * *d_lo : 0.0f;
    }
}

static int64_t block_bytes(int fmt) {
    switch (fmt) {
        case FMT_Q4_0: return 18;
        case FMT_Q4_1: return 20;
        case FMT_Q8_0: return 34;
        case FMT_Q4_F32: return 24;
        case FMT_Q8_F32: return 44;
        case FMT_F8_F32: return 36;
        default: return -1;
    }
}

/* The 32 weights of one block as floats. */
static inline void widen_block_scalar(int fmt, const uint8_t *b, float *out) {
    float d_lo, d_hi, m;
    block_fields(fmt, b, &d_lo, &d_hi, &m);
    const uint8_t *qs = b + fields_bytes(fmt);
    if (fmt == FMT_F8_F32) {
        for (int j = 0; j < QK; j++) out[j] = d_lo * half_to_float(e4m3_half_bits(qs[j]));
        return;
    }
    if (is_q8(fmt)) {
        const int8_t *q = (const int8_t *)qs;
        for (int j = 0; j < QK; j++) out[j] = fmaf(j < QK / 2 ? d_lo : d_hi, (float)q[j], m);
        return;
    }
    for (int j = 0; j < QK / 2; j++) {
        out[j] = fmaf(d_lo, (float)(qs[j] & 0x0f), m);
        out[j + QK / 2] = fmaf(d_hi, (float)(qs[j] >> 4), m);
    }
}

#ifdef __AVX2__
static inline void widen_block(int fmt, const uint8_t *b, __m256 w[4]) {
    float d_lo, d_hi, m_scalar;
    block_fields(fmt, b, &d_lo, &d_hi, &m_scalar);
    const __m256 lo_d = _mm256_set1_ps(d_lo), hi_d = _mm256_set1_ps(d_hi), m = _mm256_set1_ps(m_scalar);
    const uint8_t *qs = b + fields_bytes(fmt);
    if (fmt == FMT_F8_F32) {
        for (int half = 0; half < 2; half++) {
            __m256i e = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * half)));
            __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(e, _mm256_set1_epi16(0x80)), 8),
                                           _mm256_slli_epi16(_mm256_and_si256(e, _mm256_set1_epi16(0x7f)), 7));
            w[2 * half] = _mm256_mul_ps(lo_d, _mm256_cvtph_ps(_mm256_castsi256_si128(bits)));
            w[2 * half + 1] = _mm256_mul_ps(lo_d, _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)));
        }
        return;
    }
    if (is_q8(fmt)) {
        __m256i q = _mm256_loadu_si256((const __m256i *)qs);
        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        w[0] = _mm256_fmadd_ps(lo_d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), m);
        w[1] = _mm256_fmadd_ps(lo_d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), m);
        w[2] = _mm256_fmadd_ps(hi_d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), m);
        w[3] = _mm256_fmadd_ps(hi_d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), m);
        return;
    }
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w[0] = _mm256_fmadd_ps(lo_d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(lo_d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(hi_d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(hi_d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
}

/* The 32 weights of one block into dst (the AVX2 widening stored). */
static inline void widen_block_to(int fmt, const uint8_t *b, float *dst) {
    __m256 v[4];
    widen_block(fmt, b, v);
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(dst + 8 * k, v[k]);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r * ldy] = row . x[r * K ...] for `rows` (<= MAX_ROWS) activation rows; `rows` is a
   constant at each call site below, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_rows(int fmt, const uint8_t *row, int64_t nblocks,
                                                           int64_t bb, const float *x, int64_t K, int rows,
                                                           float *y, int64_t ldy) {
    __m256 acc[MAX_ROWS], w[4];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        widen_block(fmt, row + b * bb, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * K + b * QK;
            acc[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[r]);
            acc[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = hsum(acc[r]);
}

#else
#define widen_block_to widen_block_scalar
#endif


/* ---- Activations quantized to 8 bits per block (llama.cpp's Q8 dot products) ----
   Each activation row is cut into blocks of 32 with a float scale (absmax / 127) and the
   block's sum; a weight block times an activation block is then an integer dot product
   (u8 x s8 pairs, `maddubs`) and one FMA, far fewer instructions than widening every
   weight to float, on loops that are compute-bound on 2 cores. The price is the
   activations' rounding (relative error <= 1/254 per value), as in llama.cpp. */

typedef struct { float scale, sum; } act_block;  /* sum = scale * sum of the quantized values */

/* One block of 32 floats -> 32 int8 (rounded to nearest, ties to even: the same in both
   versions below) and its act_block. */
#ifdef __AVX2__
static inline act_block quantize_block(const float *src, int8_t *dst) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(src + 8 * k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float scale = _mm_cvtss_f32(m4) / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
    __m256i q[4];
    for (int k = 0; k < 4; k++)
        q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
    /* packs work within 128-bit lanes: the permute puts the 32 bytes back in order */
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst, packed);
    return (act_block){scale, scale * (float)_mm_cvtsi128_si32(t4)};
}
#else
static inline act_block quantize_block(const float *src, int8_t *dst) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) { float a = fabsf(src[j]); if (a > amax) amax = a; }
    float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        int q = (int)nearbyintf(src[j] * inv);  /* the default rounding: to nearest, ties to even */
        dst[j] = (int8_t)q;
        sum += q;
    }
    return (act_block){scale, scale * (float)sum};
}
#endif

/* ---- What is done to an activation row before its rounding, fused into the product ----
   A decode step of a small model is mostly small operators between the products (a norm,
   an activation, an add: microseconds of dispatch each, whatever the batch); done here, a
   layer's MLP or attention input is one call. RMSNorm as transformers' LlamaRMSNorm in
   float32 (x / sqrt(mean(x^2) + eps), times the weight); a gated MLP's silu(gate) * up,
   the row holding gate then up (2K floats). Each row on its own, in a fixed order: a row's
   result still does not depend on its batch. */
enum { PROLOGUE_NONE = 0, PROLOGUE_RMS_NORM = 1, PROLOGUE_SILU_GATE = 2 };
typedef struct { int kind; const float *weight; float eps; int64_t ldx; } prologue;

static void rms_norm_row(const float *x, int64_t K, const float *weight, float eps, float *out) {
    float partial[8] = {0};
    for (int64_t i = 0; i < K; i += 8)  /* K is whole blocks of 32 */
        for (int j = 0; j < 8; j++) partial[j] += x[i + j] * x[i + j];
    float sum = ((partial[0] + partial[4]) + (partial[1] + partial[5])) +
                ((partial[2] + partial[6]) + (partial[3] + partial[7]));
    float inv = 1.0f / sqrtf(sum / (float)K + eps);
    for (int64_t i = 0; i < K; i++) out[i] = weight[i] * (x[i] * inv);
}

/* silu(g) = g * sigmoid(g), the sigmoid from e^-|g| (never overflows): 1 / (1 + e) for
   g >= 0, e / (1 + e) below. */
static void silu_gate_row(const float *x, int64_t K, float *out) {
    const float *gate = x, *up = x + K;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= K; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i), e = exp8(_mm256_or_ps(g, sign));
        __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < K; i++) {
        float g = gate[i], e = expf(-fabsf(g));
        out[i] = g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * up[i];
    }
}

/* Row i of the product's input: x's row (ldx floats apart) after the prologue, in `buffer`
   when one runs. */
static inline const float *input_row(const float *x, int64_t i, int64_t K, const prologue *pro, float *buffer) {
    const float *row = x + i * pro->ldx;
    switch (pro->kind) {
        case PROLOGUE_RMS_NORM: rms_norm_row(row, K, pro->weight, pro->eps, buffer); return buffer;
        case PROLOGUE_SILU_GATE: silu_gate_row(row, K, buffer); return buffer;
        default: return row;
    }
}

/* x (M rows) -> xq (M * levels rows of K int8) and meta (M * levels x K/32). With two
   levels, row 2i holds x's row i rounded and row 2i+1 what that rounding left out (the
   residual, rounded with its own scale): their sum is within ~1e-4 of x, relative.
   `buffer`: K floats for a row after its prologue. */
static void quantize_activations(const float *x, int64_t M, int64_t K, int levels, int8_t *xq, act_block *meta,
                                 const prologue *pro, float *buffer) {
    int64_t nblocks = K / QK;
    float residual[QK];
    for (int64_t i = 0; i < M; i++) {
        const float *row = input_row(x, i, K, pro, buffer);
        for (int64_t b = 0; b < nblocks; b++) {
            const float *src = row + b * QK;
            int64_t row = i * levels;
            int8_t *q = xq + row * K + b * QK;
            act_block first = meta[row * nblocks + b] = quantize_block(src, q);
            if (levels == 2) {
                for (int j = 0; j < QK; j++) residual[j] = src[j] - first.scale * (float)q[j];
                meta[(row + 1) * nblocks + b] = quantize_block(residual, xq + (row + 1) * K + b * QK);
            }
        }
    }
}

/* One weight row against up to MAX_ROWS activation rows; one specialized loop per row
   count (the accumulators stay in registers). */
static void dot_tile(int fmt, const uint8_t *row, int64_t nblocks, int64_t bb, const float *x, int64_t K, int rows,
                     float *y, int64_t ldy) {
#ifdef __AVX2__
#define ROWS_CASE(R) case R: dot_rows(fmt, row, nblocks, bb, x, K, R, y, ldy); return;
    switch (rows) { ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
                    default: ROWS_CASE(8) }
#undef ROWS_CASE
#else
    float w[QK], acc[MAX_ROWS] = {0};
    for (int64_t b = 0; b < nblocks; b++) {
        widen_block_scalar(fmt, row + b * bb, w);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < QK; j++) acc[r] += w[j] * x[r * K + b * QK + j];
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = acc[r];
#endif
}

/* y (M x N, row-major) = x (M x K) times the transpose of the N x K weight `w`, on
   `threads` threads (torch's count, passed in: the engine thread's OpenMP default may be
   Ray's OMP_NUM_THREADS=1). Returns 0, or -1 for an unknown format or a K that is not
   whole blocks. */
int quantized_matmul(int fmt, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                     int threads) {
    int64_t bb = block_bytes(fmt);
    if (bb < 0 || K % QK) return -1;
    int64_t nblocks = K / QK, row_bytes = nblocks * bb;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            int rows = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
            dot_tile(fmt, w + n * row_bytes, nblocks, bb, x + m0 * K, K, rows, y + m0 * N + n, N);
        }
    }
    return 0;
}

/* ---- Weight rows interleaved by 8: the 8-bit GEMM for any number of activation rows ----
   packed_weights.interleave_rows lays the weight out in groups of 8 rows (GROUP_ROWS); for
   each group, each block of 32 columns takes 8 x the format's block bytes:
     Q4_0: the 8 rows' fp16 scales (16 bytes), then 4 x 32 bytes of quants;
     Q4_1: the 8 scales, the 8 fp16 minimums (16 bytes), then 4 x 32 bytes of quants;
     Q8_0: the 8 scales, then 8 x 32 bytes of quants;
     Q4_F32 / Q8_F32: the 8 rows' float32 fields (32 bytes each) in their row order, then
     the runs as for Q4 / Q8_0.
   In a 32-byte run of quants, bytes 4r..4r+3 belong to row r: for Q4 run i holds the
   file's bytes 4i..4i+3 of each row's block (low nibbles: columns 4i..4i+3, high nibbles:
   columns 16+4i..16+4i+3); for Q8_0 run g holds columns 4g..4g+3. So one `maddubs` of a
   run against 4 activation bytes broadcast to every lane gives partial sums of 8
   different output features at once: no horizontal sums, and a block widened once serves
   GEMM_ROWS activation rows (llama.cpp's repacked Q4_0x8 layout is the same idea).
   Each output is computed from its own activation row and weight row in a fixed order
   (integer sums within a block, then one FMA a block), whatever the other rows of the
   call: a row's result does not depend on the batch it is in. */
#define GROUP_ROWS 8
#define GEMM_ROWS 4
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif
#define RUN_BYTES 4  /* a row's bytes in each 32-byte run */

/* Every row rounded, shared by the calling team's threads: an orphaned `omp for`, so a
   caller inside a parallel region splits the rows over its team (cpu_decoder.c's layers)
   and one outside it does them all. `buffers`: K floats for each task of ROUNDING_ROWS rows. */
#define ROUNDING_ROWS 16
static void quantize_activations_shared(const float *x, int64_t M, int64_t K, int levels, int8_t *xq,
                                        act_block *meta, const prologue *pro, float *buffers) {
    #pragma omp for schedule(static)
    for (int64_t m0 = 0; m0 < M; m0 += ROUNDING_ROWS) {
        int64_t rows = M - m0 < ROUNDING_ROWS ? M - m0 : ROUNDING_ROWS;
        quantize_activations(x + m0 * pro->ldx, rows, K, levels, xq + m0 * levels * K,
                             meta + m0 * levels * (K / QK), pro, buffers + m0 / ROUNDING_ROWS * K);
    }
}

/* Row `lane` of an interleaved block put back in the file's row layout (`out`: the
   format's block bytes): each field is 8 values, one a row; each 32-byte run of quants
   holds 4 bytes of each row. The portable loops and the embedding's row lookups read
   blocks this way, through the row layout's own widening. */
static inline void lane_block(int fmt, const uint8_t *blk, int lane, uint8_t *out) {
    int width = fmt == FMT_Q4_F32 || fmt == FMT_Q8_F32 ? 4 : 2, fields = fields_bytes(fmt);
    for (int f = 0; f < fields / width; f++) memcpy(out + f * width, blk + (f * GROUP_ROWS + lane) * width, width);
    const uint8_t *runs = blk + GROUP_ROWS * fields;
    for (int run = 0; run < (int)(block_bytes(fmt) - fields) / RUN_BYTES; run++)
        memcpy(out + fields + RUN_BYTES * run, runs + QK * run + RUN_BYTES * lane, RUN_BYTES);
}

/* Column `col`'s integer quant of a row-layout block. */
static inline int block_quant(int fmt, const uint8_t *b, int col) {
    const uint8_t *qs = b + fields_bytes(fmt);
    if (is_q8(fmt)) return ((const int8_t *)qs)[col];
    return col < QK / 2 ? (qs[col] & 0x0f) : (qs[col - QK / 2] >> 4);
}

#if defined(__AVX2__) && defined(__F16C__)
static inline __m256i broadcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

/* Pins `v` to a register at this point. gcc otherwise reassociates a row's chain of int16
   additions into all the products first, spilling them to the stack (2x slower). */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

/* acc + the sums of each 32-bit lane's 4 u8 x s8 products, in int32: one VNNI instruction
   where the CPU has it (AVX-VNNI, or AVX512-VNNI with VL: Ice Lake, Sapphire Rapids, Zen 4),
   else maddubs (pairs into int16) and madd (pairs of those into int32). Integer sums: the
   same numbers either way (no int16 pair saturates: |w| <= 127 and |x| <= 127, or u4 x s8). */
#if defined(__AVXVNNI__)
#define VNNI 1
static inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u, s8); }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
static inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s8) { return _mm256_dpbusd_epi32(acc, u, s8); }
#else
#define VNNI 0
static inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s8) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s8), _mm256_set1_epi16(1)));
}
#endif

/* An interleaved block's 8 rows' scales (columns 0-15 and 16-31) and minimums. */
static inline void group_fields(int fmt, const uint8_t *blk, __m256 *d_lo, __m256 *d_hi, __m256 *m) {
    switch (fmt) {
        case FMT_Q4_F32: *d_lo = *d_hi = _mm256_loadu_ps((const float *)blk); *m = _mm256_loadu_ps((const float *)(blk + 32)); return;
        case FMT_Q8_F32:
            *d_lo = _mm256_loadu_ps((const float *)blk);
            *d_hi = _mm256_loadu_ps((const float *)(blk + 32));
            *m = _mm256_loadu_ps((const float *)(blk + 64));
            return;
        default:
            *d_lo = *d_hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            *m = fmt == FMT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
               : fmt == FMT_Q4_0 ? _mm256_mul_ps(*d_lo, _mm256_set1_ps(-8.0f)) : _mm256_setzero_ps();
    }
}

/* y[r * ldy + 0..7] = the group's 8 rows . quantized activation row r, for `rows` (<=
   GEMM_ROWS) rows, or with two levels the sum of rows 2r and 2r+1; `rows` and `levels`
   are constants at each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void group_rows_q8(int fmt, const uint8_t *group, int64_t nblocks,
                                                                const int8_t *xq, const act_block *meta,
                                                                int64_t K, int rows, int levels, float *y,
                                                                int64_t ldy, int accumulate) {
    const int64_t gbb = GROUP_ROWS * block_bytes(fmt);
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0f);
    __m256 acc[GEMM_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *blk = group + b * gbb, *qs = blk + GROUP_ROWS * fields_bytes(fmt);
        for (int64_t line = 0; line < gbb; line += 64) _mm_prefetch((const char *)(blk + PREFETCH_BYTES + line), _MM_HINT_T0);
        __m256 d, d_hi, m;
        group_fields(fmt, blk, &d, &d_hi, &m);
        if (is_q8(fmt)) {
            for (int r = 0; r < rows; r++) {
                const int8_t *xb = xq + r * K + b * QK;
                const act_block *a = meta + r * nblocks + b;
                __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  /* columns 0-15, 16-31 */
                for (int g = 0; g < 8; g++) {  /* |w| x (x * sign w): u8 x s8 pairs stay within int16 */
                    __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
                    sum[g / 4] = dot4_add(sum[g / 4], _mm256_sign_epi8(w, w), _mm256_sign_epi8(broadcast4(xb + 4 * g), w));
                }
                __m256 scale = _mm256_set1_ps(a->scale);
                if (fmt == FMT_Q8_0) {  /* one scale a block, no minimum */
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, scale), _mm256_cvtepi32_ps(_mm256_add_epi32(sum[0], sum[1])),
                                             acc[r]);
                    continue;
                }
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, scale), _mm256_cvtepi32_ps(sum[0]), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d_hi, scale), _mm256_cvtepi32_ps(sum[1]), acc[r]);
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->sum), acc[r]);
            }
            continue;
        }
        /* Each run is widened once into its low and high nibbles and taken by every row in
           turn; the rows' int16 sums of 8 products of u8 <= 15 and |s8| <= 127 pairs stay
           <= 30480. (Widening all 8 runs first would spill registers.) */
        __m256i s[GEMM_ROWS];  /* int32 lanes with VNNI, int16 pairs without */
        for (int r = 0; r < rows; r++) s[r] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for (int r = 0; r < rows; r++) {
                const int8_t *xb = xq + r * K + b * QK + 4 * i;
#if VNNI
                s[r] = dot4_add(dot4_add(s[r], lo, broadcast4(xb)), hi, broadcast4(xb + 16));
#else
                s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, broadcast4(xb)));
                s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, broadcast4(xb + 16)));
#endif
                IN_REGISTER(s[r]);
            }
        }
        for (int r = 0; r < rows; r++) {
            const act_block *a = meta + r * nblocks + b;
            __m256i sums = VNNI ? s[r] : _mm256_madd_epi16(s[r], ones);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a->scale)), _mm256_cvtepi32_ps(sums), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->sum), acc[r]);  /* minimum (Q4_0: -8 d) x sum of x */
        }
    }
    for (int r = 0; r < rows; r += levels) {  /* y = the sum (y + the sum when accumulating: a residual add) */
        float *out = y + r / levels * ldy;
        __m256 sum = levels == 2 ? _mm256_add_ps(acc[r], acc[r + 1]) : acc[r];
        _mm256_storeu_ps(out, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out), sum) : sum);
    }
}
#else
static void group_rows_portable(int fmt, const uint8_t *group, int64_t nblocks, const int8_t *xq,
                                const act_block *meta, int64_t K, int rows, int levels, float *y, int64_t ldy,
                                int accumulate) {
    const int64_t gbb = GROUP_ROWS * block_bytes(fmt);
    float first[GROUP_ROWS] = {0};  /* with two levels, the first row's sums */
    for (int r = 0; r < rows; r++) {
        float acc[GROUP_ROWS] = {0};
        for (int64_t b = 0; b < nblocks; b++) {
            const act_block *a = meta + r * nblocks + b;
            for (int lane = 0; lane < GROUP_ROWS; lane++) {
                uint8_t row[64];
                lane_block(fmt, group + b * gbb, lane, row);
                int sum[2] = {0, 0};  /* columns 0-15, 16-31 */
                for (int col = 0; col < QK; col++) sum[col / 16] += block_quant(fmt, row, col) * xq[r * K + b * QK + col];
                float d_lo, d_hi, m;
                block_fields(fmt, row, &d_lo, &d_hi, &m);
                acc[lane] += d_lo * a->scale * (float)sum[0] + d_hi * a->scale * (float)sum[1] + m * a->sum;
            }
        }
        if (levels == 2 && r % 2 == 0) {
            memcpy(first, acc, sizeof(first));
            continue;
        }
        float *out = y + r / levels * ldy;
        for (int lane = 0; lane < GROUP_ROWS; lane++) {
            float sum = levels == 2 ? first[lane] + acc[lane] : acc[lane];
            out[lane] = accumulate ? out[lane] + sum : sum;
        }
    }
}
#endif

static void group_tile(int fmt, const uint8_t *group, int64_t nblocks, const int8_t *xq, const act_block *meta,
                       int64_t K, int rows, int levels, float *y, int64_t ldy, int accumulate) {
#if defined(__AVX2__) && defined(__F16C__)
    /* format, row count and levels constant in each case: one specialized loop each (two
       levels come in whole pairs of rows) */
#define GROUP_CASE(F, R, L) case R: group_rows_q8(F, group, nblocks, xq, meta, K, R, L, y, ldy, accumulate); return;
#define GROUP_FORMAT(F) case F: \
        if (levels == 2) { switch (rows) { GROUP_CASE(F, 2, 2) default: GROUP_CASE(F, 4, 2) } } \
        switch (rows) { GROUP_CASE(F, 1, 1) GROUP_CASE(F, 2, 1) GROUP_CASE(F, 3, 1) default: GROUP_CASE(F, 4, 1) }
    switch (fmt) { GROUP_FORMAT(FMT_Q4_0) GROUP_FORMAT(FMT_Q4_1) GROUP_FORMAT(FMT_Q4_F32) GROUP_FORMAT(FMT_Q8_F32)
                   default: GROUP_FORMAT(FMT_Q8_0) }
#undef GROUP_FORMAT
#undef GROUP_CASE
#else
    group_rows_portable(fmt, group, nblocks, xq, meta, K, rows, levels, y, ldy, accumulate);
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && VNNI
/* Two adjacent groups (16 output features) at once in 512-bit registers where the CPU has
   AVX-512 VNNI: each group's runs, scales and minimums fill one half of a register, so every
   instruction does the work of two of group_rows_q8's, and each lane takes exactly the
   integer sums and FMAs that group_rows_q8 gives its feature (the products' numbers do not
   change with the machine's vector width or the batch). */
#define PAIRED_GROUPS 1
static inline __m512 join_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m512i join_si(const uint8_t *lo, const uint8_t *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}
static inline __m512i broadcast4_512(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

/* group_fields of a pair's two blocks (the second `group_bytes` after the first), side by side. */
static inline void pair_fields(int fmt, const uint8_t *blk, int64_t group_bytes, __m512 *d, __m512 *d_hi, __m512 *m) {
    __m256 d1, d1_hi, m1, d2, d2_hi, m2;
    group_fields(fmt, blk, &d1, &d1_hi, &m1);
    group_fields(fmt, blk + group_bytes, &d2, &d2_hi, &m2);
    *d = join_ps(d1, d2);
    *d_hi = join_ps(d1_hi, d2_hi);
    *m = join_ps(m1, m2);
}

static inline __attribute__((always_inline)) void group_pair_rows_q8(int fmt, const uint8_t *group, int64_t group_bytes,
                                                                     int64_t nblocks, const int8_t *xq,
                                                                     const act_block *meta, int64_t K, int rows,
                                                                     int levels, float *y, int64_t ldy, int accumulate) {
    const int64_t gbb = GROUP_ROWS * block_bytes(fmt);
    const __m512i mask = _mm512_set1_epi8(0x0f);
    __m512 acc[GEMM_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *blk = group + b * gbb, *blk2 = blk + group_bytes;
        const uint8_t *qs = blk + GROUP_ROWS * fields_bytes(fmt), *qs2 = blk2 + GROUP_ROWS * fields_bytes(fmt);
        for (int64_t line = 0; line < gbb; line += 64) {
            _mm_prefetch((const char *)(blk + PREFETCH_BYTES + line), _MM_HINT_T0);
            _mm_prefetch((const char *)(blk2 + PREFETCH_BYTES + line), _MM_HINT_T0);
        }
        __m512 d, d_hi, m;
        pair_fields(fmt, blk, group_bytes, &d, &d_hi, &m);
        if (is_q8(fmt)) {
            for (int r = 0; r < rows; r++) {
                const int8_t *xb = xq + r * K + b * QK;
                const act_block *a = meta + r * nblocks + b;
                __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  /* columns 0-15, 16-31 */
                for (int g = 0; g < 8; g++) {  /* |w| x (x * sign w), as group_rows_q8 (w = 0 gives 0 either way) */
                    __m512i w = join_si(qs + 32 * g, qs2 + 32 * g), x = broadcast4_512(xb + 4 * g);
                    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
                    sum[g / 4] = _mm512_dpbusd_epi32(sum[g / 4], _mm512_abs_epi8(w), x);
                }
                __m512 scale = _mm512_set1_ps(a->scale);
                if (fmt == FMT_Q8_0) {
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, scale), _mm512_cvtepi32_ps(_mm512_add_epi32(sum[0], sum[1])),
                                             acc[r]);
                    continue;
                }
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, scale), _mm512_cvtepi32_ps(sum[0]), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d_hi, scale), _mm512_cvtepi32_ps(sum[1]), acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->sum), acc[r]);
            }
            continue;
        }
        __m512i s[GEMM_ROWS];
        for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            __m512i v = join_si(qs + 32 * i, qs2 + 32 * i);
            __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            for (int r = 0; r < rows; r++) {
                const int8_t *xb = xq + r * K + b * QK + 4 * i;
                s[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r], lo, broadcast4_512(xb)), hi, broadcast4_512(xb + 16));
                IN_REGISTER(s[r]);
            }
        }
        for (int r = 0; r < rows; r++) {
            const act_block *a = meta + r * nblocks + b;
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a->scale)), _mm512_cvtepi32_ps(s[r]), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->sum), acc[r]);
        }
    }
    for (int r = 0; r < rows; r += levels) {  /* the two groups' outputs are adjacent: 16 floats */
        float *out = y + r / levels * ldy;
        __m512 sum = levels == 2 ? _mm512_add_ps(acc[r], acc[r + 1]) : acc[r];
        _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), sum) : sum);
    }
}

static void group_pair_tile(int fmt, const uint8_t *group, int64_t group_bytes, int64_t nblocks, const int8_t *xq,
                            const act_block *meta, int64_t K, int rows, int levels, float *y, int64_t ldy,
                            int accumulate) {
#define PAIR_CASE(F, R, L) case R: group_pair_rows_q8(F, group, group_bytes, nblocks, xq, meta, K, R, L, y, ldy, \
                                                      accumulate); return;
#define PAIR_FORMAT(F) case F: \
        if (levels == 2) { switch (rows) { PAIR_CASE(F, 2, 2) default: PAIR_CASE(F, 4, 2) } } \
        switch (rows) { PAIR_CASE(F, 1, 1) PAIR_CASE(F, 2, 1) PAIR_CASE(F, 3, 1) default: PAIR_CASE(F, 4, 1) }
    switch (fmt) { PAIR_FORMAT(FMT_Q4_0) PAIR_FORMAT(FMT_Q4_1) PAIR_FORMAT(FMT_Q4_F32) PAIR_FORMAT(FMT_Q8_F32)
                   default: PAIR_FORMAT(FMT_Q8_0) }
#undef PAIR_FORMAT
#undef PAIR_CASE
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* ---- AMX tiles (Sapphire Rapids and later Xeons) for a group pair over many rows ----
   One tile multiply takes a block of 32 columns for 16 activation rows and the pair's 16
   output features at once (llama.cpp's AMX kernels use the same 16 x 16 x 32 shape, as
   GGUF's scales change every 32 columns): A = the rows' 8-bit values (16 x 32 bytes, read
   in place), B = the block's 8 runs as 16 features x 4 columns each (the interleaved
   layout's runs are that already, once Q4's nibbles are split), C = 16 x 16 int32 sums.
   The sums are the same integers the VNNI loop adds, and each row's scale and minimum go
   in with the same FMAs in the same order: the very same floats, whatever the number of
   rows, so a row's result still does not depend on its batch. Worth it from AMX_MIN_ROWS
   8-bit rows on (the default model's Q4_1 products at 8: about even with the VNNI loop's
   register tiles; at 16, 1.2-1.3x; at 128, 1.4-1.5x; its Q8_0 head 1.8-1.9x from 16). */
#define AMX_TILES 1
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8
#endif
#define AMX_ROWS 16
#define AMX_PANEL_ROWS 128  /* 8-bit rows a panel: 128 x K bytes, in L2 for K up to ~8,000 */
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Tile registers (gcc's intrinsics paste the numbers into the instruction: literals only):
   two blocks in flight, so one block's sums are stored and scaled while the next multiplies. */
#define TILE_A0 0
#define TILE_A1 1
#define TILE_B0 2
#define TILE_B1 3
#define TILE_C0 4
#define TILE_C1 5

/* Linux lends a process the tile registers only once it asks (arch_prctl); asked once. */
static int amx_permitted(void) {
    static int state = 0;  /* 0: not asked yet, 1: lent, -1: refused */
    int seen = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (seen == 0) {
        seen = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, seen, __ATOMIC_RELEASE);
    }
    return seen == 1;
}

static int amx_takes(int fmt) {
    return fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_Q4_F32 || fmt == FMT_Q8_0 || fmt == FMT_Q8_F32;
}

/* From how many 8-bit rows the tiles beat the VNNI loop: a Q8_F32 block takes two multiplies
   (3072 x 1536 Q6_K at int8x2: 4 rows 0.27 VNNI vs 0.33 ms, 8 rows 0.48 vs 0.45, 64 rows 3.13 vs
   2.04; the Xeon of 2026-11-29). */
static int amx_min_rows(int fmt) { return fmt == FMT_Q8_F32 ? 2 * AMX_MIN_ROWS : AMX_MIN_ROWS; }

/* Columns a tile multiply takes: a block, or half of one for Q8_F32 (Q6_K's rewrite), whose
   two halves have scales of their own. */
static int amx_columns(int fmt) { return fmt == FMT_Q8_F32 ? QK / 2 : QK; }

/* The tile shapes for tiles of `rows` activation rows. The configuration is the thread's
   state, and oneDNN's own AMX kernels (torch's bfloat16 products) load theirs on the same
   threads between our calls: loaded at each call's first tile, and when `rows` changes. */
static void load_tile_shapes(int rows, int columns) {
    /* Thread-local, not on the stack: gcc's _tile_loadconfig tells the compiler it reads 8
       bytes, so the stores to a local's other fields were dropped as dead. */
    static __thread struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; }
        __attribute__((aligned(64))) shapes;
    memset(&shapes, 0, sizeof shapes);
    shapes.palette = 1;
    for (int t = TILE_A0; t <= TILE_A1; t++) { shapes.rows[t] = rows; shapes.colsb[t] = columns; }
    for (int t = TILE_B0; t <= TILE_B1; t++) { shapes.rows[t] = columns / 4; shapes.colsb[t] = 64; }
    for (int t = TILE_C0; t <= TILE_C1; t++) { shapes.rows[t] = rows; shapes.colsb[t] = 64; }
    _tile_loadconfig(&shapes);
}

/* The pair's block as tile B (`out`: 8 rows of 64 bytes; rows 0-3 columns 0-15, rows 4-7
   columns 16-31): Q8's 8 runs as they are; Q4's 4 runs' low nibbles then their high nibbles. */
static inline void pair_block_tile(int fmt, const uint8_t *qs, const uint8_t *qs2, uint8_t *out) {
    if (is_q8(fmt)) {
        for (int g = 0; g < 8; g++) _mm512_store_si512((__m512i *)(out + 64 * g), join_si(qs + 32 * g, qs2 + 32 * g));
        return;
    }
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < 4; i++) {
        __m512i v = join_si(qs + 32 * i, qs2 + 32 * i);
        _mm512_store_si512((__m512i *)(out + 64 * i), _mm512_and_si512(v, mask));
        _mm512_store_si512((__m512i *)(out + 64 * (4 + i)), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
}

/* Every block of a group pair as tile B, in this thread's buffer (kept between calls; NULL
   when it cannot grow). */
static uint8_t *pair_tiles(int fmt, const uint8_t *group, int64_t group_bytes, int64_t nblocks) {
    static __thread uint8_t *buffer;
    static __thread int64_t capacity;
    const int64_t bytes = nblocks * 8 * 64, gbb = GROUP_ROWS * block_bytes(fmt), fields = GROUP_ROWS * fields_bytes(fmt);
    if (bytes > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, bytes);
        capacity = buffer ? bytes : 0;
        if (!buffer) return NULL;
    }
    for (int64_t b = 0; b < nblocks; b++)
        pair_block_tile(fmt, group + b * gbb + fields, group + group_bytes + b * gbb + fields, buffer + b * 8 * 64);
    return buffer;
}

/* acc[r] for `rows` rows after block b's sums (row r's 16 int32 at sums + 16 r; for Q8_F32
   the block's first half there and its second at hi + 16 r): group_pair_rows_q8's FMAs, in
   its order. */
static inline __attribute__((always_inline)) void pair_block_fmas(int fmt, const uint8_t *group, int64_t group_bytes,
                                                                  const int32_t *sums, const int32_t *hi,
                                                                  const act_block *meta, int64_t nblocks, int64_t b,
                                                                  int rows, __m512 *acc) {
    __m512 d, d_hi, m;
    pair_fields(fmt, group + b * GROUP_ROWS * block_bytes(fmt), group_bytes, &d, &d_hi, &m);
    for (int r = 0; r < rows; r++) {
        const act_block *a = meta + r * nblocks + b;
        const __m512 scale = _mm512_set1_ps(a->scale);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, scale), _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r)), acc[r]);
        if (fmt == FMT_Q8_F32)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d_hi, scale), _mm512_cvtepi32_ps(_mm512_load_si512(hi + 16 * r)),
                                     acc[r]);
        if (fmt != FMT_Q8_0) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->sum), acc[r]);
    }
}

/* The sums of the rows' columns from `column` on (as many as the loaded shape takes)
   against B's rows from `tile` on, into C. */
#define TILE_SUMS(C, A, B, column, tile)                                                 \
    do {                                                                                \
        _tile_zero(C);                                                                  \
        _tile_loadd(A, xq + (column), K);                                               \
        _tile_loadd(B, (tile), 64);                                                     \
        if (is_q8(fmt)) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B);              \
    } while (0)
/* Block b's sums (a whole block a multiply) into C. */
#define BLOCK_SUMS(C, A, B, b) TILE_SUMS(C, A, B, (b) * QK, tiles + (b) * 8 * 64)

/* Q8_F32's pair_rows_amx: each block's two halves (columns 0-15 and 16-31) a multiply each,
   then group_pair_rows_q8's FMAs (the low half's scale, the high half's, the minimum). */
static inline __attribute__((always_inline)) void split_rows_amx(const uint8_t *group, int64_t group_bytes,
                                                                 const uint8_t *tiles, int64_t nblocks,
                                                                 const int8_t *xq, const act_block *meta, int64_t K,
                                                                 int rows, __m512 *acc) {
    const int fmt = FMT_Q8_F32;
    int32_t sums[2][AMX_ROWS * 16] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *tile = tiles + b * 8 * 64;
        TILE_SUMS(TILE_C0, TILE_A0, TILE_B0, b * QK, tile);
        TILE_SUMS(TILE_C1, TILE_A1, TILE_B1, b * QK + QK / 2, tile + 4 * 64);
        _tile_stored(TILE_C0, sums[0], 64);
        _tile_stored(TILE_C1, sums[1], 64);
        pair_block_fmas(fmt, group, group_bytes, sums[0], sums[1], meta, nblocks, b, rows, acc);
    }
}

/* The other formats' blocks, a whole block a multiply, two blocks in flight: acc[r] as
   group_pair_rows_q8 leaves it. */
static inline __attribute__((always_inline)) void whole_rows_amx(int fmt, const uint8_t *group, int64_t group_bytes,
                                                                 const uint8_t *tiles, int64_t nblocks,
                                                                 const int8_t *xq, const act_block *meta, int64_t K,
                                                                 int rows, __m512 *acc) {
    int32_t sums[2][AMX_ROWS * 16] __attribute__((aligned(64)));
    int64_t b = 0;
    for (; b + 1 < nblocks; b += 2) {
        BLOCK_SUMS(TILE_C0, TILE_A0, TILE_B0, b);
        BLOCK_SUMS(TILE_C1, TILE_A1, TILE_B1, b + 1);
        _tile_stored(TILE_C0, sums[0], 64);
        _tile_stored(TILE_C1, sums[1], 64);
        pair_block_fmas(fmt, group, group_bytes, sums[0], NULL, meta, nblocks, b, rows, acc);
        pair_block_fmas(fmt, group, group_bytes, sums[1], NULL, meta, nblocks, b + 1, rows, acc);
    }
    if (b < nblocks) {
        BLOCK_SUMS(TILE_C0, TILE_A0, TILE_B0, b);
        _tile_stored(TILE_C0, sums[0], 64);
        pair_block_fmas(fmt, group, group_bytes, sums[0], NULL, meta, nblocks, b, rows, acc);
    }
}

/* `rows` (<= AMX_ROWS, the loaded shape) 8-bit rows against the pair's 16 features, whose
   blocks are `tiles`: y's rows (rows / levels of them) get the pair's 16 outputs. */
static inline __attribute__((always_inline)) void pair_rows_amx(int fmt, const uint8_t *group, int64_t group_bytes,
                                                                const uint8_t *tiles, int64_t nblocks,
                                                                const int8_t *xq, const act_block *meta, int64_t K,
                                                                int rows, int levels, float *y, int64_t ldy,
                                                                int accumulate) {
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    if (fmt == FMT_Q8_F32) split_rows_amx(group, group_bytes, tiles, nblocks, xq, meta, K, rows, acc);
    else whole_rows_amx(fmt, group, group_bytes, tiles, nblocks, xq, meta, K, rows, acc);
    for (int r = 0; r < rows; r += levels) {
        float *out = y + r / levels * ldy;
        __m512 sum = levels == 2 ? _mm512_add_ps(acc[r], acc[r + 1]) : acc[r];
        _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), sum) : sum);
    }
}
#undef BLOCK_SUMS
#undef TILE_SUMS
#else
#define AMX_TILES 0
#endif
#else
#define PAIRED_GROUPS 0
#define AMX_TILES 0
#endif

#if AMX_TILES
/* A tile's rows through the VNNI loop, GEMM_ROWS at a time: a pair (`paired`), or an odd last group. */
static void rows_without_tiles(int fmt, const uint8_t *group, int64_t group_bytes, int paired, int64_t nblocks,
                               const int8_t *xq, const act_block *meta, int64_t K, int rows, int levels, float *y,
                               int64_t ldy, int accumulate) {
    for (int r0 = 0; r0 < rows; r0 += GEMM_ROWS) {
        const int n = rows - r0 < GEMM_ROWS ? rows - r0 : GEMM_ROWS;
        const int8_t *x = xq + r0 * K;
        const act_block *m = meta + r0 * nblocks;
        float *out = y + r0 / levels * ldy;
        if (paired) group_pair_tile(fmt, group, group_bytes, nblocks, x, m, K, n, levels, out, ldy, accumulate);
        else group_tile(fmt, group, nblocks, x, m, K, n, levels, out, ldy, accumulate);
    }
}

/* interleaved_product_shared's tiles through AMX: each group pair against each tile of
   AMX_ROWS 8-bit rows (an odd last group, or a pair whose tiles find no memory, through the
   VNNI loop). An orphaned `omp for`. */
static void amx_product_shared(int fmt, const uint8_t *w, int64_t N, int64_t K, const int8_t *xq,
                               const act_block *meta, int64_t M, int levels, float *y, int accumulate) {
    const int64_t nblocks = K / QK, groups = N / GROUP_ROWS, group_bytes = GROUP_ROWS * nblocks * block_bytes(fmt);
    const int64_t units = (groups + 1) / 2, panels = (M + AMX_PANEL_ROWS - 1) / AMX_PANEL_ROWS;
    int shape = 0;  /* the rows of this thread's loaded tile shapes (0: none loaded yet) */
    /* Panels of rows outermost: a thread's panel of 8-bit rows stays in its L2 cache while
       every group pair's weights pass (a prompt's 2,000 rows would stream from memory once
       a pair); a pair's tiles are split again for each panel. */
    #pragma omp for collapse(2) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t u = 0; u < units; u++) {
            const int64_t g = 2 * u, end = (p + 1) * AMX_PANEL_ROWS < M ? (p + 1) * AMX_PANEL_ROWS : M;
            const uint8_t *group = w + g * group_bytes;
            const uint8_t *tiles = g + 1 < groups ? pair_tiles(fmt, group, group_bytes, nblocks) : NULL;
            for (int64_t m0 = p * AMX_PANEL_ROWS; m0 < end; m0 += AMX_ROWS) {
                const int rows = end - m0 < AMX_ROWS ? (int)(end - m0) : AMX_ROWS;
                float *out = y + m0 / levels * N + g * GROUP_ROWS;
                const int8_t *x0 = xq + m0 * K;
                const act_block *meta0 = meta + m0 * nblocks;
                if (tiles == NULL) {
                    rows_without_tiles(fmt, group, group_bytes, g + 1 < groups, nblocks, x0, meta0, K, rows, levels, out,
                                       N, accumulate);
                    continue;
                }
                if (shape != rows) {
                    load_tile_shapes(rows, amx_columns(fmt));
                    shape = rows;
                }
                if (rows == AMX_ROWS)  /* a constant row count: the 16 accumulators stay in registers */
                    pair_rows_amx(fmt, group, group_bytes, tiles, nblocks, x0, meta0, K, AMX_ROWS, levels, out, N,
                                  accumulate);
                else
                    pair_rows_amx(fmt, group, group_bytes, tiles, nblocks, x0, meta0, K, rows, levels, out, N,
                                  accumulate);
            }
        }
    }
    if (shape) _tile_release();  /* the registers' state no longer saved at each context switch */
}
#endif

/* Bytes of `work` interleaved_matmul needs: M * levels * K int8 values and as many / 32
   act_blocks, then K floats for each ROUNDING_ROWS rows' prologue. */
int64_t interleaved_matmul_work_bytes(int64_t M, int64_t K, int levels) {
    return M * levels * (K + (K / QK) * (int64_t)sizeof(act_block)) +
           (M + ROUNDING_ROWS - 1) / ROUNDING_ROWS * K * (int64_t)sizeof(float);
}

/* y (M x N) = x (M x K, rounded to 8 bits a block, in `levels` (1 or 2) levels, into
   `work`) times the transpose of the interleaved weight `w` (N rows, a multiple of
   GROUP_ROWS). Two levels cost about twice the integer work of one and are within ~1e-4
   of the float product; one is llama.cpp's rounding (~0.5 %). Activation rows are taken a panel at a time, a
   panel's 8-bit rows fitting PANEL_BYTES, so they stay in the L1 cache while every group of
   weight rows passes. `pro`: what is done to each row of x first; `accumulate`: y += the
   product instead of y = it. Returns 0, or -1 for an unknown format or a shape the layout
   does not take. */
#define PANEL_BYTES 16384
static int interleaved_layout_takes(int fmt, int64_t N, int64_t K, int levels) {
    return block_bytes(fmt) > 0 && fmt != FMT_F8_F32 && K % QK == 0 && N % GROUP_ROWS == 0 && (levels == 1 || levels == 2);
}

/* The product's two passes (rounding, then the tiles), each an orphaned `omp for` ending
   in the team's barrier: inside a parallel region the calling team shares them, outside
   it the calling thread does both. The shape is one interleaved_layout_takes. */
static void interleaved_product_shared(int fmt, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                                       float *y, void *work, int levels, const prologue *pro, int accumulate) {
    int64_t nblocks = K / QK, groups = N / GROUP_ROWS, group_bytes = GROUP_ROWS * nblocks * block_bytes(fmt);
    int8_t *xq = (int8_t *)work;
    act_block *meta = (act_block *)(xq + M * levels * K);
    quantize_activations_shared(x, M, K, levels, xq, meta, pro, (float *)(meta + M * levels * nblocks));
    M *= levels;  /* from here on, rows of quantized activations */
#if AMX_TILES
    if (amx_takes(fmt) && M >= amx_min_rows(fmt) && amx_permitted()) {
        amx_product_shared(fmt, w, N, K, xq, meta, M, levels, y, accumulate);
        return;
    }
#endif
    int64_t panel = PANEL_BYTES / K / GEMM_ROWS * GEMM_ROWS;
    if (panel < GEMM_ROWS) panel = GEMM_ROWS;
    int64_t panels = (M + panel - 1) / panel;
    const int64_t per_unit = PAIRED_GROUPS ? 2 : 1, units = (groups + per_unit - 1) / per_unit;
    #pragma omp for collapse(2) schedule(static)
    for (int64_t u = 0; u < units; u++) {
        for (int64_t p = 0; p < panels; p++) {
            const int64_t g = u * per_unit;
            int64_t end = (p + 1) * panel < M ? (p + 1) * panel : M;
            for (int64_t m0 = p * panel; m0 < end; m0 += GEMM_ROWS) {
                int rows = (int)(end - m0 < GEMM_ROWS ? end - m0 : GEMM_ROWS);
#if PAIRED_GROUPS
                if (g + 1 < groups) {
                    group_pair_tile(fmt, w + g * group_bytes, group_bytes, nblocks, xq + m0 * K, meta + m0 * nblocks, K,
                                    rows, levels, y + m0 / levels * N + g * GROUP_ROWS, N, accumulate);
                    continue;
                }
#endif
                group_tile(fmt, w + g * group_bytes, nblocks, xq + m0 * K, meta + m0 * nblocks, K, rows, levels,
                           y + m0 / levels * N + g * GROUP_ROWS, N, accumulate);
            }
        }
    }
}

static int interleaved_product(int fmt, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                               void *work, int levels, int threads, const prologue *pro, int accumulate) {
    if (!interleaved_layout_takes(fmt, N, K, levels)) return -1;
    #pragma omp parallel num_threads(threads)
    interleaved_product_shared(fmt, w, N, K, x, M, y, work, levels, pro, accumulate);
    return 0;
}

int interleaved_matmul(int fmt, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                       void *work, int levels, int threads) {
    const prologue none = {PROLOGUE_NONE, NULL, 0.0f, K};
    return interleaved_product(fmt, w, N, K, x, M, y, work, levels, threads, &none, 0);
}

/* interleaved_matmul with a prologue on each row of x (rows `ldx` floats apart; a
   PROLOGUE_SILU_GATE row holds 2K) and, with `accumulate`, y += the product: a layer's
   norm, activation or residual add done in the product's own passes. */
int fused_interleaved_matmul(int fmt, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                             float *y, void *work, int levels, int threads, int prologue_kind,
                             const float *norm_weight, float eps, int accumulate) {
    if (prologue_kind < PROLOGUE_NONE || prologue_kind > PROLOGUE_SILU_GATE
        || (prologue_kind == PROLOGUE_RMS_NORM && norm_weight == NULL)) return -1;
    const prologue pro = {prologue_kind, norm_weight, eps, ldx};
    return interleaved_product(fmt, w, N, K, x, M, y, work, levels, threads, &pro, accumulate);
}

/* out (count x K floats) = the interleaved weight's rows `rows[i]`, dequantized (an
   embedding that shares a tied output head's interleaved blocks looks its rows up here).
   Returns 0, or -1 as above. */
int dequantize_interleaved_rows(int fmt, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count,
                                float *out, int threads) {
    int64_t bb = block_bytes(fmt);
    if (bb < 0 || fmt == FMT_F8_F32 || K % QK) return -1;
    int64_t nblocks = K / QK, gbb = GROUP_ROWS * bb;
    #pragma omp parallel for schedule(static) num_threads(threads) if (count * K > 65536)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *group = w + rows[i] / GROUP_ROWS * nblocks * gbb;
        for (int64_t b = 0; b < nblocks; b++) {
            uint8_t row[64];
            lane_block(fmt, group + b * gbb, (int)(rows[i] % GROUP_ROWS), row);
            widen_block_to(fmt, row, out + i * K + b * QK);
        }
    }
    return 0;
}

/* out (count x K floats) = the weight rows `rows[i]`, or rows first..first+count-1 when
   `rows` is NULL, dequantized. Returns 0, or -1 as above. */
int dequantize_rows(int fmt, const uint8_t *w, int64_t K, const int64_t *rows, int64_t first, int64_t count,
                    float *out, int threads) {
    int64_t bb = block_bytes(fmt);
    if (bb < 0 || K % QK) return -1;
    int64_t nblocks = K / QK, row_bytes = nblocks * bb;
    #pragma omp parallel for schedule(static) num_threads(threads) if (count * K > 65536)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + (rows ? rows[i] : first + i) * row_bytes;
        float *dst = out + i * K;
        for (int64_t b = 0; b < nblocks; b++) widen_block_to(fmt, row + b * bb, dst + b * QK);
    }
    return 0;
}
