/* quant_linear.c's weights on AMX tiles (Intel Sapphire Rapids and later), for the many rows of a
 * batched decode step, a speculative verification or a prefill, with bf16 activations. Two ways,
 * by the number of rows:
 *
 * Up to QUANT_AMX_EXACT_ROWS (48: a verification of several sequences' drafts), the exact sums
 * (quant_amx_sums), a tile's 16 rows a pass: the AVX512F path takes,
 * per row, column and block of 32, the float32 sum of x * q over the block (q the 4- or 8-bit
 * value as an integer: exact in bf16, and each product exact in float32), then adds d * sum (and
 * m * sum x, Q4_1) to the row's total. Here TDPBF16PS takes the block sums for the rows at once
 * from the same exact products; only the order of the float32 additions inside a block differs,
 * so a row's outputs are the AVX512F path's to float32 rounding, whatever the rows beside it
 * (quant_linear.c sends Q4 here from one row, so a verification's rows are a decode step's to
 * the bit; Q8_0 from 3 rows). A thread's blocks run as a pipeline, panel after panel: block u + 1
 * unpacked to a B operand (Q4: a 64-byte group's words as they lie, shifted, VPERMW), block u's
 * sums by TDPBF16PS into C tile u % 4, block u - 1's tile stored (a turn late: tile loads and
 * stores share port 5 with VPERMW, and a store right behind its product waits), block u - 5's
 * stored sums scaled into the rows' float32 totals, which stay in registers and go out as bf16 at
 * the panel's end. Tried and dropped: several blocks in one C tile; sharing unpacked operands
 * between 16-row passes.
 *
 * Past those, the dequantized weights (quant_amx_wide): the scaling above is a float32 FMA per
 * row, column and block, as many as the tile does in 1/32 of the time; it would bound a prefill.
 * Instead each thread unpacks two panels at a time to bf16 weights, d * q (+ m) rounded to the
 * nearest, which are the very weights `--weights dequantized` holds, into a buffer laid out as
 * bf16_linear.c's panels (quant_unpack_panel, quant_linear.c), and runs amx_linear.c's many-row
 * product on it: the unpacking is paid once per panel whatever the rows, and the outputs are the
 * dequantized model's.
 *
 * Tile state and permission are amx_linear.c's (amx_linear_available(), amx_configure()).
 * Built with the other kernels by cpu_kernels.py (-march=native): without AMX it compiles to a
 * stub that says so.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
#define QK 32
#define Q4_0 2
#define Q4_1 3
#define Q8_0 8
#define QUANT_AMX_EXACT_ROWS 48 /* in passes of a tile's 16 rows */
#define TILE_ROWS 16

int amx_linear_available(void);

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

void amx_configure(int rows);
void quant_unpack_panel(const uint8_t *panel, int qt, int nb, uint16_t *W);
void amx_run_wide(const uint16_t *x, int64_t ldx_bytes, const uint16_t *packed, uint16_t *y, int64_t ldy, int m,
                  int mp, int n, int kb, int64_t panel_stride, int p0, int p1);

/* quant_linear.c's block layout: bytes per block of a panel, and where its values start. */
static int block_bytes(int qt) { return qt == Q8_0 ? 16 * 34 : qt == Q4_1 ? 16 * 20 : 16 * 18; }
static int quants_at(int qt) { return qt == Q4_1 ? 64 : 32; }
static inline int min_int(int a, int b) { return a < b ? a : b; }

