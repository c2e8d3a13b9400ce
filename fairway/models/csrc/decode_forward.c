/* A step's pass through every decoder layer in one native call.
 *
 * A decode step has a few rows, and each layer is nine small operations (norm, QKV, RoPE + cache
 * write, attention, O, norm, gate|up, SiLU gating, down). Called one by one from Python, each pays
 * the interpreter, the module call, ctypes and an output allocation, which added up to as much as
 * the attention and small ops themselves (bench/README.md, "CPU kernels"). Here the same
 * kernels (layer_ops.c, paged_decode.c, amx_linear.c or bf16_linear.c) run in the same order on
 * the same inputs from C, so the hidden states are bit-identical to the layer-by-layer path
 * (fairway/models/llama.py), which remains for other dtypes and portable builds.
 *
 * Prefill chunks ride along: their rows follow the decode rows through every kernel but the
 * attention, which a callback runs per layer (the layer-by-layer path's own PyTorch attention), so
 * a step that carries a prompt does not fall back to nine Python calls a layer.
 *
 * Activations, norms and KV cache all bf16, the linears' weights bf16 panels or GGUF blocks of one
 * type for quant_linear.c; or activations and norms float32 (shape->f32: a CPU without bf16
 * arithmetic), the linears GGUF blocks, over a float32 or bf16 KV cache (shape->cache_bf16: the
 * bf16 model's cache, which the RoPE store rounds to and attention widens from, as the
 * layer-by-layer path does). Built with the other kernels by cpu_kernels.py.
 */
#include <stdint.h>
#include <string.h>

int rms_norm(const void *x, const void *residual, const void *weight, void *out, void *residual_out, int rows,
             int dim, float eps, int bf16, int num_threads);
int silu_mul(const void *gate_up, void *out, int rows, int inter, int bf16, int num_threads);
int rope_store(void *qkv, int tokens, int heads_q, int heads_kv, int head_dim, const void *cos_table,
               const void *sin_table, const int64_t *positions, const int64_t *slots, void *k_cache, void *v_cache,
               int64_t cache_slots, int bf16, int table_bf16, int cache_bf16, int num_threads);
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                           const int32_t *context_lens, void *out, int n_seqs, int kv_heads, int group, int d,
                           int64_t slots, int block_size, int max_blocks, float scale, int q_bf16, int kv_bf16,
                           int num_threads);
int bf16_linear(const uint16_t *x, const uint16_t *packed, uint16_t *y, int m, int n, int k, int nv, int mr,
                int prefetch, int num_threads);
int amx_linear(const uint16_t *x, const uint16_t *packed, uint16_t *y, int m, int n, int k, int num_threads);
int quant_linear(const void *x, const uint8_t *packed, void *y, int m, int n, int k, int qt, int x_bf16, int isa,
                 int num_threads);

/* One layer's weights: the norms [hidden] bf16, the linears packed into panels (bf16_linear.c or
 * quant_linear.c). */
typedef struct {
    const void *input_norm, *qkv, *o, *post_norm, *gate_up, *down;
} decoder_weights;

/* The shapes of the model and of this step. */
typedef struct {
    int tokens, hidden, heads_q, heads_kv, head_dim, inter, num_layers;
    float eps, scale;
    int64_t cache_slots; /* per KV head of one layer: layer l's cache starts l * heads_kv * cache_slots rows in */
    int block_size, max_blocks;
    int table_bf16;          /* the RoPE tables' dtype */
    int amx, nv, mr, prefetch; /* the linear kernel: AMX, or AVX512-BF16 with this tile */
    int num_threads;
    int quant, isa; /* quant: the linears' GGUF type for quant_linear() on this path, or 0: bf16 panels */
    int decode_tokens; /* the first rows, each attending through its block table; the rest are prefill rows */
    int f32;           /* activations and norms float32 (quant only), else bf16 */
    int cache_bf16;    /* the KV cache bf16 (always, without f32) */
} decode_shape;

/* Writes layer l's attention output of the prefill rows (scratch's attn rows decode_tokens..tokens)
 * from its qkv rows, whose K and V are in the cache by then; returns 0, or nonzero on failure. */
typedef int (*prefill_attention_fn)(int layer);

static int linear(const decode_shape *s, const void *x, const void *panels, void *y, int n, int k) {
    if (s->quant) return quant_linear(x, panels, y, s->tokens, n, k, s->quant, !s->f32, s->isa, s->num_threads);
    if (s->f32) return -1;
    return s->amx ? amx_linear(x, panels, y, s->tokens, n, k, s->num_threads)
                  : bf16_linear(x, panels, y, s->tokens, n, k, s->nv, s->mr, s->prefetch, s->num_threads);
}

