/* The small per-layer operations of a Llama decoder layer, each one call instead of several ops:
 *
 *   rms_norm      out = RMSNorm(x) or, given a residual, s = x + residual; out = RMSNorm(s)
 *   silu_mul      out = silu(gate) * up, from the fused gate|up projection
 *   rope_store    rotate Q and K in place (RoPE) and write K and V into the paged cache
 *
 * At decode each of these sees a handful of rows, where PyTorch's dispatch per op costs far more
 * than its few thousand FLOPs, and a layer had ~25 such ops: a large share of a decode step
 * (bench/README.md, "CPU kernels"). Each works on float32 or bfloat16 tensors and reproduces
 * PyTorch's rounding step by step (a bf16 op computes in float32 and rounds its result to bf16),
 * so the fused path gives the tokens the op-by-op path gives. Rows are independent, so a row's result
 * does not depend on how the rows are split across threads.
 *
 * Built with the other kernels by fairway/models/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* Round to nearest even, as PyTorch does; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* The value a bf16 op would store: rounded when the tensor is bf16, unchanged for float32. */
static inline __attribute__((always_inline)) float round_to(float f, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* Rows from which the threads split the work. A decode step's kernels run back to back, so the
 * other threads are still spinning from the last one and join at once: from two rows up, splitting
 * beat one thread doing it while the others wait (bench/README.md, "Huge pages and layer ops"). */
#define PARALLEL_ROWS 2

/* Full-width vectors where the CPU has AVX-512 (GCC otherwise keeps 256-bit ones on Intel cores):
 * the SiLU's expf and the roundings took a twelfth of a 512-token prefill step at 256 bits
 * (bench/README.md, "Huge pages and layer ops"). Harmless elsewhere: no wider vector exists. */
#pragma GCC target("prefer-vector-width=512")

/* The row functions take the dtype as a constant (always inlined into one copy per dtype), so
 * the loads, stores and roundings fold away and each loop vectorizes (expf through libmvec). */
#define INLINE static inline __attribute__((always_inline))

INLINE void norm_row(const void *x, const void *residual, const void *weight, void *out, void *residual_out,
                     int64_t base, int dim, float eps, float *restrict s, const int bf16) {
    float ss = 0.f;
    for (int i = 0; i < dim; i++) {
        float v = load(x, base + i, bf16);
        if (residual) v = round_to(v + load(residual, base + i, bf16), bf16);
        s[i] = v;
        ss += v * v;
    }
    if (residual)
        for (int i = 0; i < dim; i++) store(residual_out, base + i, s[i], bf16);
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
    for (int i = 0; i < dim; i++) store(out, base + i, load(weight, i, bf16) * round_to(s[i] * inv, bf16), bf16);
}

int rms_norm(const void *x, const void *residual, const void *weight, void *out, void *residual_out,
             int rows, int dim, float eps, int bf16, int num_threads) {
    if (rows < 0 || dim < 1 || dim > 16384) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        float s[16384];
        if (bf16) norm_row(x, residual, weight, out, residual_out, (int64_t)r * dim, dim, eps, s, 1);
        else norm_row(x, residual, weight, out, residual_out, (int64_t)r * dim, dim, eps, s, 0);
    }
    return 0;
}

INLINE void silu_row(const void *gate_up, void *out, int64_t in, int64_t o, int inter, const int bf16) {
    for (int i = 0; i < inter; i++) {
        const float g = load(gate_up, in + i, bf16);
        const float silu = round_to(g / (1.f + expf(-g)), bf16);
        store(out, o + i, silu * load(gate_up, in + inter + i, bf16), bf16);
    }
}

int silu_mul(const void *gate_up, void *out, int rows, int inter, int bf16, int num_threads) {
    if (rows < 0 || inter < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const int64_t in = (int64_t)r * 2 * inter, o = (int64_t)r * inter;
        if (bf16) silu_row(gate_up, out, in, o, inter, 1);
        else silu_row(gate_up, out, in, o, inter, 0);
    }
    return 0;
}

