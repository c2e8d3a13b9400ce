/* Paged decode attention for the CPU: one new query token per sequence, reading K/V in place
 * through the sequence's block table (no gathered copy of the context).
 *
 * Layout (fairway/models/paged_attention.py): a layer's cache is [kv_heads, slots, head_dim] with
 * slot = block * block_size + offset, so one block of one head is block_size * head_dim contiguous
 * values. Work items are (sequence, kv head) pairs; each handles the `group` query heads that share
 * the KV head, so every K/V row is read from memory once and used `group` times.
 *
 * Per item: pass 1 converts each K block to float in a small buffer and takes the dot products
 * with the group's queries; softmax in float32; pass 2 accumulates probability-weighted V rows.
 * The inner loops use GCC vector extensions (8 floats: AVX2, or SSE pairs; 16 with AVX-512 for head
 * dims that are multiples of 16) and are instantiated for head_dim 64 and 128 so their accumulators
 * live in registers.
 *
 * Built at run time by fairway/models/cpu_kernels.py and called through ctypes; the OpenMP runtime
 * is PyTorch's own (same soname), so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64

/* Vectors of 8 floats (AVX2, or SSE pairs) for any head_dim that is a multiple of 8, and of 16
 * (one AVX-512 register) for multiples of 16 where the CPU has AVX-512: half the instructions for
 * the same dot products (bench/README.md, "CPU kernels"). */
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));

static inline v8f ld8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline v16f ld16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline float hsum16(v16f v) {
    const v8f lo = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]};
    const v8f hi = {v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
    return hsum8(lo + hi);
}

#ifdef __AVX512F__
#define WIDE 16 /* the vector width for head dims that are multiples of 16 */
#else
#define WIDE 8
#endif

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as PyTorch does */
    return (uint16_t)(u >> 16);
}

/* dst[0..n) = src[off..off+n) as float; src is bfloat16 or float32. */
static inline void load_floats(const void *src, int64_t off, float *restrict dst, int n, const int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        memcpy(dst, (const float *)src + off, sizeof(float) * (size_t)n);
    }
}

/* Blocks sit anywhere in the cache, so the hardware prefetcher loses the stream at every block
 * boundary: ask for the next block while this one is in use (without, the read ran at a fraction
 * of a sequential one: bench/README.md, "CPU kernels"). */
static inline void prefetch(const void *base, int64_t off, size_t bytes, const int bf16) {
    const char *p = (const char *)base + off * (bf16 ? 2 : 4);
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 0);
}

/* out[j] = q . k[j] for the n rows of one block. Four rows at a time: four independent
 * accumulator chains hide the FMA latency that a single 64-long reduction would expose.
 * acc += sum_j p[j] * v[j] over the n rows of one block; acc stays in registers for a constant d.
 * Both for vectors of W floats (VT, loaded by LD, summed by HSUM; d a multiple of W). */
#define BLOCK_OPS(W, VT, LD, ST, HSUM)                                                                    \
    static inline __attribute__((always_inline)) void block_scores_##W(const float *restrict q,          \
            const float *restrict k, int n, const int d, float *restrict out) {                           \
        int j = 0;                                                                                       \
        for (; j + 4 <= n; j += 4) {                                                                     \
            const float *k0 = k + j * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;                       \
            VT a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                   \
            for (int c = 0; c < d; c += W) {                                                             \
                const VT qv = LD(q + c);                                                                 \
                a0 += qv * LD(k0 + c);                                                                   \
                a1 += qv * LD(k1 + c);                                                                   \
                a2 += qv * LD(k2 + c);                                                                   \
                a3 += qv * LD(k3 + c);                                                                   \
            }                                                                                            \
            out[j] = HSUM(a0);                                                                           \
            out[j + 1] = HSUM(a1);                                                                       \
            out[j + 2] = HSUM(a2);                                                                       \
            out[j + 3] = HSUM(a3);                                                                       \
        }                                                                                                \
        for (; j < n; j++) {                                                                             \
            VT a = {0};                                                                                  \
            for (int c = 0; c < d; c += W) a += LD(q + c) * LD(k + j * d + c);                           \
            out[j] = HSUM(a);                                                                            \
        }                                                                                                \
    }                                                                                                    \
    static inline __attribute__((always_inline)) void block_weighted_sum_##W(const float *restrict p,    \
            const float *restrict v, int n, const int d, float *restrict acc) {                           \
        VT a[MAX_HEAD_DIM / W];                                                                          \
        for (int c = 0; c < d / W; c++) a[c] = LD(acc + W * c);                                          \
        for (int j = 0; j < n; j++) {                                                                    \
            const float pj = p[j];                                                                       \
            for (int c = 0; c < d / W; c++) a[c] += pj * LD(v + j * d + W * c);                          \
        }                                                                                                \
        for (int c = 0; c < d / W; c++) ST(acc + W * c, a[c]);                                           \
    }
BLOCK_OPS(8, v8f, ld8, st8, hsum8)
BLOCK_OPS(16, v16f, ld16, st16, hsum16)

/* One (sequence, kv head) item. q, out: the group's query rows; k, v: this head's cache;
 * scores: scratch of group * len floats. */
