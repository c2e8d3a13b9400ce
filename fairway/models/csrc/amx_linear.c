/* y = x @ w.T in bfloat16 (float32 sums) on AMX tiles (Intel Sapphire Rapids and later).
 *
 * The weight is the one bf16_linear.c packs: panels of 16 output columns, each [k/2][16][2]. That
 * is exactly AMX's B operand for TDPBF16PS: 16 rows (k-pairs) of 64 bytes (16 columns x 2 k-values),
 * so one k-block of 32 of a panel is 1 KB read front to back, and x rows are the A operand as they
 * lie ([rows][32 bf16] at the row stride). A decode step's few rows need 16 cycles of TDPBF16PS per
 * KB of weight, far under what DRAM delivers per cycle, so the kernel runs at the weight-read
 * bound for any row count up to a tile's 16 and a few tiles beyond, where oneDNN, which also uses
 * AMX here, spends its time in per-call setup and packing (bench/README.md, "CPU kernels").
 *
 * Tiles: C0..C3 accumulate 16 x 16 float32 outputs, A (tile 4, 5) holds rows of x, B (6, 7) a
 * panel's k-block. Up to 16 rows, one pass holds four panels' accumulators (C0..C3, B reloaded for
 * each); past 16 rows, 32-row blocks of two panels (2 x 2), the block's panels re-read from cache
 * for each further block. Rows past m in the last block are zeros in a padded copy of x.
 *
 * Each panel's next k-block is prefetched into L1 while the current one is multiplied.
 *
 * Each thread takes a contiguous run of panels and configures its own tiles (tile state is per
 * thread). Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), once per
 * process; amx_linear_available() asks. Built with the other kernels by cpu_kernels.py
 * (-march=native): without AMX it compiles to a stub that says so.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16  /* output columns per panel */
#define KBLOCK 32 /* bf16 values of k per tile row */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* C tiles and A tiles `rows` high (<= 16), B tiles 16 k-pairs; every row 64 bytes. Also
 * quant_amx.c's tiles. */
void amx_configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)(t >= 6 ? KBLOCK / 2 : rows);
    }
    /* GCC (12) does not see LDTILECFG read cfg: without this barrier it dropped the stores above */
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* quant_vnni.c's integer tiles: each tile's rows and bytes a row, as its passes lay them out. */
void amx_configure_tiles(const uint8_t rows[8], const uint8_t colsb[8]) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = colsb[t];
        cfg.rows[t] = rows[t];
    }
    __asm__ __volatile__("" : : "r"(&cfg) : "memory"); /* as in amx_configure */
    _tile_loadconfig(&cfg);
}

/* Rows [0, rows) of the C tile `acc` as bf16 (round to nearest even) into y, `cols` columns. */
static inline void store_rows(const float *acc, int rows, uint16_t *y, int64_t ldy, int cols) {
    const __mmask16 mask = cols >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++)
        _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * PANEL)));
}

#define STORE(tile, rows, y, ldy, cols)                                                                 \
    do {                                                                                                 \
        _tile_stored(tile, buf, PANEL * 4);                                                              \
        store_rows(buf, rows, y, ldy, cols);                                                             \
    } while (0)

static inline int min_int(int a, int b) { return a < b ? a : b; }

/* Each of `width` panels' next k-block (1 KB a panel from wb on) into L1 while this one is
 * multiplied: a tile load waits on its 16 lines, and the hardware prefetcher alone left a step's
 * linears short of the DRAM floor; one k-block ahead reaches it (bench/README.md, "CPU kernels").
 * Two ahead, or into L2 further ahead, measured worse. Past a panel's end this is the next
 * panel's start: read soon anyway, and a prefetch never faults. */
static inline void prefetch_next(const char *wb, int width, int64_t panel_bytes) {
    for (int v = 0; v < width; v++)
        for (int line = 0; line < 16; line++) _mm_prefetch(wb + v * panel_bytes + 1024 + line * 64, _MM_HINT_T0);
}

/* Up to 16 rows (x has exactly `m` rows, configured so): panels [p0, p1), four at a time. */
static void run_narrow(const uint16_t *x, int64_t ldx_bytes, const uint16_t *packed, uint16_t *y, int m, int n,
                       int kb, int64_t panel_stride, int p0, int p1) {
    float buf[16 * PANEL] __attribute__((aligned(64)));
    for (int p = p0; p < p1; p += 4) {
        const int width = min_int(4, p1 - p);
        const char *w = (const char *)(packed + (int64_t)p * panel_stride);
        const int64_t ps = panel_stride * 2; /* bytes */
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int b = 0; b < kb; b++) {
            _tile_loadd(4, (const char *)x + (int64_t)b * 64, ldx_bytes);
            const char *wb = w + (int64_t)b * 1024;
            prefetch_next(wb, width, ps);
            /* Constant tile numbers: the intrinsics take immediates. */
            _tile_loadd(6, wb, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (width > 1) { _tile_loadd(7, wb + ps, 64); _tile_dpbf16ps(1, 4, 7); }
            if (width > 2) { _tile_loadd(6, wb + 2 * ps, 64); _tile_dpbf16ps(2, 4, 6); }
            if (width > 3) { _tile_loadd(7, wb + 3 * ps, 64); _tile_dpbf16ps(3, 4, 7); }
        }
        uint16_t *yp = y + (int64_t)p * PANEL;
        STORE(0, m, yp, n, n - p * PANEL);
        if (width > 1) STORE(1, m, yp + PANEL, n, n - (p + 1) * PANEL);
        if (width > 2) STORE(2, m, yp + 2 * PANEL, n, n - (p + 2) * PANEL);
        if (width > 3) STORE(3, m, yp + 3 * PANEL, n, n - (p + 3) * PANEL);
    }
}