/* The values (bf16, or float32 with f32) of scratch decode_forward() needs for this shape. */
int64_t decode_forward_scratch(const decode_shape *s) {
    const int64_t q = (int64_t)s->heads_q * s->head_dim, kv = (int64_t)s->heads_kv * s->head_dim;
    return (int64_t)s->tokens * (2 * (int64_t)s->hidden + (q + 2 * kv) + 2 * q + 3 * (int64_t)s->inter);
}

/* x: [tokens, hidden] bf16 (float32 with f32), the embedded tokens, overwritten; out: [tokens,
 * hidden], the final norm of the last layer's stream (what LlamaModel.forward returns). Each
 * token sits at `positions`, written to `slots`; the first decode_tokens attend through their
 * block tables, the others through prefill_attention (NULL when there are none). Returns 0, or the failing kernel's code
 * (1 norm, 2 linear, 3 RoPE, 4 attention, 5 SiLU, 6 prefill attention) times -1. */
int decode_forward(void *x, void *out, const decoder_weights *layers, const void *final_norm, const decode_shape *s,
                   const void *cos_table, const void *sin_table, const int64_t *positions, const int64_t *slots,
                   void *k_cache, void *v_cache, const int32_t *block_tables, const int32_t *context_lens,
                   void *scratch, prefill_attention_fn prefill_attention) {
    const int T = s->tokens, H = s->hidden, D = s->head_dim, bf = !s->f32;
    const int64_t es = bf ? 2 : 4; /* bytes a value */
    const int q_width = s->heads_q * D, qkv_width = (s->heads_q + 2 * s->heads_kv) * D;
    char *residual = scratch, *h = residual + (int64_t)T * H * es, *qkv = h + (int64_t)T * H * es;
    char *q = qkv + (int64_t)T * qkv_width * es, *attn = q + (int64_t)T * q_width * es;
    char *gate_up = attn + (int64_t)T * q_width * es, *act = gate_up + (int64_t)T * 2 * s->inter * es;
    const int cache_bf = bf || s->cache_bf16;
    const int64_t layer_cache = (int64_t)s->heads_kv * s->cache_slots * D * (cache_bf ? 2 : 4); /* bytes */
    if (T < 1) return 0;
    memcpy(residual, x, (size_t)(T * H * es)); /* layer 0's residual stream is the embedding */
    for (int l = 0; l < s->num_layers; l++) {
        const decoder_weights *w = &layers[l];
        char *kc = (char *)k_cache + l * layer_cache, *vc = (char *)v_cache + l * layer_cache;
        if (rms_norm(x, l ? residual : NULL, w->input_norm, h, residual, T, H, s->eps, bf, s->num_threads)) return -1;
        if (linear(s, h, w->qkv, qkv, qkv_width, H)) return -2;
        if (rope_store(qkv, T, s->heads_q, s->heads_kv, D, cos_table, sin_table, positions, slots, kc, vc,
                       s->cache_slots, bf, s->table_bf16, cache_bf, s->num_threads)) return -3;
        for (int t = 0; t < T; t++)
            memcpy(q + (int64_t)t * q_width * es, qkv + (int64_t)t * qkv_width * es, (size_t)(q_width * es));
        if (s->decode_tokens > 0 &&
            paged_decode_attention(q, kc, vc, block_tables, context_lens, attn, s->decode_tokens, s->heads_kv,
                                   s->heads_q / s->heads_kv, D, s->cache_slots, s->block_size, s->max_blocks,
                                   s->scale, bf, cache_bf, s->num_threads)) return -4;
        if (s->decode_tokens < T && (prefill_attention == NULL || prefill_attention(l))) return -6;
        if (linear(s, attn, w->o, h, H, q_width)) return -2;
        /* In place: a row is read whole before its norm and sum are written. */
        if (rms_norm(h, residual, w->post_norm, h, residual, T, H, s->eps, bf, s->num_threads)) return -1;
        if (linear(s, h, w->gate_up, gate_up, 2 * s->inter, H)) return -2;
        if (silu_mul(gate_up, act, T, s->inter, bf, s->num_threads)) return -5;
        if (linear(s, act, w->down, x, H, s->inter)) return -2;
    }
    return rms_norm(x, residual, final_norm, out, residual, T, H, s->eps, bf, s->num_threads) ? -1 : 0;
}
