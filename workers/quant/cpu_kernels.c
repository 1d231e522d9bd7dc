/* Products with GGUF block-quantized weights on the CPU (Q4_0, Q4_1, Q8_0).

The weights stay in the file's own blocks (32 weights each, with an fp16 scale and, for
Q4_1, an fp16 minimum), one row of blocks per output feature: a decode step reads 4.5-8.5
bits a weight from memory instead of 32. Two products: a block widened to float32 in
registers times float32 activations (float32 sums of the exact dequantized weights: the
dequantized float product up to summation order), or, when asked, activations rounded to
8 bits a block first and integer dot products (llama.cpp's way; faster, less exact).

Built by workers/quant/native_kernels.py with the host's gcc (-O3 -march=native -fopenmp);
without AVX2 the portable loop below runs instead. The OpenMP runtime is torch's own
(libgomp.so.1 is already loaded when this library is), so both share one thread pool. */

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8 };  /* ggml's type ids */
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

static int64_t block_bytes(int fmt) {
    switch (fmt) {
        case FMT_Q4_0: return 18;
        case FMT_Q4_1: return 20;
        case FMT_Q8_0: return 34;
        default: return -1;
    }
}

/* The 32 weights of one block as floats. */
static inline void widen_block_scalar(int fmt, const uint8_t *b, float *out) {
    float d = half_to_float(read_u16(b));
    if (fmt == FMT_Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) out[j] = d * q[j];
        return;
    }
    const uint8_t *qs = b + (fmt == FMT_Q4_1 ? 4 : 2);
    float m = fmt == FMT_Q4_1 ? half_to_float(read_u16(b + 2)) : -8.0f * d;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (qs[j] & 0x0f) + m;
        out[j + QK / 2] = d * (qs[j] >> 4) + m;
    }
}

#ifdef __AVX2__
static inline void widen_block(int fmt, const uint8_t *b, __m256 w[4]) {
    __m256 d = _mm256_set1_ps(half_to_float(read_u16(b)));
    if (fmt == FMT_Q8_0) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
        w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
        w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
        w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
        return;
    }
    const uint8_t *qs = b + (fmt == FMT_Q4_1 ? 4 : 2);
    __m256 m = fmt == FMT_Q4_1 ? _mm256_set1_ps(half_to_float(read_u16(b + 2)))
                               : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
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

#endif


/* ---- Activations quantized to 8 bits per block (llama.cpp's Q8 dot products) ----
   Each activation row is cut into blocks of 32 with a float scale (absmax / 127) and the
   block's sum; a weight block times an activation block is then an integer dot product
   (u8 x s8 pairs, `maddubs`) and one FMA: about half the instructions of widening every
   weight to float, on a loop that is compute-bound on 2 cores. The price is the
   activations' rounding (relative error <= 1/254 per value), as in llama.cpp. */

typedef struct { float scale, sum; } act_block;  /* sum = scale * sum of the quantized values */

#ifdef __AVX2__
/* x (M x K floats) -> xq (M x K int8) and meta (M x K/32). */
static void quantize_activations(const float *x, int64_t M, int64_t K, int8_t *xq, act_block *meta) {
    int64_t nblocks = K / QK;
    for (int64_t i = 0; i < M * nblocks; i++) {
        const float *src = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) { float a = src[j] < 0 ? -src[j] : src[j]; if (a > amax) amax = a; }
        float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            float v = src[j] * inv;
            int q = (int)(v < 0 ? v - 0.5f : v + 0.5f);
            xq[i * QK + j] = (int8_t)q;
            sum += q;
        }
        meta[i].scale = scale;
        meta[i].sum = scale * (float)sum;
    }
}