/* A block's values, exactly, as B: row q = k-pair q, words (column c at 2q, at 2q + 1). */
static inline __attribute__((always_inline)) void to_operand(const uint8_t *q, const int qt, uint16_t *B) {
    if (qt == Q8_0) { /* k-pair g: byte j is column j/2 at 2g + j%2, exact in bf16 */
        for (int g = 0; g < 16; g++) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32))));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32 + 16))));
            _mm512_store_si512(B + g * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        return;
    }
    /* bf16 bit patterns of 0..15 (Q4_0: -8..7), twice: VPERMW reads 5 index bits */
    const __m512i lut = qt == Q4_0
        ? _mm512_set_epi16(0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040,
                           0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000,
                           0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100)
        : _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                           0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                           0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
    for (int h = 0; h < 4; h++) { /* group h: nibble i of each word is k-pair 4h + i, as it lies */
        const __m512i raw = _mm512_loadu_si512(q + h * 64);
        for (int i = 0; i < 4; i++)
            _mm512_store_si512(B + (4 * h + i) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4 * i), lut));
    }
}

/* One thread's share of quant_amx_sums for a pass of MR <= 16 rows. */
typedef struct {
    const uint16_t *x; /* the pass's first row */
    int64_t ldx;       /* bytes per row of x */
    const float *sx;   /* its block sums [MR][nb] */
    const uint8_t *packed;
    uint16_t *y; /* [MR][n] bf16 */
    int n, nb;
} exact_args;

#define B_SLOTS 4   /* operands unpacked ahead, a ring (a tile load right after the stores that wrote it waits) */
#define SUM_SLOTS 8 /* block sums stored, a ring */
/* Blocks ahead whose bytes are prefetched: the hardware prefetcher alone left the unpacking
 * waiting on the weights' reads (bench/README.md, "Few rows on AMX"). */
#define PF_AHEAD 8
#define LAG 5       /* blocks between a block's product and its scaling: the tile store has landed */

/* Block s's sums (a stored C tile) scaled into the rows' totals, as quant_linear.c's finish_block;
 * at a panel's last block the totals go out as bf16. */
static inline __attribute__((always_inline)) void scale_block(const exact_args *a, __m512 acc[TILE_ROWS], const float *sums,
                                                              int64_t s, const int MR, const int QT) {
    const int64_t p = s / a->nb;
    const int b = (int)(s - p * a->nb), bb = block_bytes(QT);
    const uint8_t *blk = a->packed + s * bb;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 mn = QT == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : _mm512_setzero_ps();
    if (b == 0)
        for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int r = 0; r < MR; r++) {
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(sums + r * PANEL), d, acc[r]);
        if (QT == Q4_1) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sx[(int64_t)r * a->nb + b]), acc[r]);
    }
    if (b == a->nb - 1) {
        const int cols = min_int(PANEL, a->n - (int)p * PANEL);
        const __mmask16 mask = cols >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
        for (int r = 0; r < MR; r++)
            _mm256_mask_storeu_epi16(a->y + (int64_t)r * a->n + p * PANEL, mask, (__m256i)_mm512_cvtneps_pbh(acc[r]));
    }
}

/* Stage u of the pipeline over blocks [0, total) (panel-major from the thread's first): prefetch
 * block u + PF_AHEAD, unpack block u + 1, multiply block u into C tile t (= u % 4), store block
 * u - 1's tile (a turn late: tile loads and stores share port 5 with VPERMW, and a store right
 * after its product waits), scale block u - LAG. */
#define STAGE(u, t, ta, tb, prev)                                                                                      \
    do {                                                                                                    \
        const int64_t u_ = (u);                                                                             \
        if (u_ + PF_AHEAD < total)                                                                          \
            for (int l_ = 0; l_ < bb; l_ += 64) _mm_prefetch((const char *)first + (u_ + PF_AHEAD) * bb + l_, _MM_HINT_T0); \
        if (u_ + 1 < total) to_operand(first + (u_ + 1) * bb + quants_at(QT), QT, B + ((u_ + 1) % B_SLOTS) * 512); \
        if (u_ < total) {                                                                                   \
            const int b_ = (int)((g0 + u_) % a->nb);                                                        \
            _tile_zero(t);                                                                                  \
            _tile_loadd(ta, (const char *)a->x + (int64_t)b_ * 64, a->ldx);                      \
            _tile_loadd(tb, B + (u_ % B_SLOTS) * 512, 64);                                      \
            _tile_dpbf16ps(t, ta, tb);                                                \
        }                                                                                                   \
        if (u_ >= 1 && u_ - 1 < total) _tile_stored(prev, sums + ((u_ - 1) % SUM_SLOTS) * 256, 64);  \
        if (u_ >= LAG && u_ - LAG < total)                                                                  \
            scale_block(a, acc, sums + ((u_ - LAG) % SUM_SLOTS) * 256, g0 + u_ - LAG, MR, QT);              \
    } while (0)