/* More than 16 rows: x padded to `mp` rows (a multiple of 32); panels [p0, p1) two at a time, each
 * pair against every 32-row block (its 2 x 16 KB-ish panels stay in L1/L2 across the blocks).
 * y's rows are ldy apart and n columns wide from panel 0 on. quant_amx.c runs it on panels it has
 * just unpacked. */
void amx_run_wide(const uint16_t *x, int64_t ldx_bytes, const uint16_t *packed, uint16_t *y, int64_t ldy, int m,
                  int mp, int n, int kb, int64_t panel_stride, int p0, int p1) {
    float buf[16 * PANEL] __attribute__((aligned(64)));
    const int64_t ps = panel_stride * 2;
    for (int p = p0; p < p1; p += 2) {
        const int pair = p + 1 < p1;
        const char *w = (const char *)(packed + (int64_t)p * panel_stride);
        for (int r = 0; r < mp; r += 32) {
            const char *xa = (const char *)x + (int64_t)r * ldx_bytes;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int b = 0; b < kb; b++) {
                _tile_loadd(4, xa + (int64_t)b * 64, ldx_bytes);
                _tile_loadd(5, xa + 16 * ldx_bytes + (int64_t)b * 64, ldx_bytes);
                if (r == 0) prefetch_next(w + (int64_t)b * 1024, pair ? 2 : 1, ps);
                _tile_loadd(6, w + (int64_t)b * 1024, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
                if (pair) {
                    _tile_loadd(7, w + ps + (int64_t)b * 1024, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            const int top = min_int(16, m - r), bottom = min_int(16, m - r - 16);
            uint16_t *yp = y + (int64_t)r * ldy + (int64_t)p * PANEL;
            if (top > 0) STORE(0, top, yp, ldy, n - p * PANEL);
            if (bottom > 0) STORE(1, bottom, yp + 16 * ldy, ldy, n - p * PANEL);
            if (pair && top > 0) STORE(2, top, yp + PANEL, ldy, n - (p + 1) * PANEL);
            if (pair && bottom > 0) STORE(3, bottom, yp + 16 * ldy + PANEL, ldy, n - (p + 1) * PANEL);
        }
    }
}
#endif

/* 1 when this CPU and kernel can multiply on AMX tiles (asks Linux for the tile state once). */
int amx_linear_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ok;
#else
    return 0;
#endif
}

/* x: [m, k] bf16, contiguous; packed: bf16_linear.c's panels for a [n, k] weight; y: [m, n] bf16.
 * k must be a multiple of 32. Returns 0, or -1 for what it does not take (everything without AMX),
 * -2 out of memory. */
int amx_linear(const uint16_t *x, const uint16_t *packed, uint16_t *y, int m, int n, int k, int num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (m < 1 || n < 1 || k < KBLOCK || k % KBLOCK || !amx_linear_available()) return -1;
    const int kb = k / KBLOCK, panels = (n + PANEL - 1) / PANEL;
    const int64_t panel_stride = (int64_t)k * PANEL; /* bf16 values */
    const int64_t ldx_bytes = (int64_t)k * 2;
    const int mp = m <= 16 ? m : (m + 31) / 32 * 32;
    uint16_t *padded = NULL;
    if (mp != m) { /* the last 32-row block's missing rows are zeros */
        padded = aligned_alloc(64, (size_t)mp * (size_t)k * 2);
        if (padded == NULL) return -2;
        memcpy(padded, x, (size_t)m * (size_t)k * 2);
        memset(padded + (int64_t)m * k, 0, (size_t)(mp - m) * (size_t)k * 2);
    }
    const uint16_t *xs = padded ? padded : x;
    /* A small weight (< 64 KB) is read by one thread: waking another costs more. */
    const int threads = (int64_t)panels * k * PANEL * 2 < 64 * 1024 ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        amx_configure(m <= 16 ? m : 16);
        if (m <= 16) run_narrow(xs, ldx_bytes, packed, y, m, n, kb, panel_stride, p0, p1);
        else amx_run_wide(xs, ldx_bytes, packed, y, n, m, mp, n, kb, panel_stride, p0, p1);
        _tile_release();
    }
    free(padded);
    return 0;
#else
    (void)x, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return -1;
#endif
}