/* 8 int32 lanes: the sums of u8 x s8 products of 32 pairs. */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void dot_rows_q8(int fmt, const uint8_t *row, int64_t nblocks,
                                                              int64_t bb, const int8_t *xq, const act_block *meta,
                                                              int64_t K, int rows, float *y, int64_t ldy) {
    __m256 acc[MAX_ROWS];
    float offset[MAX_ROWS];
    for (int r = 0; r < rows; r++) { acc[r] = _mm256_setzero_ps(); offset[r] = 0.0f; }
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *blk = row + b * bb;
        float d = half_to_float(read_u16(blk)), m;
        __m256i wq;  /* u8 magnitudes (Q4) or the signed values (Q8_0) */
        if (fmt == FMT_Q8_0) {
            wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
            m = 0.0f;
        } else {
            const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
            __m128i raw = _mm_loadu_si128((const __m128i *)qs);
            wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
            m = fmt == FMT_Q4_1 ? half_to_float(read_u16(blk + 2)) : -8.0f * d;
        }
        __m256i wabs = fmt == FMT_Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
        for (int r = 0; r < rows; r++) {
            const act_block *a = meta + r * (K / QK) + b;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QK));
            if (fmt == FMT_Q8_0) xv = _mm256_sign_epi8(xv, wq);  /* u8 |w| times s8 x*sign(w) */
            __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(wabs, xv));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->scale), dot, acc[r]);
            offset[r] += m * a->sum;
        }
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = hsum(acc[r]) + offset[r];
}

#endif

/* One weight row against up to MAX_ROWS activation rows: the 8-bit product when `xq` is
   given, else the float one; one specialized loop per row count (the accumulators stay in
   registers). */
static void dot_tile(int fmt, const uint8_t *row, int64_t nblocks, int64_t bb, const float *x, const int8_t *xq,
                     const act_block *meta, int64_t K, int rows, float *y, int64_t ldy) {
#ifdef __AVX2__
#define ROWS_CASE(R) case R: \
        if (xq) dot_rows_q8(fmt, row, nblocks, bb, xq, meta, K, R, y, ldy); \
        else dot_rows(fmt, row, nblocks, bb, x, K, R, y, ldy); \
        return;
    switch (rows) { ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
                    default: ROWS_CASE(8) }
#undef ROWS_CASE
#else
    (void)xq; (void)meta;
    float w[QK], acc[MAX_ROWS] = {0};
    for (int64_t b = 0; b < nblocks; b++) {
        widen_block_scalar(fmt, row + b * bb, w);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < QK; j++) acc[r] += w[j] * x[r * K + b * QK + j];
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = acc[r];
#endif
}

/* Bytes of `work` quantized_matmul needs for 8-bit activations: M * K int8 values and
   M * K / 32 act_blocks. */
int64_t quantized_matmul_work_bytes(int64_t M, int64_t K) {
    return M * K + M * (K / QK) * (int64_t)sizeof(act_block);
}

/* y (M x N, row-major) = x (M x K) times the transpose of the N x K weight `w`, on
   `threads` threads (torch's count, passed in: the engine thread's OpenMP default may be
   Ray's OMP_NUM_THREADS=1). With `work` (quantized_matmul_work_bytes) the activations are
   rounded to 8 bits a block first, where the CPU has AVX2 (without it `work` is unused).
   Returns 0, or -1 for an unknown format or a K that is not whole blocks. */
int quantized_matmul(int fmt, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                     void *work, int threads) {
    int64_t bb = block_bytes(fmt);
    if (bb < 0 || K % QK) return -1;
    int64_t nblocks = K / QK, row_bytes = nblocks * bb;
    int8_t *xq = NULL;
    act_block *meta = NULL;
#ifdef __AVX2__
    if (work) {
        xq = (int8_t *)work;
        meta = (act_block *)(xq + M * K);
        quantize_activations(x, M, K, xq, meta);
    }
#else
    (void)work;
#endif
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            int rows = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
            dot_tile(fmt, w + n * row_bytes, nblocks, bb, x + m0 * K, xq ? xq + m0 * K : NULL,
                     meta ? meta + m0 * nblocks : NULL, K, rows, y + m0 * N + n, N);
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
        for (int64_t b = 0; b < nblocks; b++) {
#ifdef __AVX2__
            __m256 v[4];
            widen_block(fmt, row + b * bb, v);
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(dst + b * QK + 8 * k, v[k]);
#else
            widen_block_scalar(fmt, row + b * bb, dst + b * QK);
#endif
        }
    }
    return 0;
}