/* One head of one token: x * cos + rotate_half(x) * sin, each product and the sum rounded as the
 * op-by-op path rounds them. */
INLINE void rope_head(void *qkv, int64_t at, const void *cos_table, const void *sin_table, int64_t p, int half,
                      const int bf16, const int table_bf16) {
    for (int i = 0; i < half; i++) {
        const float ci = round_to(load(cos_table, p + i, table_bf16), bf16);
        const float si = round_to(load(sin_table, p + i, table_bf16), bf16);
        const float x1 = load(qkv, at + i, bf16), x2 = load(qkv, at + half + i, bf16);
        store(qkv, at + i, round_to(x1 * ci, bf16) - round_to(x2 * si, bf16), bf16);
        store(qkv, at + half + i, round_to(x2 * ci, bf16) + round_to(x1 * si, bf16), bf16);
    }
}

INLINE void copy_row(const void *src, int64_t from, void *dst, int64_t to, int n, const int bf16, const int dst_bf16) {
    for (int i = 0; i < n; i++) store(dst, to + i, load(src, from + i, bf16), dst_bf16);
}

/* qkv: [tokens, (heads_q + 2 * heads_kv) * head_dim], rows laid out Q | K | V, in the compute
 * dtype. cos/sin: [max_positions, head_dim] (the halves repeat, as Hugging Face builds them), float32
 * or bf16 (a model cast to bf16 casts its tables too); rounded to the compute dtype as the op-by-op
 * path rounds them. Caches: [heads_kv, cache_slots, head_dim] in the cache dtype (float32 compute may keep a
 * bf16 cache: K and V are rounded on the way in). */
int rope_store(void *qkv, int tokens, int heads_q, int heads_kv, int head_dim, const void *cos_table,
               const void *sin_table, const int64_t *positions, const int64_t *slots, void *k_cache,
               void *v_cache, int64_t cache_slots, int bf16, int table_bf16, int cache_bf16, int num_threads) {
    if (tokens < 0 || head_dim < 2 || head_dim % 2 || (bf16 && !cache_bf16)) return -1;
    const int half = head_dim / 2, rotated = heads_q + heads_kv;
    const int64_t width = (int64_t)(heads_q + 2 * heads_kv) * head_dim;
    for (int t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= cache_slots) return -2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int t = 0; t < tokens; t++) {
        const int64_t row = (int64_t)t * width, p = positions[t] * head_dim;
        for (int h = 0; h < rotated; h++) {
            const int64_t at = row + (int64_t)h * head_dim;
            if (bf16 && table_bf16) rope_head(qkv, at, cos_table, sin_table, p, half, 1, 1);
            else if (bf16) rope_head(qkv, at, cos_table, sin_table, p, half, 1, 0);
            else if (table_bf16) rope_head(qkv, at, cos_table, sin_table, p, half, 0, 1);
            else rope_head(qkv, at, cos_table, sin_table, p, half, 0, 0);
        }
        for (int h = 0; h < heads_kv; h++) {
            const int64_t k_at = row + (int64_t)(heads_q + h) * head_dim;
            const int64_t v_at = k_at + (int64_t)heads_kv * head_dim;
            const int64_t dst = ((int64_t)h * cache_slots + slots[t]) * head_dim;
            if (bf16) {
                copy_row(qkv, k_at, k_cache, dst, head_dim, 1, 1);
                copy_row(qkv, v_at, v_cache, dst, head_dim, 1, 1);
            } else if (cache_bf16) {
                copy_row(qkv, k_at, k_cache, dst, head_dim, 0, 1);
                copy_row(qkv, v_at, v_cache, dst, head_dim, 0, 1);
            } else {
                copy_row(qkv, k_at, k_cache, dst, head_dim, 0, 0);
                copy_row(qkv, v_at, v_cache, dst, head_dim, 0, 0);
            }
        }
    }
    return 0;
}
