/* y = x @ w.T with x, w, y in bfloat16 (float32 sums), on AVX512-BF16's VDPBF16PS.
 *
 * A decode step multiplies 1 to a few dozen rows by every weight of the model. Up to about a
 * dozen rows that is bound by reading the weights from DRAM, above by the bf16 dot-product rate;
 * oneDNN's bf16 GEMM reaches neither bound at these shapes (bench/README.md, "CPU kernels").
 * Here the weight is packed once (at load, by fairway/models/packed_linear.py) into panels of 16
 * output columns, each panel [k/2][16][2]: one 64-byte load gives 16 columns x 2 k-values, the
 * operand layout of VDPBF16PS, and a panel is read front to back as one stream. A pair of x
 * values is broadcast as one 32-bit value, so a tile of MR rows x NV panels keeps MR*NV float32
 * accumulators and NV weight vectors in registers and reads each weight vector once per MR rows.
 *
 * Each thread takes a contiguous run of panels and walks it NV panels at a time; more rows than
 * one tile holds are done in chunks that re-read those NV panels from L2. With `prefetch` the
 * chunks of a tile also pull the thread's next NV panels from DRAM into L2, spread evenly over
 * the tile's chunks: otherwise the first chunk waits on DRAM while the later ones leave it idle,
 * worst where reading and multiplying take about as long (around 16 rows). Prefetching further
 * ahead, or into L1, measured no better. Past the DRAM-bound rows the kernel still beat oneDNN at
 * every size measured, so Python uses it for all.
 * The sums round to bf16 to nearest-even, as PyTorch's bf16 matmul does.
 *
 * The file is built with -march=native: on a CPU without AVX512-BF16 bf16_linear_available()
 * returns 0, bf16_linear() returns -1, and Python keeps oneDNN. Built with the other kernels by
 * fairway/models/cpu_kernels.py.
 */
#include <stdint.h>

#define PANEL 16 /* output columns per packed panel: one zmm of float32 */
#define MAX_NV 4
#define MAX_MR 16
#define MAX_ACCUMULATORS 28 /* of the 32 zmm registers; NV more hold the weights */

int bf16_linear_available(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* Whether bf16_linear() takes this tile: mr rows x nv panels whose accumulators fit in registers. */
int bf16_linear_tile_ok(int mr, int nv) {
    return nv >= 1 && nv <= MAX_NV && mr >= 1 && mr <= MAX_MR && mr * nv <= MAX_ACCUMULATORS;
}

#ifdef __AVX512BF16__
#include <immintrin.h>
#include <omp.h>

/* Where a tile's chunk prefetches: `lines` cache lines per k-pair step from `at` on. */
typedef struct {
    const char *at;
    int lines;
} prefetch_plan;

typedef void (*tile_fn)(const uint32_t *x, int ldx, const uint16_t *w, int64_t panel_stride, int kp,
                        uint16_t *y, int ldy, int cols, prefetch_plan pf);

/* MR rows of x (bf16 pairs, row stride ldx pairs) against NV panels, into y[0:MR, 0:cols]. With MR
 * and NV constants the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_body(const uint32_t *restrict x, int ldx,
        const uint16_t *restrict w, int64_t panel_stride, int kp, uint16_t *restrict y, int ldy, int cols,
        prefetch_plan pf, const int MR, const int NV) {
    __m512 acc[MAX_MR][MAX_NV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int q = 0; q < kp; q++) {
        /* _MM_HINT_T1: into L2, which holds a tile for its later chunks; L1 is for this one. */
        for (int i = 0; i < pf.lines; i++) _mm_prefetch(pf.at + ((int64_t)q * pf.lines + i) * 64, _MM_HINT_T1);
        __m512bh wv[MAX_NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * panel_stride + (int64_t)q * 32);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[(int64_t)r * ldx + q]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xb);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[r][v]);
            uint16_t *dst = y + (int64_t)r * ldy + v * PANEL;
            const int left = cols - v * PANEL; /* >= 1: the caller passes only panels holding columns */
            if (left >= PANEL) _mm256_storeu_si256((__m256i *)dst, out);
            else _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << left) - 1), out);
        }
}

#define TILE(MR, NV)                                                                                     \
    static void tile_##MR##_##NV(const uint32_t *x, int ldx, const uint16_t *w, int64_t ps, int kp,   \
                                 uint16_t *y, int ldy, int cols, prefetch_plan pf) {                    \
        tile_body(x, ldx, w, ps, kp, y, ldy, cols, pf, MR, NV);                                         \
    }
/* Every shape bf16_linear_tile_ok() accepts, and no other (those would spill the accumulators). */
#define UP_TO_4(MR) TILE(MR, 1) TILE(MR, 2) TILE(MR, 3) TILE(MR, 4)
#define UP_TO_3(MR) TILE(MR, 1) TILE(MR, 2) TILE(MR, 3)
#define UP_TO_2(MR) TILE(MR, 1) TILE(MR, 2)
UP_TO_4(1) UP_TO_4(2) UP_TO_4(3) UP_TO_4(4) UP_TO_4(5) UP_TO_4(6) UP_TO_4(7)
UP_TO_3(8) UP_TO_3(9)
UP_TO_2(10) UP_TO_2(11) UP_TO_2(12) UP_TO_2(13) UP_TO_2(14)
TILE(15, 1) TILE(16, 1)

