/* Paged decode attention for the CPU: one query row per new token of a decoding sequence (its last
 * token, and in a speculative verification its draft tokens after it), reading K/V in place
 * through the sequence's block table (no gathered copy of the context).
 *
 * Layout (fairway/models/paged_attention.py): a layer's cache is [kv_heads, slots, head_dim] with
 * slot = block * block_size + offset, so one block of one head is block_size * head_dim contiguous
 * values. Work items are (rows of one context, kv head) pairs; each handles the `group` query heads
 * of each row that share the KV head, so every K/V row is read from memory once and used by all
 * of them (a verification's rows share their sequence's blocks).
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
#define MAX_QUERIES 32 /* query rows of one item: a chunk's rows x group */
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
 * of a sequential one: bench/README.md, "CPU kernels"). Into every cache level: the V pass and a
 * speculative verification's other rows read the same blocks again, and a non-temporal prefetch
 * (which keeps them out of L2) made those reads miss (bench/README.md, "Speculative decoding"). */
static inline void prefetch(const void *base, int64_t off, size_t bytes, const int bf16) {
    const char *p = (const char *)base + off * (bf16 ? 2 : 4);
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
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

/* How many of a block's keys, from position t0 on, a row seeing len tokens reads (0: none). */
static inline int keys_seen(int len, int t0, int block_size) {
    return len <= t0 ? 0 : len - t0 < block_size ? len - t0 : block_size;
}

/* One item: `rows` consecutive rows of one context (one sequence's decode row, or a speculative
 * verification's rows: the same block table, row r seeing lens[r] tokens) for one kv head. q, out:
 * row r's group of query rows at r * stride; k, v: this head's cache; scores: scratch of
 * rows * group * lens[rows - 1] floats. Each block is converted once for all rows; every query's
 * sums run as they would for its row alone (same blocks, same lengths, same order), so a row's
 * output does not depend on which rows share its item. */
static inline __attribute__((always_inline)) void attend(const void *q, int64_t stride, const void *k,
        const void *v, const int32_t *restrict table, const int32_t *lens, int rows, void *out, int group, const int d,
        int block_size, float scale, float *restrict scores, const int q_bf16, const int bf16, const int w) {
    float qf[MAX_QUERIES * MAX_HEAD_DIM];
    float buf[MAX_BLOCK * MAX_HEAD_DIM];
    float acc[MAX_QUERIES * MAX_HEAD_DIM];
    const int64_t blk = (int64_t)block_size * d;
    const size_t blk_bytes = (size_t)blk * (bf16 ? 2 : 4);
    const int len = lens[rows - 1], queries = rows * group; /* lens ascend */
    for (int r = 0; r < rows; r++) load_floats(q, r * stride, qf + r * group * d, group * d, q_bf16);
    for (int i = 0; i < queries * d; i++) qf[i] *= scale;

    const int nblocks = (len + block_size - 1) / block_size;
    prefetch(k, table[0] * blk, blk_bytes, bf16);
    if (nblocks > 1) prefetch(k, table[1] * blk, blk_bytes, bf16);
    for (int t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
        /* Two blocks ahead; past the end of K, the first V blocks. */
        const int ahead = b + 2;
        if (ahead < nblocks) prefetch(k, table[ahead] * blk, blk_bytes, bf16);
        else if (ahead - nblocks < nblocks) prefetch(v, table[ahead - nblocks] * blk, blk_bytes, bf16);
        load_floats(k, table[b] * blk, buf, keys_seen(len, t0, block_size) * d, bf16);
        for (int r = 0; r < rows; r++) {
            const int nr = keys_seen(lens[r], t0, block_size);
            if (!nr) continue;
            for (int g = 0; g < group; g++) {
                float *sg = scores + (int64_t)(r * group + g) * len + t0;
                if (w == 16) block_scores_16(qf + (r * group + g) * d, buf, nr, d, sg);
                else block_scores_8(qf + (r * group + g) * d, buf, nr, d, sg);
            }
        }
    }

    float inv_sum[MAX_QUERIES];
    for (int i = 0; i < queries; i++) {
        float *sg = scores + (int64_t)i * len;
        const int li = lens[i / group];
        float m = -INFINITY;
        for (int t = 0; t < li; t++) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int t = 0; t < li; t++) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        inv_sum[i] = 1.f / sum;
    }

    memset(acc, 0, sizeof(float) * (size_t)(queries * d));
    for (int t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
        if (b + 2 < nblocks) prefetch(v, table[b + 2] * blk, blk_bytes, bf16);
        load_floats(v, table[b] * blk, buf, keys_seen(len, t0, block_size) * d, bf16);
        for (int r = 0; r < rows; r++) {
            const int nr = keys_seen(lens[r], t0, block_size);
            if (!nr) continue;
            for (int g = 0; g < group; g++) {
                const int i = r * group + g;
                if (w == 16) block_weighted_sum_16(scores + (int64_t)i * len + t0, buf, nr, d, acc + i * d);
                else block_weighted_sum_8(scores + (int64_t)i * len + t0, buf, nr, d, acc + i * d);
            }
        }
    }

    for (int i = 0; i < queries; i++) {
        const int64_t at = (i / group) * stride + (i % group) * d;
        for (int c = 0; c < d; c++) {
            const float x = acc[i * d + c] * inv_sum[i];
            if (q_bf16) ((uint16_t *)out)[at + c] = float_to_bf16(x);
            else ((float *)out)[at + c] = x;
        }
    }
}