static inline __attribute__((always_inline)) void attend(const void *q, const void *k, const void *v,
        const int32_t *restrict table, int len, void *out, int group, const int d, int block_size,
        float scale, float *restrict scores, const int q_bf16, const int bf16, const int w) {
    float qf[MAX_GROUP * MAX_HEAD_DIM];
    float buf[MAX_BLOCK * MAX_HEAD_DIM];
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    const int64_t blk = (int64_t)block_size * d;
    const size_t blk_bytes = (size_t)blk * (bf16 ? 2 : 4);
    load_floats(q, 0, qf, group * d, q_bf16);
    for (int i = 0; i < group * d; i++) qf[i] *= scale;

    prefetch(k, table[0] * blk, blk_bytes, bf16);
    if (len > block_size) prefetch(k, table[1] * blk, blk_bytes, bf16);
    for (int t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
        const int n = len - t0 < block_size ? len - t0 : block_size;
        /* Two blocks ahead; past the end of K, the first V blocks. */
        const int ahead = b + 2, nblocks = (len + block_size - 1) / block_size;
        if (ahead < nblocks) prefetch(k, table[ahead] * blk, blk_bytes, bf16);
        else if (ahead - nblocks < nblocks) prefetch(v, table[ahead - nblocks] * blk, blk_bytes, bf16);
        load_floats(k, table[b] * blk, buf, n * d, bf16);
        for (int g = 0; g < group; g++) {
            if (w == 16) block_scores_16(qf + g * d, buf, n, d, scores + g * len + t0);
            else block_scores_8(qf + g * d, buf, n, d, scores + g * len + t0);
        }
    }

    float inv_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * len;
        float m = -INFINITY;
        for (int t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        inv_sum[g] = 1.f / sum;
    }

    memset(acc, 0, sizeof(float) * (size_t)(group * d));
    for (int t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
        const int n = len - t0 < block_size ? len - t0 : block_size;
        if (t0 + 2 * block_size < len) prefetch(v, table[b + 2] * blk, blk_bytes, bf16);
        load_floats(v, table[b] * blk, buf, n * d, bf16);
        for (int g = 0; g < group; g++) {
            if (w == 16) block_weighted_sum_16(scores + g * len + t0, buf, n, d, acc + g * d);
            else block_weighted_sum_8(scores + g * len + t0, buf, n, d, acc + g * d);
        }
    }

    for (int g = 0; g < group; g++)
        for (int i = 0; i < d; i++) {
            const float x = acc[g * d + i] * inv_sum[g];
            if (q_bf16) ((uint16_t *)out)[g * d + i] = float_to_bf16(x);
            else ((float *)out)[g * d + i] = x;
        }
}

/* Instantiations: query/output dtype x cache dtype x head_dim (64 and 128 constant, so their
 * accumulators live in registers and loops unroll; any other multiple of 8 generic). */
#define ITEM(NAME, D, Q_BF16, KV_BF16, W)                                                            \
    static void NAME(const void *q, const void *k, const void *v, const int32_t *table, int len,     \
                     void *out, int group, int d, int block_size, float scale, float *scores) {       \
        attend(q, k, v, table, len, out, group, D, block_size, scale, scores, Q_BF16, KV_BF16, W);   \
    }
#define ITEMS(SUFFIX, Q_BF16, KV_BF16)                                                               \
    ITEM(item_##SUFFIX##_64, 64, Q_BF16, KV_BF16, WIDE)                                              \
    ITEM(item_##SUFFIX##_128, 128, Q_BF16, KV_BF16, WIDE)                                            \
    ITEM(item_##SUFFIX##_any, d, Q_BF16, KV_BF16, 8)
ITEMS(bf16_bf16, 1, 1)
ITEMS(f32_f32, 0, 0)
ITEMS(f32_bf16, 0, 1) /* float32 compute over a bf16 cache (CPUs without bf16 matmuls) */

typedef void (*item_fn)(const void *, const void *, const void *, const int32_t *, int, void *, int, int,
                        int, float, float *);

#define PICK(SUFFIX, D) ((D) == 64 ? item_##SUFFIX##_64 : (D) == 128 ? item_##SUFFIX##_128 : item_##SUFFIX##_any)

/* q, out: [n_seqs, kv_heads * group, d] (bf16 or float32); caches: [kv_heads, slots, d] (bf16 or
 * float32; a float32 cache needs a float32 q); block_tables: [n_seqs, max_blocks];
 * context_lens: [n_seqs] (tokens, the new one included).
 * Returns 0, or -1 for an unsupported shape or dtype pair, or out of memory. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens, void *out,
                           int n_seqs, int kv_heads, int group, int d, int64_t slots, int block_size,
                           int max_blocks, float scale, int q_bf16, int kv_bf16, int num_threads) {
    if (group > MAX_GROUP || d > MAX_HEAD_DIM || d % 8 || block_size > MAX_BLOCK) return -1;
    if (q_bf16 && !kv_bf16) return -1;
    const item_fn item = q_bf16 ? PICK(bf16_bf16, d) : kv_bf16 ? PICK(f32_bf16, d) : PICK(f32_f32, d);
    const int q_elem = q_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4;
    int max_len = 1;
    for (int s = 0; s < n_seqs; s++) max_len = context_lens[s] > max_len ? context_lens[s] : max_len;
    const int items = n_seqs * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)max_len);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            if (!scores) continue;
            /* Rows arrive shortest context first: start with the longest to balance the threads. */
            const int s = (items - 1 - it) / kv_heads, h = (items - 1 - it) % kv_heads;
            const int64_t row = ((int64_t)s * kv_heads + h) * group * d;
            item((const char *)q + row * q_elem, (const char *)k_cache + h * slots * d * kv_elem,
                 (const char *)v_cache + h * slots * d * kv_elem, block_tables + (int64_t)s * max_blocks,
                 context_lens[s], (char *)out + row * q_elem, group, d, block_size, scale, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