/* Panels [p0, p1) of a pass of MR rows. B: B_SLOTS operands; sums: SUM_SLOTS tiles (64-byte aligned). */
static inline __attribute__((always_inline)) void run_exact(const exact_args *a, int p0, int p1, uint16_t *B,
                                                            float *sums, const int MR, const int QT) {
    const int bb = block_bytes(QT);
    const int64_t g0 = (int64_t)p0 * a->nb, total = (int64_t)(p1 - p0) * a->nb;
    const uint8_t *first = a->packed + g0 * bb;
    __m512 acc[TILE_ROWS];
    if (total <= 0) return;
    to_operand(first + quants_at(QT), QT, B);
    for (int64_t u = 0; u < total + LAG; u += 4) {
        STAGE(u, 0, 4, 6, 3); /* tile numbers are immediates: C t, A ta, B tb, the previous C */
        STAGE(u + 1, 1, 5, 7, 0);
        STAGE(u + 2, 2, 4, 6, 1);
        STAGE(u + 3, 3, 5, 7, 2);
    }
}

typedef void (*exact_fn)(const exact_args *a, int p0, int p1, uint16_t *B, float *sums);
#define EXACT(MR)                                                                                             \
    static void exact_##MR##_q40(const exact_args *a, int p0, int p1, uint16_t *B, float *s) { run_exact(a, p0, p1, B, s, MR, Q4_0); } \
    static void exact_##MR##_q41(const exact_args *a, int p0, int p1, uint16_t *B, float *s) { run_exact(a, p0, p1, B, s, MR, Q4_1); } \
    static void exact_##MR##_q80(const exact_args *a, int p0, int p1, uint16_t *B, float *s) { run_exact(a, p0, p1, B, s, MR, Q8_0); }
EXACT(1) EXACT(2) EXACT(3) EXACT(4) EXACT(5) EXACT(6) EXACT(7) EXACT(8)
EXACT(9) EXACT(10) EXACT(11) EXACT(12) EXACT(13) EXACT(14) EXACT(15) EXACT(16)
#define BY_TYPE(MR) {exact_##MR##_q40, exact_##MR##_q41, exact_##MR##_q80}
/* [rows - 1][Q4_0, Q4_1, Q8_0] */
static const exact_fn EXACT_TABLE[TILE_ROWS][3] = {
    BY_TYPE(1), BY_TYPE(2), BY_TYPE(3), BY_TYPE(4), BY_TYPE(5), BY_TYPE(6), BY_TYPE(7), BY_TYPE(8),
    BY_TYPE(9), BY_TYPE(10), BY_TYPE(11), BY_TYPE(12), BY_TYPE(13), BY_TYPE(14), BY_TYPE(15), BY_TYPE(16)};

#endif

/* 1 when this build and CPU multiply on AMX bf16 tiles (asks Linux for the tile state once). */
int quant_amx_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return amx_linear_available();
#else
    return 0;
#endif
}

static int takes(int m, int n, int k, int qt) {
    return m >= 1 && n >= 1 && k >= QK && k % QK == 0 && (qt == Q8_0 || qt == Q4_0 || qt == Q4_1) &&
           quant_amx_available();
}