#define ROW4(MR) {tile_##MR##_1, tile_##MR##_2, tile_##MR##_3, tile_##MR##_4}
#define ROW3(MR) {tile_##MR##_1, tile_##MR##_2, tile_##MR##_3, 0}
#define ROW2(MR) {tile_##MR##_1, tile_##MR##_2, 0, 0}
#define ROW1(MR) {tile_##MR##_1, 0, 0, 0}
static const tile_fn TILES[MAX_MR][MAX_NV] = {
    ROW4(1), ROW4(2), ROW4(3), ROW4(4), ROW4(5), ROW4(6), ROW4(7), ROW3(8), ROW3(9),
    ROW2(10), ROW2(11), ROW2(12), ROW2(13), ROW2(14), ROW1(15), ROW1(16)};

static inline int min_int(int a, int b) { return a < b ? a : b; }

/* Chunk c of `chunks` of a tile prefetches its share of the next tile, which starts where this one
 * ends (panels are contiguous). Past the thread's last panel the addresses may lie beyond the
 * weight: a prefetch never faults. */
static prefetch_plan plan_for(const uint16_t *w, int width, int64_t panel_stride, int kp, int c, int chunks) {
    const int lines = (width + chunks - 1) / chunks; /* per step; kp steps read width*kp lines */
    const prefetch_plan pf = {(const char *)(w + width * panel_stride) + (int64_t)c * lines * kp * 64, lines};
    return pf;
}

/* One thread's run of panels [p0, p1): nv panels at a time, all m rows in balanced chunks. y's rows
 * are ldy apart, and hold n columns from panel 0's first. */
static void run_panels(const uint32_t *x, const uint16_t *packed, uint16_t *y, int m, int n, int ldy, int kp,
                       int p0, int p1, int nv, int mr, int prefetch) {
    const int64_t panel_stride = (int64_t)kp * 2 * PANEL;
    const int chunks = (m + mr - 1) / mr, rows_per_chunk = (m + chunks - 1) / chunks;
    const prefetch_plan none = {0, 0};
    for (int p = p0; p < p1; p += nv) {
        const int width = min_int(nv, p1 - p), cols = min_int(n - p * PANEL, width * PANEL);
        const uint16_t *w = packed + (int64_t)p * panel_stride;
        for (int c = 0, r = 0; r < m; c++, r += rows_per_chunk) {
            const int rows = min_int(rows_per_chunk, m - r);
            const prefetch_plan pf = prefetch ? plan_for(w, width, panel_stride, kp, c, chunks) : none;
            TILES[rows - 1][width - 1](x + (int64_t)r * kp, kp, w, panel_stride, kp, y + (int64_t)r * ldy + p * PANEL,
                                       ldy, cols, pf);
        }
    }
}
#endif

/* One thread's product of all m rows of x ([m, k] bf16) with `width` (<= MAX_NV) panels laid out
 * as below, one after another at w: outputs into y (row stride ldy), cols of them real. For weights
 * unpacked panel by panel elsewhere (quant_linear.c's many-row path), so in cache already: no
 * prefetch. The tile is the many-row one (4 panels x 4 rows, cpu_kernels.py's tile_for).
 * Returns 0, or -1 when not compiled in. */
int bf16_linear_panels(const uint16_t *x, const uint16_t *w, int width, uint16_t *y, int ldy, int cols, int m, int k) {
#ifdef __AVX512BF16__
    run_panels((const uint32_t *)x, w, y, m, cols, ldy, k / 2, 0, width, width, 4, 0);
    return 0;
#else
    (void)x, (void)w, (void)width, (void)y, (void)ldy, (void)cols, (void)m, (void)k;
    return -1;
#endif
}

/* x: [m, k] bf16, contiguous; packed: the weight [n, k] as ceil(n/16) panels of [k/2][16][2] bf16
 * (columns past n zero); y: [m, n] bf16. Tile: mr rows x nv panels (bf16_linear_tile_ok).
 * Returns 0, or -1 for what this kernel does not take (everything, when it was not compiled in). */
int bf16_linear(const uint16_t *x, const uint16_t *packed, uint16_t *y, int m, int n, int k, int nv, int mr,
                int prefetch, int num_threads) {
#ifdef __AVX512BF16__
    if (m < 1 || n < 1 || k < 2 || k % 2 || !bf16_linear_tile_ok(mr, nv)) return -1;
    const int kp = k / 2, panels = (n + PANEL - 1) / PANEL;
    /* Waking the second thread costs ~microseconds: a small weight (< 32 KB) is read by one. */
    const int threads = (int64_t)panels * kp * 64 < 32 * 1024 ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        run_panels((const uint32_t *)x, packed, y, m, n, n, kp, (int)((int64_t)panels * t / nt),
                   (int)((int64_t)panels * (t + 1) / nt), nv, mr, prefetch);
    }
    return 0;
#else
    (void)x, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)nv, (void)mr, (void)prefetch;
    (void)num_threads;
    return -1;
#endif
}
