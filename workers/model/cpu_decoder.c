/* A step of decode rows through every fused decoder layer in one call (direct_forward.py's
   fused layers, the same operations in the same order, so the same bits).

Why: a fused layer is still six calls from Python (four products, the rotation and cache
write, the attention), each a ctypes call, an OpenMP fork and join and a few tensor
allocations: ~30 us of fixed cost a call, 5-6 ms of a 17 ms step at batch 1 on a 2-core
EPYC. Here one parallel region runs all the layers: the team meets at a barrier between
phases (each phase an orphaned `omp for` of the product, rotation and attention code in the
two sources included below) and no thread leaves until the last layer is done.

Built by workers/native/build.py like the other sources (it hashes the included ones into
the build's key). */

#include "../quant/cpu_kernels.c"
#include "cpu_attention.c"

enum { PRODUCT_QKV = 0, PRODUCT_O = 1, PRODUCT_GATE_UP = 2, PRODUCT_DOWN = 3, PRODUCTS = 4 };

/* The layers, fixed at load (cpu_decoder.py builds it; addresses as int64). Per layer:
   formats and weights [layers x PRODUCTS] (interleaved blocks, cpu_kernels.c), norms
   [layers x 2] (input and post-attention RMSNorm weights, float32), qkv_bias [layers]
   (0: none). The caches [layers, slots, kv_heads, head_dim] float32. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    int32_t levels;
    float eps, scale, softcap;  /* softcap <= 0: none */
    int64_t window;             /* <= 0: none */
    const int32_t *formats;
    const int64_t *weights, *norms, *qkv_bias;
    float *keys, *values;
    int64_t num_slots, block_size;
} decoder_layers;

static const uint8_t *weight_of(const decoder_layers *m, int64_t layer, int product) {
    return (const uint8_t *)(intptr_t)m->weights[layer * PRODUCTS + product];
}

static const float *norm_of(const decoder_layers *m, int64_t layer, int which) {
    return (const float *)(intptr_t)m->norms[layer * 2 + which];
}

/* 1 when every product's format and shape is one the interleaved product takes. */
int decoder_layers_supported(const decoder_layers *m) {
    const int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim, attn = m->heads * m->head_dim;
    const int64_t n[PRODUCTS] = {qkv, m->hidden, 2 * m->intermediate, m->hidden};
    const int64_t k[PRODUCTS] = {m->hidden, attn, m->hidden, m->intermediate};
    if (m->kv_heads <= 0 || m->heads % m->kv_heads || m->head_dim % 2 || m->head_dim > MAX_HEAD_DIM
        || m->block_size > MAX_BLOCK)
        return 0;
    for (int64_t layer = 0; layer < m->layers; layer++)
        for (int p = 0; p < PRODUCTS; p++)
            if (!interleaved_layout_takes(m->formats[layer * PRODUCTS + p], n[p], k[p], m->levels)) return 0;
    return 1;
}

/* One layer on x [M, hidden] in place, by the calling team: x += o(attention(rotated
   qkv(norm(x)))), then x += down(silu_gate(gate_up(norm(x)))). */
static void decoder_layer_shared(const decoder_layers *m, int64_t layer, float *x, int64_t M, const float *cos,
                                 const float *signed_sin, const int64_t *slots, const attention_plan *plan,
                                 const int64_t *tables, int64_t width, const int32_t *lens, float *qkv, float *attn,
                                 float *gate_up, void *work) {
    const int64_t hidden = m->hidden, qkv_width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    const int64_t attn_width = m->heads * m->head_dim, cache_floats = m->num_slots * m->kv_heads * m->head_dim;
    const int32_t *fmt = m->formats + layer * PRODUCTS;
    const prologue input_norm = {PROLOGUE_RMS_NORM, norm_of(m, layer, 0), m->eps, hidden};
    const prologue post_norm = {PROLOGUE_RMS_NORM, norm_of(m, layer, 1), m->eps, hidden};
    const prologue none = {PROLOGUE_NONE, NULL, 0.0f, attn_width};
    const prologue silu_gate = {PROLOGUE_SILU_GATE, NULL, 0.0f, 2 * m->intermediate};
    float *keys = m->keys + layer * cache_floats, *values = m->values + layer * cache_floats;

    interleaved_product_shared(fmt[PRODUCT_QKV], weight_of(m, layer, PRODUCT_QKV), qkv_width, hidden, x, M, qkv, work,
                               m->levels, &input_norm, 0);
    const float *bias = (const float *)(intptr_t)m->qkv_bias[layer];
    if (bias != NULL) {  /* as QuantizedLinear.fused adds it: out += bias after the product */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < M; row++)
            for (int64_t i = 0; i < qkv_width; i++) qkv[row * qkv_width + i] += bias[i];
    }
    rotate_and_cache_shared(qkv, M, m->heads, m->kv_heads, m->head_dim, cos, signed_sin, slots, keys, values);
    attend_shared(plan, DT_FLOAT32, qkv, qkv_width, keys, values, m->heads, m->head_dim, m->block_size, tables, width,
                  lens, M, m->scale, m->window, m->softcap, attn);
    interleaved_product_shared(fmt[PRODUCT_O], weight_of(m, layer, PRODUCT_O), hidden, attn_width, attn, M, x, work,
                               m->levels, &none, 1);
    interleaved_product_shared(fmt[PRODUCT_GATE_UP], weight_of(m, layer, PRODUCT_GATE_UP), 2 * m->intermediate, hidden,
                               x, M, gate_up, work, m->levels, &post_norm, 0);
    interleaved_product_shared(fmt[PRODUCT_DOWN], weight_of(m, layer, PRODUCT_DOWN), hidden, m->intermediate, gate_up,
                               M, x, work, m->levels, &silu_gate, 1);
}

/* x [M, hidden] float32, each row a decode row (a span's queries are rows of one sequence,
   each with its own context length), through every layer in place.
   cos / signed_sin [M, head_dim] (direct_forward.py's rotation), slots [M] each row's
   cache slot, tables [M, width] and lens [M] (its context, itself included) as the
   attention kernel takes them. Scratch: qkv [M, (heads + 2 kv_heads) head_dim], attn
   [M, heads head_dim], gate_up [M, 2 intermediate], `work` (interleaved_matmul_work_bytes
   for the largest K). Returns 0; 1 (nothing done) for a slot outside the caches or no
   memory for the attention's plan. The layers are one decoder_layers_supported. */
int decode_layers(const decoder_layers *m, float *x, int64_t M, const float *cos, const float *signed_sin,
                  const int64_t *slots, const int64_t *tables, int64_t width, const int32_t *lens, float *qkv,
                  float *attn, float *gate_up, void *work, int threads) {
    if (!rotation_takes(m->head_dim, slots, M, m->num_slots)) return 1;
    attention_plan plan;
    if (plan_attention(&plan, DT_FLOAT32, m->heads, m->kv_heads, m->head_dim, m->block_size, tables, width, lens, M,
                       m->window, threads))
        return 1;
#pragma omp parallel num_threads(threads)
    for (int64_t layer = 0; layer < m->layers; layer++)
        decoder_layer_shared(m, layer, x, M, cos, signed_sin, slots, &plan, tables, width, lens, qkv, attn, gate_up,
                             work);
    free_plan(&plan);
    return 0;
}