/* Up to QUANT_AMX_EXACT_ROWS rows, in passes of 16 (so a row's sums are the same bits whatever the
 * rows beside it, up to a speculative verification of several sequences). x: [m, k] bf16 with its
 * block sums sx [m][k/32] (float32, as quant_linear.c takes them; read for Q4_1 only); packed:
 * quant_linear.c's panels of a [n, k] weight of type qt. y: [m, n] bf16, the float32 totals
 * rounded to nearest even. Returns 0, -1 for what it does not take (everything without AMX), -2
 * out of memory. */
int quant_amx_sums(const uint16_t *x, const float *sx, const uint8_t *packed, uint16_t *y, int m, int n, int k, int qt,
                   int num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (m > QUANT_AMX_EXACT_ROWS || !takes(m, n, k, qt)) return -1;
    const int panels = (n + PANEL - 1) / PANEL, threads = panels < 2 ? 1 : num_threads;
    const int nb = k / QK, ti = qt == Q4_0 ? 0 : qt == Q4_1 ? 1 : 2;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* B_SLOTS operands of 1 KB, then SUM_SLOTS stored tiles of 1 KB */
        uint16_t *B = aligned_alloc(64, (B_SLOTS + SUM_SLOTS) * 1024);
        if (B == NULL) {
            failed = 1;
        } else {
            const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
            for (int r0 = 0; r0 < m; r0 += TILE_ROWS) { /* each pass: a tile's rows, the same sums */
                const int rows = min_int(m - r0, TILE_ROWS);
                const exact_args a = {x + (int64_t)r0 * k, (int64_t)k * 2, sx + (int64_t)r0 * nb, packed,
                                      y + (int64_t)r0 * n, n, nb};
                amx_configure(rows);
                EXACT_TABLE[rows - 1][ti](&a, p0, p1, B, (float *)(B + B_SLOTS * 512));
            }
            _tile_release();
            free(B);
        }
    }
    return failed ? -2 : 0;
#else
    (void)x, (void)sx, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)qt, (void)num_threads;
    return -1;
#endif
}

/* More than QUANT_AMX_EXACT_ROWS rows. x: [m, k] bf16; y: [m, n] bf16, with the dequantized weights (above).
 * Returns 0, -1 for what it does not take, -2 out of memory. */
int quant_amx_wide(const uint16_t *x, const uint8_t *packed, uint16_t *y, int m, int n, int k, int qt,
                   int num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (m <= QUANT_AMX_EXACT_ROWS || !takes(m, n, k, qt)) return -1;
    const int nb = k / QK, panels = (n + PANEL - 1) / PANEL, mp = (m + 31) / 32 * 32;
    const int64_t panel_bytes = (int64_t)nb * block_bytes(qt), panel_stride = (int64_t)k * PANEL;
    uint16_t *padded = NULL;
    if (mp != m) { /* amx_run_wide's last 32-row block: missing rows are zeros */
        padded = aligned_alloc(64, (size_t)mp * (size_t)k * 2);
        if (padded == NULL) return -2;
        memcpy(padded, x, (size_t)m * (size_t)k * 2);
        memset(padded + (int64_t)m * k, 0, (size_t)(mp - m) * (size_t)k * 2);
    }
    const uint16_t *xs = padded ? padded : x;
    const int threads = panels < 2 ? 1 : num_threads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        uint16_t *W = aligned_alloc(64, (size_t)panel_stride * 2 * 2);
        if (W == NULL) {
            failed = 1;
        } else {
            amx_configure(16);
            for (int p = p0; p < p1; p += 2) {
                const int pair = min_int(2, p1 - p);
                for (int i = 0; i < pair; i++) quant_unpack_panel(packed + (p + i) * panel_bytes, qt, nb, W + i * panel_stride);
                amx_run_wide(xs, (int64_t)k * 2, W, y + p * PANEL, n, m, mp, n - p * PANEL, nb, panel_stride, 0, pair);
            }
            _tile_release();
            free(W);
        }
    }
    free(padded);
    return failed ? -2 : 0;
#else
    (void)x, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)qt, (void)num_threads;
    return -1;
#endif
}