/* Instantiations: query/output dtype x cache dtype x head_dim (64 and 128 constant, so their
 * accumulators live in registers and loops unroll; any other multiple of 8 generic). */
#define ITEM(NAME, D, Q_BF16, KV_BF16, W)                                                            \
    static void NAME(const void *q, int64_t stride, const void *k, const void *v, const int32_t *table,   \
                     const int32_t *lens, int rows, void *out, int group, int d, int block_size, float scale, \
                     float *scores) {                                                                 \
        attend(q, stride, k, v, table, lens, rows, out, group, D, block_size, scale, scores, Q_BF16,     \
               KV_BF16, W);                                                                           \
    }
#define ITEMS(SUFFIX, Q_BF16, KV_BF16)                                                               \
    ITEM(item_##SUFFIX##_64, 64, Q_BF16, KV_BF16, WIDE)                                              \
    ITEM(item_##SUFFIX##_128, 128, Q_BF16, KV_BF16, WIDE)                                            \
    ITEM(item_##SUFFIX##_any, d, Q_BF16, KV_BF16, 8)
ITEMS(bf16_bf16, 1, 1)
ITEMS(f32_f32, 0, 0)
ITEMS(f32_bf16, 0, 1) /* float32 compute over a bf16 cache (CPUs without bf16 matmuls) */

typedef void (*item_fn)(const void *, int64_t, const void *, const void *, const int32_t *, const int32_t *, int,
                        void *, int, int, int, float, float *);

#define PICK(SUFFIX, D) ((D) == 64 ? item_##SUFFIX##_64 : (D) == 128 ? item_##SUFFIX##_128 : item_##SUFFIX##_any)

/* Consecutive rows that share a context (a speculative verification's: equal block tables, each
 * row seeing one token more) go to one item, so each block is converted once for all of them; a
 * run is cut into two or more chunks where that leaves each thread at least two items. Writes
 * chunks as (first row, rows) pairs; returns how many. */
static int chunk_rows(const int32_t *tables, const int32_t *lens, int n_seqs, int kv_heads, int group,
                      int block_size, int max_blocks, int num_threads, int *chunks) {
    const int most = MAX_QUERIES / group;
    int n = 0;
    for (int s = 0; s < n_seqs;) {
        int e = s + 1;
        while (e < n_seqs && lens[e] == lens[e - 1] + 1 &&
               !memcmp(tables + (int64_t)e * max_blocks, tables + (int64_t)s * max_blocks,
                       sizeof(int32_t) * (size_t)((lens[e] + block_size - 1) / block_size)))
            e++;
        const int run = e - s;
        int pieces = (2 * num_threads + kv_heads - 1) / kv_heads;
        pieces = pieces < run ? pieces : run;
        int size = (run + pieces - 1) / pieces;
        size = size < most ? size : most;
        for (int r = s; r < e; r += size) {
            chunks[2 * n] = r;
            chunks[2 * n + 1] = e - r < size ? e - r : size;
            n++;
        }
        s = e;
    }
    return n;
}

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
    if (n_seqs < 1) return 0;
    const item_fn item = q_bf16 ? PICK(bf16_bf16, d) : kv_bf16 ? PICK(f32_bf16, d) : PICK(f32_f32, d);
    const int q_elem = q_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4;
    int max_len = 1;
    for (int s = 0; s < n_seqs; s++) max_len = context_lens[s] > max_len ? context_lens[s] : max_len;
    int *chunks = malloc(sizeof(int) * 2 * (size_t)n_seqs);
    if (!chunks) return -1;
    const int n_chunks = chunk_rows(block_tables, context_lens, n_seqs, kv_heads, group, block_size, max_blocks,
                                    num_threads, chunks);
    const int items = n_chunks * kv_heads;
    const int64_t stride = (int64_t)kv_heads * group * d; /* elements from one row's queries to the next's */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)MAX_QUERIES * (size_t)max_len);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            if (!scores) continue;
            /* Rows arrive shortest context first: start with the longest to balance the threads. */
            const int c = (items - 1 - it) / kv_heads, h = (items - 1 - it) % kv_heads;
            const int s = chunks[2 * c], rows = chunks[2 * c + 1];
            const int64_t row = ((int64_t)s * kv_heads + h) * group * d;
            item((const char *)q + row * q_elem, stride, (const char *)k_cache + h * slots * d * kv_elem,
                 (const char *)v_cache + h * slots * d * kv_elem, block_tables + (int64_t)s * max_blocks,
                 context_lens + s, rows, (char *)out + row * q_elem, group, d, block_size, scale, scores);
        }
        free(scores);
    }
    free(chunks);
    return failed ? -1 : 0;
}
