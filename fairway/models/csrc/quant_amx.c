/* y = x @ w.T on AMX tiles for bf16 x and a weight held as GGUF Q8_0/Q4_0/Q4_1 blocks (Intel
 * Sapphire Rapids and later), for the rows of a batched decode step or a prefill.
 *
 * The weight is quant_linear.c's panels (16 output columns, block by block along k). Each thread
 * unpacks one panel at a time into bf16 (d * q + m in float32, rounded to bf16: the very values
 * --weights dequantized holds) in a buffer of 1 KB a block that is AMX's B operand (16 k-pairs x
 * 16 columns x 2), then multiplies every row against it with TDPBF16PS: the unpacking, ~150 vector
 * instructions a block, is paid once per panel and block however many rows there are, and the
 * products cost next to nothing. Below QUANT_AMX_MIN_ROWS rows quant_linear.c's register kernels
 * are faster (they multiply as they unpack) and take the call (bench/README.md, "Quantized weights").
 *
 * Tiles: C0..C3 accumulate four 16-row chunks of outputs, A (tile 4) a chunk's x, B (tile 6) the
 * panel's k-block. Up to 16 rows, tiles are m rows high; past that x is padded to whole 16-row
 * chunks. Tile state and permission are amx_linear.c's (amx_linear_available()).
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

static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)(t >= 6 ? QK / 2 : rows);
    }
    _tile_loadconfig(&cfg);
}

/* Two B rows' worth of 16 columns: floats for words 0..15 (columns 0..7) and 16..31 (8..15). */
static inline void put_row(uint16_t *row, __m512i lo, __m512i hi, __m512 d_lo, __m512 d_hi, __m512 m_lo,
                           __m512 m_hi) {
    const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d_lo, m_lo);
    const __m512 b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d_hi, m_hi);
    _mm512_store_si512(row, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* One panel's blocks -> nb B operands of [16 k-pairs][16 columns][2] bf16. */
static void unpack_panel(const uint8_t *panel, int nb, int qt, uint16_t *out) {
    const __m512i pair_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
    const __m512i nib = _mm512_set1_epi32(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = panel + (int64_t)b * block_bytes(qt), *q = blk + quants_at(qt);
        uint16_t *B = out + (int64_t)b * 512;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = qt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                       : qt == Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)) : _mm512_setzero_ps();
        const __m512 d_lo = _mm512_permutexvar_ps(pair_lo, d), d_hi = _mm512_permutexvar_ps(pair_hi, d);
        const __m512 m_lo = _mm512_permutexvar_ps(pair_lo, m), m_hi = _mm512_permutexvar_ps(pair_hi, m);
        if (qt == Q8_0) {
            for (int g = 0; g < 16; g++) /* k-pair g: byte j is column j/2 at 2g + j%2 */
                put_row(B + g * 32, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32))),
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32 + 16))), d_lo, d_hi, m_lo,
                        m_hi);
        } else {
            for (int g = 0; g < 8; g++) { /* k-quad g: low nibbles pair 2g, high nibbles pair 2g + 1 */
                const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32)));
                const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32 + 16)));
                put_row(B + 2 * g * 32, _mm512_and_si512(lo, nib), _mm512_and_si512(hi, nib), d_lo, d_hi, m_lo, m_hi);
                put_row(B + (2 * g + 1) * 32, _mm512_srli_epi32(lo, 4), _mm512_srli_epi32(hi, 4), d_lo, d_hi, m_lo,
                        m_hi);
            }
        }
    }
}

/* Rows [0, rows) of C tile contents `acc` (16 x 16 float32) as bf16 into y, `cols` columns. */
static inline void store_rows(const float *acc, int rows, uint16_t *y, int64_t ldy, int cols) {
    const __mmask16 mask = cols >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++)
        _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * PANEL)));
}

#define STORE(tile, chunk)                                                                               \
    do {                                                                                                 \
        _tile_stored(tile, buf, PANEL * 4);                                                              \
        store_rows(buf, min_int(16, m - r - 16 * (chunk)), y + (int64_t)(r + 16 * (chunk)) * n + p * PANEL, n, \
                   n - p * PANEL);                                                                       \
    } while (0)

/* One thread's panels [p0, p1) against rows [0, mp) of x (mp: m, or m padded to 16s). */
static void run_panels(const uint16_t *x, int m, int mp, int n, int k, const uint8_t *packed, int qt,
                       uint16_t *y, int p0, int p1, uint16_t *unpacked) {
    float buf[16 * PANEL] __attribute__((aligned(64)));
    const int nb = k / QK, step = mp <= 16 ? mp : 16;
    const int64_t ldx = (int64_t)k * 2, panel_bytes = (int64_t)nb * block_bytes(qt);
    for (int p = p0; p < p1; p++) {
        unpack_panel(packed + p * panel_bytes, nb, qt, unpacked);
        for (int r = 0; r < mp; r += 4 * step) {
            const int chunks = min_int(4, (mp - r + step - 1) / step);
            const char *xa = (const char *)x + r * ldx;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int b = 0; b < nb; b++) {
                _tile_loadd(6, unpacked + (int64_t)b * 512, 64);
                _tile_loadd(4, xa + b * 64, ldx);
                _tile_dpbf16ps(0, 4, 6);
                if (chunks > 1) { _tile_loadd(4, xa + 16 * ldx + b * 64, ldx); _tile_dpbf16ps(1, 4, 6); }
                if (chunks > 2) { _tile_loadd(4, xa + 32 * ldx + b * 64, ldx); _tile_dpbf16ps(2, 4, 6); }
                if (chunks > 3) { _tile_loadd(4, xa + 48 * ldx + b * 64, ldx); _tile_dpbf16ps(3, 4, 6); }
            }
            STORE(0, 0);
            if (chunks > 1) STORE(1, 1);
            if (chunks > 2) STORE(2, 2);
            if (chunks > 3) STORE(3, 3);
        }
    }
}
#endif

/* 1 when this build and CPU multiply quantized weights on AMX tiles. */
int quant_amx_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return amx_linear_available();
#else
    return 0;
#endif
}

/* x: [m, k] bf16, contiguous; packed: quant_linear.c's panels of a [n, k] weight of type qt;
 * y: [m, n] bf16. Returns 0, -1 for what it does not take (everything without AMX), -2 out of memory. */
int quant_amx_linear(const uint16_t *x, const uint8_t *packed, uint16_t *y, int m, int n, int k, int qt,
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
        uint16_t *unpacked = aligned_alloc(64, (size_t)(k / QK) * 1024);
        if (unpacked == NULL) {
            failed = 1;
        } else {
            configure(mp <= 16 ? mp : 16);
            run_panels(xs, m, mp, n, k, packed, qt, y, (int)((int64_t)panels * t / nt),
                       (int)((int64_t)panels * (t + 1) / nt), unpacked);
            _tile_release();
            free(unpacked);
        }
    }
    free(padded);
    return failed ? -2 : 0;
#else
    (void)x, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)qt, (void)num_threads;
    return -1;
#endif
}
