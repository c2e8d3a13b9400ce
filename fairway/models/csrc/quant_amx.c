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
 * (a speculative verification of a few rows and a lone decode row agree as closely as that).
 * Per panel, four blocks at a time: each block's values become a B operand, C0..C3 take the four
 * blocks' sums, and the rows are scaled from the stored tiles into float32 totals, so the four
 * products overlap and each row's totals are read and written once per four blocks.
 *
 * Past those, the dequantized weights (quant_amx_wide): the scaling above is a float32 FMA per
 * row, column and block, as many as the tile does in 1/32 of the time; it would bound a prefill.
 * Instead each thread unpacks two panels at a time to bf16 weights, d * q (+ m) rounded to the
 * nearest, which are the very weights `--weights dequantized` holds, into a buffer laid out as
 * bf16_linear.c's panels, and runs amx_linear.c's many-row product on it: the unpacking is paid
 * once per panel whatever the rows, and the outputs are the dequantized model's.
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
void amx_run_wide(const uint16_t *x, int64_t ldx_bytes, const uint16_t *packed, uint16_t *y, int64_t ldy, int m,
                  int mp, int n, int kb, int64_t panel_stride, int p0, int p1);

/* quant_linear.c's block layout: bytes per block of a panel, and where its values start. */
static int block_bytes(int qt) { return qt == Q8_0 ? 16 * 34 : qt == Q4_1 ? 16 * 20 : 16 * 18; }
static int quants_at(int qt) { return qt == Q4_1 ? 64 : 32; }
static inline int min_int(int a, int b) { return a < b ? a : b; }

/* A 4-bit code as its float (Q4_0: minus 8), by VPERMPS on its low 4 bits. */
static inline __m512 nibble_table(int qt) {
    return qt == Q4_0 ? _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8)
                      : _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}

/* A block's values, exactly, as B: row q = k-pair q, words (column c at 2q, at 2q + 1). */
static void to_operand(const uint8_t *q, int qt, uint16_t *B) {
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
    for (int g = 0; g < 8; g++) { /* k-quad g: low nibbles k-pair 2g, high nibbles 2g + 1 */
        const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + g * 32)));
        _mm512_store_si512(B + 2 * g * 32, _mm512_permutexvar_epi16(_mm512_and_si512(raw, _mm512_set1_epi16(0x0F)), lut));
        _mm512_store_si512(B + (2 * g + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), lut));
    }
}

/* C tile t of the four += A (x's block b) x B (its values). Tile numbers are immediates. */
#define BLOCK_SUMS(t, a, bt, b)                                                            \
    do {                                                                                   \
        _tile_loadd(a, (const char *)x + (int64_t)(b) * 64, ldx);                          \
        _tile_loadd(bt, B + (int64_t)(b) * (QK / 2 * 32), 64);                             \
        _tile_dpbf16ps(t, a, bt);                                                          \
    } while (0)

/* One thread's panels [p0, p1): out [m][n] gets every row's float32 totals, m <= 16. B: room for
 * a panel's operands (k/32 KB). */
