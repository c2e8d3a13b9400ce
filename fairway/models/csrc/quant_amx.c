/* quant_linear.c's AVX512F sums on AMX tiles (Intel Sapphire Rapids and later), for the many rows
 * of a batched decode step or a prefill, with bf16 activations.
 *
 * The AVX512F path takes, per row, column and block of 32, the float32 sum of x * q over the block
 * (q the 4- or 8-bit value as an integer: exact in bf16, and each product exact in float32), then
 * adds d * sum (and m * sum x, Q4_1) to the row's total. Here TDPBF16PS takes the block sums for
 * 16 rows at once from the same exact products; only the order of the float32 additions inside a
 * block differs, so the outputs are the AVX512F path's to float32 rounding, whatever the rows
 * (spec-decode verification and a lone decode row agree as closely as bf16 matmuls do).
 *
 * Per panel and block: the values become a B operand once (16 k-pairs x 16 columns x 2 bf16, by
 * table lookup for Q4 as the AVX512-BF16 path does), each 16-row chunk of x is an A operand, C0
 * takes the block's sums, and the rows are scaled from the stored tile into float32 totals.
 * Tile state and permission are amx_linear.c's (amx_linear_available()).
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

int amx_linear_available(void);

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

/* quant_linear.c's block layout: bytes per block of a panel, and where its values start. */
static int block_bytes(int qt) { return qt == Q8_0 ? 16 * 34 : qt == Q4_1 ? 16 * 20 : 16 * 18; }
static int quants_at(int qt) { return qt == Q4_1 ? 64 : 32; }
static inline int min_int(int a, int b) { return a < b ? a : b; }

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* C0: rows x 16 float32; A (4): rows x 32 bf16; B (6): 16 k-pairs x 16 columns x 2 bf16. */
static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.colsb[0] = cfg.colsb[4] = cfg.colsb[6] = 64;
    cfg.rows[0] = cfg.rows[4] = (uint8_t)rows;
    cfg.rows[6] = QK / 2;
    _tile_loadconfig(&cfg);
}

/* A block's values as B: row q = k-pair q, words (column c at 2q, at 2q + 1). */
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

/* One thread's panels [p0, p1): out [m][n] gets every row's totals; x has mp rows (zeros past m). */
static void run_panels(const uint16_t *x, int m, int mp, int n, int k, const float *sx, const uint8_t *packed, int qt,
                       float *out, int p0, int p1, float *acc) {
    float sums[16 * PANEL] __attribute__((aligned(64)));
    uint16_t B[QK / 2 * 32] __attribute__((aligned(64)));
    const int nb = k / QK, step = mp <= 16 ? mp : 16;
    const int64_t panel_bytes = (int64_t)nb * block_bytes(qt), ldx = (int64_t)k * 2;
    for (int p = p0; p < p1; p++) {
        memset(acc, 0, sizeof(float) * (size_t)m * PANEL);
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = packed + p * panel_bytes + (int64_t)b * block_bytes(qt);
            to_operand(blk + quants_at(qt), qt, B);
            _tile_loadd(6, B, 64);
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            const __m512 mins = qt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                           : _mm512_setzero_ps();
            for (int r0 = 0; r0 < mp; r0 += step) {
                _tile_zero(0);
                _tile_loadd(4, (const char *)x + r0 * ldx + b * 64, ldx);
                _tile_dpbf16ps(0, 4, 6);
                _tile_stored(0, sums, 64);
                for (int r = 0; r < min_int(step, m - r0); r++) { /* as quant_linear.c's finish_block */
                    float *a = acc + (int64_t)(r0 + r) * PANEL;
                    __m512 v = _mm512_fmadd_ps(_mm512_load_ps(sums + r * PANEL), d, _mm512_loadu_ps(a));
                    if (qt == Q4_1) v = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx[(int64_t)(r0 + r) * nb + b]), v);
                    _mm512_storeu_ps(a, v);
                }
            }
        }
        const int cols = min_int(PANEL, n - p * PANEL);
        for (int r = 0; r < m; r++) memcpy(out + (int64_t)r * n + p * PANEL, acc + (int64_t)r * PANEL, cols * 4);
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

/* x: [m, k] bf16 with its block sums sx [m][k/32] (float32, as quant_linear.c takes them); packed:
 * quant_linear.c's panels of a [n, k] weight of type qt. out: [m, n] float32, the totals before
 * rounding to bf16. Returns 0, -1 for what it does not take (everything without AMX), -2 out of memory. */
int quant_amx_sums(const uint16_t *x, const float *sx, const uint8_t *packed, float *out, int m, int n, int k, int qt,
                   int num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (m < 1 || n < 1 || k < QK || k % QK || !(qt == Q8_0 || qt == Q4_0 || qt == Q4_1) || !quant_amx_available())
        return -1;
    const int panels = (n + PANEL - 1) / PANEL, mp = m <= 16 ? m : (m + 15) / 16 * 16;
    uint16_t *padded = NULL;
    if (mp != m) { /* the last chunk's missing rows are zeros */
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
        float *acc = aligned_alloc(64, (size_t)mp * PANEL * 4);
        if (acc == NULL) {
            failed = 1;
        } else {
            configure(mp <= 16 ? mp : 16);
            run_panels(xs, m, mp, n, k, sx, packed, qt, out, (int)((int64_t)panels * t / nt),
                       (int)((int64_t)panels * (t + 1) / nt), acc);
            _tile_release();
            free(acc);
        }
    }
    free(padded);
    return failed ? -2 : 0;
#else
    (void)x, (void)sx, (void)packed, (void)out, (void)m, (void)n, (void)k, (void)qt, (void)num_threads;
    return -1;
#endif
}