static void run_exact(const uint16_t *x, int m, int n, int k, const float *sx, const uint8_t *packed, int qt,
                      float *out, int p0, int p1, uint16_t *B) {
    float sums[4][16 * PANEL] __attribute__((aligned(64)));
    float acc[16 * PANEL] __attribute__((aligned(64)));
    const int nb = k / QK, bb = block_bytes(qt);
    const int64_t panel_bytes = (int64_t)nb * bb, ldx = (int64_t)k * 2;
    for (int p = p0; p < p1; p++) {
        const uint8_t *panel = packed + p * panel_bytes;
        /* all the panel's operands first: a tile load right after the stores that wrote it waits */
        for (int b = 0; b < nb; b++) to_operand(panel + (int64_t)b * bb + quants_at(qt), qt, B + b * (QK / 2 * 32));
        memset(acc, 0, sizeof acc);
        for (int b0 = 0; b0 < nb; b0 += 4) {
            const int g = min_int(4, nb - b0);
            _tile_zero(0);
            BLOCK_SUMS(0, 4, 6, b0);
            if (g > 1) { _tile_zero(1); BLOCK_SUMS(1, 5, 7, b0 + 1); }
            if (g > 2) { _tile_zero(2); BLOCK_SUMS(2, 4, 6, b0 + 2); }
            if (g > 3) { _tile_zero(3); BLOCK_SUMS(3, 5, 7, b0 + 3); }
            _tile_stored(0, sums[0], 64);
            if (g > 1) _tile_stored(1, sums[1], 64);
            if (g > 2) _tile_stored(2, sums[2], 64);
            if (g > 3) _tile_stored(3, sums[3], 64);
            __m512 d[4], mins[4];
            for (int i = 0; i < g; i++) {
                const uint8_t *blk = panel + (int64_t)(b0 + i) * bb;
                d[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
                mins[i] = qt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                     : _mm512_setzero_ps();
            }
            for (int r = 0; r < m; r++) { /* as quant_linear.c's finish_block, four blocks in turn */
                __m512 v = _mm512_load_ps(acc + r * PANEL);
                for (int i = 0; i < g; i++) {
                    v = _mm512_fmadd_ps(_mm512_load_ps(sums[i] + r * PANEL), d[i], v);
                    if (qt == Q4_1) v = _mm512_fmadd_ps(mins[i], _mm512_set1_ps(sx[(int64_t)r * nb + b0 + i]), v);
                }
                _mm512_store_ps(acc + r * PANEL, v);
            }
        }
        const int cols = min_int(PANEL, n - p * PANEL);
        for (int r = 0; r < m; r++) memcpy(out + (int64_t)r * n + p * PANEL, acc + r * PANEL, cols * 4);
    }
}

/* A panel's weights, every block, as bf16 d * q (+ m) rounded to nearest even (the dequantized
 * model's weights), laid out as bf16_linear.c's panels: [k/2][16 columns][2]. Word 2c + o of a B
 * row is column c: the 16 columns' scales spread over 32 words by VPERMPS. */
static void unpack_panel(const uint8_t *panel, int qt, int nb, uint16_t *W) {
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 table = nibble_table(qt);
    const int bb = block_bytes(qt);
    for (int b = 0; b < nb; b++, W += QK / 2 * 32) {
        const uint8_t *blk = panel + (int64_t)b * bb, *q = blk + quants_at(qt);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 mn = qt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                     : _mm512_setzero_ps();
        const __m512 d0 = _mm512_permutexvar_ps(first, d), d1 = _mm512_permutexvar_ps(second, d);
        const __m512 m0 = _mm512_permutexvar_ps(first, mn), m1 = _mm512_permutexvar_ps(second, mn);
        if (qt == Q8_0) {
            for (int g = 0; g < 16; g++) {
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32))));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32 + 16))));
                _mm512_store_si512(W + g * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, d1), _mm512_mul_ps(lo, d0)));
            }
            continue;
        }
        for (int g = 0; g < 8; g++) { /* k-quad g: low nibbles k-pair 2g, high nibbles 2g + 1 */
            const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32)));
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32 + 16)));
            const __m512 alo = _mm512_permutexvar_ps(a, table), clo = _mm512_permutexvar_ps(c, table);
            const __m512 ahi = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), table);
            const __m512 chi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table);
            _mm512_store_si512(W + 2 * g * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(clo, d1, m1),
                                                                          _mm512_fmadd_ps(alo, d0, m0)));
            _mm512_store_si512(W + (2 * g + 1) * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(chi, d1, m1),
                                                                                _mm512_fmadd_ps(ahi, d0, m0)));
        }
    }
}
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
 * rows beside it, up to a speculative verification of several sequences). x: [m, k] bf16 with its block sums sx [m][k/32] (float32, as quant_linear.c takes
 * them); packed: quant_linear.c's panels of a [n, k] weight of type qt. out: [m, n] float32, the
 * totals before rounding to bf16. Returns 0, -1 for what it does not take (everything without
 * AMX), -2 out of memory. */
int quant_amx_sums(const uint16_t *x, const float *sx, const uint8_t *packed, float *out, int m, int n, int k, int qt,
                   int num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (m > QUANT_AMX_EXACT_ROWS || !takes(m, n, k, qt)) return -1;
    const int panels = (n + PANEL - 1) / PANEL, threads = panels < 2 ? 1 : num_threads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint16_t *B = aligned_alloc(64, (size_t)k * PANEL * 2);
        if (B == NULL) {
            failed = 1;
        } else {
            const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
            const int nb = k / QK;
            for (int r0 = 0; r0 < m; r0 += TILE_ROWS) { /* each pass: a tile's rows, the same sums */
                const int rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
                amx_configure(rows);
                run_exact(x + (int64_t)r0 * k, rows, n, k, sx + (int64_t)r0 * nb, packed, qt, out + (int64_t)r0 * n,
                          p0, p1, B);
            }
            _tile_release();
            free(B);
        }
    }
    return failed ? -2 : 0;
#else
    (void)x, (void)sx, (void)packed, (void)out, (void)m, (void)n, (void)k, (void)qt, (void)num_threads;
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
                for (int i = 0; i < pair; i++) unpack_panel(packed + (p + i) * panel_bytes, qt, nb, W + i * panel_stride);
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
