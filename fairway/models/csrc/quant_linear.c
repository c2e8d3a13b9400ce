/* y = x @ w.T with w held as GGUF Q8_0, Q4_0 or Q4_1 blocks: the 4- or 8-bit values are unpacked
 * in registers and multiplied in float32 (FMA) or bf16 (VDPBF16PS); nothing is dequantized to
 * memory. A decode step reads the weights once, so reading 4.5-5 bits a weight instead of bf16's 16
 * is the gain (bench/README.md, "Quantized weights").
 *
 * The weight is repacked once at load (fairway/models/quant_linear.py) into panels of 16 output
 * columns, block by block along k, with the same bytes a ggml block holds (16 blocks of a panel):
 *   [16 fp16 scales d][16 fp16 mins m, Q4_1 only][quants of 16 columns x 32 k]
 * Q4 quants: 4 groups of 64 bytes, each 8 k of the 16 columns; word j (16 bits) of group h holds
 * column j/2's values at k = 8h + 2i + j%2 in its nibble i. So a group read as it lies is 32
 * words whose nibble i is a VDPBF16PS / AMX operand (16 columns x k-pair 4h + i: shift by 4i, no
 * widening shuffle), and read as 16 dwords, column c in dword c, a shift by 4i + 16o gives the
 * columns at k = 8h + 2i + o. Q8_0 quants: 16 k-pairs of 32 bytes, byte j column j/2 at k0 + j%2.
 * A nibble becomes its float (Q4_0: minus 8) by a 16-entry table lookup (VPERMPS / VPERMW read
 * only an index's low 4 / 5 bits, so no mask).
 *
 * A tile of MR rows x one panel keeps per block an accumulator of sum_k x q per row and column, and
 * adds d * that (and m * sum_k x, Q4_1's offset) to the running sums at the block's end. A thread's
 * panels lie one after another, so taking them one at a time reads its share of the weight as one
 * sequential stream, which the hardware prefetcher follows from DRAM; several panels at once were
 * several streams a panel apart and read slower (bench/README.md, "One panel a tile").
 *
 * Paths, chosen at run time by what the CPU reports (quant_isas): AVX512-BF16 (bf16 activations),
 * AVX512F (float32 activations, or bf16 ones widened) and AVX2 + FMA (float32, 8 columns a
 * vector); and for bf16 activations AMX tiles (quant_amx.c; Q4 from one row, Q8_0 from
 * QUANT_AMX_MIN_ROWS_Q8), which up to 48 rows take each block's sum as the AVX512F path does but
 * for the order of the float32 additions, and integer dot products (quant_vnni.c, ISA_VNNI: the
 * path Python picks for steps of one or two sequences, QuantLinear.path). Past QUANT_EXACT_ROWS
 * rows (a prefill) the AVX512-BF16 and AMX paths multiply the weights dequantized to bf16 panel by
 * panel (quant_bf16_wide, quant_amx_wide), the AVX2 path to float32 (quant_avx2_wide). The file
 * is built with -march=native but each path carries its own target
 * attribute, so it compiles on any x86-64 compiler that knows the instructions. Elsewhere
 * quant_isas() is 0 and Python keeps the dequantized weights. Built with the other kernels by
 * cpu_kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
#define QK 32
#define MAX_MR 8
/* ggml's type ids */
#define Q4_0 2
#define Q4_1 3
#define Q8_0 8
/* quant_isas() bits */
#define ISA_AVX2 1
#define ISA_AVX512 2
#define ISA_AVX512BF16 4
#define ISA_AMX 8 /* bf16 activations: the AVX512F path's sums on AMX tiles (quant_amx.c) */
#define ISA_VNNI 16 /* bf16 activations as integers, integer dot products (quant_vnni.c), up to 48 rows */
/* Q4 on AMX from one row (as fast as FMA there, and then every row count up to 48 sums alike);
 * Q8_0 unpacks to an operand at more cost, so one and two rows stay on FMA */
#define QUANT_AMX_MIN_ROWS_Q8 3
#define QUANT_EXACT_ROWS 48 /* past it the products run on the dequantized weights (quant_bf16_wide) */
#define WIDE_PANELS 4        /* panels unpacked at a time there: bf16_linear.c's many-row tile */

int quant_amx_available(void);
int quant_amx_sums(const uint16_t *x, const float *sx, const uint8_t *packed, uint16_t *y, int m, int n, int k,
                   int qt, int num_threads);
int quant_amx_wide(const uint16_t *x, const uint8_t *packed, uint16_t *y, int m, int n, int k, int qt,
                   int num_threads);
int quant_vnni_available(void);
int quant_vnni(const uint16_t *x, const float *sx, const uint8_t *packed, uint16_t *y, int m, int n, int k, int qt,
               int num_threads);
int bf16_linear_panels(const uint16_t *x, const uint16_t *w, int width, uint16_t *y, int ldy, int cols, int m, int k);

static int block_bytes(int qt) { return qt == Q8_0 ? 16 * 34 : qt == Q4_1 ? 16 * 20 : 16 * 18; }
static int quants_at(int qt) { return qt == Q4_1 ? 64 : 32; }
static int known_type(int qt) { return qt == Q8_0 || qt == Q4_0 || qt == Q4_1; }
static inline int min_int(int a, int b) { return a < b ? a : b; }

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <omp.h>

int quant_isas(void) {
    static int known = -1;
    if (known >= 0) return known;
    __builtin_cpu_init();
    int isas = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isas |= ISA_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) isas |= ISA_AVX512;
    if ((isas & ISA_AVX512) && __builtin_cpu_supports("avx512bf16")) isas |= ISA_AVX512BF16;
    if ((isas & ISA_AVX512BF16) && quant_amx_available()) isas |= ISA_AMX;
    if ((isas & ISA_AVX512BF16) && quant_vnni_available()) isas |= ISA_VNNI;
    return known = isas;
}

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")))
#define T256 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* One tile's operands: x rows (float32, or bf16 pairs as uint32), their block sums sx [rows][nb],
 * the panel's bytes, and where the outputs go. */
typedef struct {
    const void *x;
    int ldx; /* elements (float32) or pairs (bf16) per row */
    const float *sx;
    int nb;
    const uint8_t *w; /* the panel's first block */
    void *y;
    int ldy, cols, y_bf16;
} tile_args;

typedef void (*tile_fn)(const tile_args *a);

T512 INLINE void store16(void *y, int64_t at, __m512 v, int left, int y_bf16) {
    const __mmask16 mask = left >= PANEL ? 0xFFFF : (__mmask16)((1u << left) - 1);
    if (y_bf16) { /* round to nearest even, as a bf16 matmul does */
        const __m512i u = _mm512_castps_si512(v);
        const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                                _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                 _mm512_set1_epi32(1))));
        _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    } else {
        _mm512_mask_storeu_ps((float *)y + at, mask, v);
    }
}

/* The block's scales applied: acc += d * blk (+ m * sum x, Q4_1). */
T512 INLINE void finish_block(__m512 acc[MAX_MR], __m512 blk[MAX_MR], const tile_args *a, int b, const int MR,
                              const int QT) {
    const uint8_t *blkp = a->w + (int64_t)b * block_bytes(QT);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blkp));
    const __m512 m = QT == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blkp + 32)))
                                : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        acc[r] = _mm512_fmadd_ps(blk[r], d, acc[r]);
        if (QT == Q4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->sx[(int64_t)r * a->nb + b]), acc[r]);
    }
}

/* A 4-bit code as its float (Q4_0: minus 8), by VPERMPS on its low 4 bits. */
T512 INLINE __m512 nibble_table(int qt) {
    return qt == Q4_0 ? _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8)
                      : _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}

/* float32 activations on AVX512F. */
T512 INLINE void f32_tile(const tile_args *a, const int MR, const int QT) {
    const float *x = a->x;
    __m512 acc[MAX_MR], blk[MAX_MR];
    const __m512 lut = nibble_table(QT);
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        for (int r = 0; r < MR; r++) blk[r] = _mm512_setzero_ps();
        const float *xb = x + (int64_t)b * QK;
        if (QT == Q8_0) {
#pragma GCC unroll 2
            for (int g = 0; g < 16; g++) {
                const uint8_t *q = a->w + (int64_t)b * block_bytes(QT) + 32 + g * 32;
                const __m512i raw = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)q));
                const __m512 w0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(raw, 24), 24));
                const __m512 w1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(raw, 8));
#pragma GCC unroll 8
                for (int r = 0; r < MR; r++) {
                    const float *xr = xb + (int64_t)r * a->ldx + 2 * g;
                    blk[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xr[0]), blk[r]);
                    blk[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xr[1]), blk[r]);
                }
            }
        } else {
            for (int h = 0; h < 4; h++) {
                const uint8_t *q = a->w + (int64_t)b * block_bytes(QT) + quants_at(QT) + h * 64;
                const __m512i raw = _mm512_loadu_si512(q); /* dword c: column c, k = 8h + 2i + o at bit 4i + 16o */
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const __m512 even = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4 * i), lut);
                    const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4 * i + 16), lut);
#pragma GCC unroll 8
                    for (int r = 0; r < MR; r++) {
                        const float *xr = xb + (int64_t)r * a->ldx + 8 * h + 2 * i;
                        blk[r] = _mm512_fmadd_ps(even, _mm512_set1_ps(xr[0]), blk[r]);
                        blk[r] = _mm512_fmadd_ps(odd, _mm512_set1_ps(xr[1]), blk[r]);
                    }
                }
            }
        }
        finish_block(acc, blk, a, b, MR, QT);
    }
    for (int r = 0; r < MR; r++) store16(a->y, (int64_t)r * a->ldy, acc[r], a->cols, a->y_bf16);
}

/* bf16 activations on AVX512-BF16: x read as k-pairs (one uint32 each). */
TBF16 INLINE void bf16_tile(const tile_args *a, const int MR, const int QT) {
    const uint32_t *x = a->x;
    __m512 acc[MAX_MR], blk[MAX_MR];
    /* bf16 bit patterns of 0..15 (Q4_0: -8..7), repeated: VPERMW reads 5 index bits */
    const __m512i lut = QT == Q4_0
        ? _mm512_set_epi16(0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040,
                           0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000,
                           0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100)
        : _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                           0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                           0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        for (int r = 0; r < MR; r++) blk[r] = _mm512_setzero_ps();
        const uint32_t *xb = x + (int64_t)b * (QK / 2);
        if (QT == Q8_0) {
#pragma GCC unroll 2
            for (int g = 0; g < 16; g++) {
                const uint8_t *q = a->w + (int64_t)b * block_bytes(QT) + 32 + g * 32;
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
                const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo); /* exact: |q| <= 128 */
#pragma GCC unroll 8
                for (int r = 0; r < MR; r++)
                    blk[r] = _mm512_dpbf16_ps(blk[r], w, (__m512bh)_mm512_set1_epi32((int)xb[(int64_t)r * a->ldx + g]));
            }
        } else {
            for (int h = 0; h < 4; h++) {
                const uint8_t *q = a->w + (int64_t)b * block_bytes(QT) + quants_at(QT) + h * 64;
                const __m512i raw = _mm512_loadu_si512(q);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) { /* k-pair 4h + i */
                    const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4 * i), lut);
#pragma GCC unroll 8
                    for (int r = 0; r < MR; r++)
                        blk[r] = _mm512_dpbf16_ps(blk[r], w,
                                                  (__m512bh)_mm512_set1_epi32((int)xb[(int64_t)r * a->ldx + 4 * h + i]));
                }
            }
        }
        finish_block(acc, blk, a, b, MR, QT);
    }
    for (int r = 0; r < MR; r++) store16(a->y, (int64_t)r * a->ldy, acc[r], a->cols, a->y_bf16);
}

/* A panel's weights, every block, as bf16 d * q (+ m) rounded to nearest even (the dequantized
 * model's weights), laid out as bf16_linear.c's panels: [k/2][16 columns][2]. Word 2c + o of a
 * k-pair is column c: the 16 columns' scales spread over 32 words by VPERMPS. W: 64-byte aligned.
 * The many-row paths multiply these (quant_bf16_wide below; quant_amx.c's on AMX). */
TBF16 void quant_unpack_panel(const uint8_t *panel, int qt, int nb, uint16_t *W) {
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
        for (int h = 0; h < 4; h++) { /* group h: nibble i of word j is k-pair 4h + i, word j */
            const __m512i raw = _mm512_loadu_si512(q + h * 64);
            const __m512i a = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw));
            const __m512i c = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1));
            for (int i = 0; i < 4; i++) { /* VPERMPS reads an index's low 4 bits */
                const __m512 lo = _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4 * i), table);
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4 * i), table);
                _mm512_store_si512(W + (4 * h + i) * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d1, m1),
                                                                                    _mm512_fmadd_ps(lo, d0, m0)));
            }
        }
    }
}
/* More than QUANT_EXACT_ROWS rows (a prefill) on AVX512-BF16: the exact sums would pay a float32
 * FMA per row, column and block for the scales, and unpack every block again for each 8 rows.
 * Instead each thread unpacks WIDE_PANELS panels at a time to the dequantized model's bf16
 * weights and multiplies them by bf16_linear.c's many-row tiles, as quant_amx_wide does on AMX:
 * the unpacking is paid once per panel, and the outputs are the dequantized model's. */
static int quant_bf16_wide(const void *x, const uint8_t *packed, void *y, int m, int n, int k, int qt,
                           int num_threads) {
    const int nb = k / QK, panels = (n + PANEL - 1) / PANEL;
    const int64_t panel_bytes = (int64_t)nb * block_bytes(qt), panel_stride = (int64_t)k * PANEL;
    int failed = 0;
#pragma omp parallel num_threads(panels < 2 ? 1 : num_threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        uint16_t *W = aligned_alloc(64, (size_t)panel_stride * 2 * WIDE_PANELS);
        for (int p = p0; W != NULL && p < p1; p += WIDE_PANELS) {
            const int width = min_int(WIDE_PANELS, p1 - p);
            for (int i = 0; i < width; i++) quant_unpack_panel(packed + (p + i) * panel_bytes, qt, nb, W + i * panel_stride);
            failed |= bf16_linear_panels(x, W, width, (uint16_t *)y + p * PANEL, n, min_int(n - p * PANEL, width * PANEL),
                                         m, k) != 0;
        }
        failed |= W == NULL;
        free(W);
    }
    return failed ? -2 : 0;
}

/* x [blocks][32] (contiguous rows of whole blocks): each block's sum into sx, and x as float32
 * into xf (either may be NULL). The sum: the block as two vectors added lane by lane, then the
 * lanes, a fixed order whatever the path that reads it. */
T512 static void block_sums512(const void *x, int x_bf16, int64_t blocks, float *sx, float *xf) {
    for (int64_t b = 0; b < blocks; b++) {
        __m512 lo, hi;
        if (x_bf16) {
            const __m512i raw = _mm512_loadu_si512((const uint16_t *)x + b * QK);
            lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
            hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        } else {
            lo = _mm512_loadu_ps((const float *)x + b * QK);
            hi = _mm512_loadu_ps((const float *)x + b * QK + 16);
        }
        if (xf) {
            _mm512_storeu_ps(xf + b * QK, lo);
            _mm512_storeu_ps(xf + b * QK + 16, hi);
        }
        if (sx) sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}

/* A Q4 code at k = 8g + j is read in place, as its value times 2^AVX2_PLACE[j] (a mask, no shift
 * back: one operation fewer a vector), and multiplied by x scaled by 2^-AVX2_PLACE[j], exactly the
 * same product; the top nibble (bit 28, whose place would make it negative) is shifted down. */
static const int AVX2_PLACE[8] = {0, 16, 4, 20, 8, 24, 12, 0};

/* The AVX2 path's x, once a call: each block's sum into sx (NULL: none; four vectors added in
 * pairs, then the lanes, the same order for every row count) and, for Q4 (placed not NULL), x
 * scaled by 2^-AVX2_PLACE for the codes read in place. */
T256 static void avx2_prepare(const float *x, int64_t blocks, float *sx, float *placed) {
    /* 2^-AVX2_PLACE[j], built as exponent bits */
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_sub_epi32(_mm256_set1_epi32(127), _mm256_loadu_si256((const __m256i *)AVX2_PLACE)), 23));
    for (int64_t b = 0; b < blocks; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
            if (placed) _mm256_storeu_ps(placed + b * QK + 8 * i, _mm256_mul_ps(v[i], scale)); /* exact */
        }
        if (!sx) continue;
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        sx[b] = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
    }
}

/* float32 activations on AVX2: a panel as two halves of 8 columns; Q4_0's offset of 8 is taken
 * from the block sums (sum x (q - 8) = sum x q - 8 sum x). A row's block sum is two chains, its
 * even k and its odd k (each in order, added at the block's end), for each half: four chains a row,
 * since one or two at one row leave it bound by the FMA's latency (bench/README.md, "AVX2"). Up to
 * AVX2_FUSED rows run the chains together; more rows (whose accumulators would not fit the 16
 * registers) run the even chains, then the odd: each k's weights unpack once either way, and a
 * row's outputs are the same bits whatever rows are beside it. */
#define AVX2_MR 4
#define AVX2_FUSED 2
#define AVX2_PF_AHEAD 8 /* blocks ahead whose bytes are prefetched */

/* A block's scales d for half h's 8 columns, and the offset a block sum of x is multiplied by
 * (Q4_1: its mins; Q4_0: -8 d, its codes' offset; Q8_0: none). */
T256 INLINE __m256 avx2_scales(const uint8_t *blk, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + h * 16)));
}
T256 INLINE __m256 avx2_offsets(const uint8_t *blk, int h, __m256 d, const int QT) {
    return QT == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + h * 16)))
           : QT == Q4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)) : _mm256_setzero_ps();
}

/* Q8_0's value at byte o (0: low, 1: high) of each of 8 words widened to dwords, as a float. */
T256 INLINE __m256 avx2_q8_values(__m256i words, int o) {
    return _mm256_cvtepi32_ps(o ? _mm256_srai_epi32(words, 8) : _mm256_srai_epi32(_mm256_slli_epi32(words, 24), 24));
}

/* The chains of parity `par` (0: even k, 1: odd k; 2: both) of every row: s[r][o][h] += x w over a
 * block's k = 2i + o. */
T256 INLINE void avx2_chains(const uint8_t *q, const float *xb, int64_t ldx, __m256 s[AVX2_MR][2][2], const int MR,
                             const int QT, const int par) {
    if (QT == Q8_0) {
        for (int g = 0; g < 16; g++) { /* k = 2g (the low byte of a word) and 2g + 1 */
            for (int h = 0; h < 2; h++) {
                const __m256i raw = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32 + h * 16)));
                for (int o = 0; o < 2; o++) {
                    if (par != 2 && o != par) continue;
                    const __m256 w = avx2_q8_values(raw, o);
                    for (int r = 0; r < MR; r++)
                        s[r][o][h] = _mm256_fmadd_ps(w, _mm256_set1_ps(xb[r * ldx + 2 * g + o]), s[r][o][h]);
                }
            }
        }
        return;
    }
    for (int g = 0; g < 4; g++) { /* dword c of a group's half h: column 8h + c */
        const __m256i raw0 = _mm256_loadu_si256((const __m256i *)(q + g * 64));
        const __m256i raw1 = _mm256_loadu_si256((const __m256i *)(q + g * 64 + 32));
        for (int j = 0; j < 8; j++) { /* k = 8g + j at bit 4 (j / 2) + 16 (j % 2) */
            const int o = j & 1, shift = 4 * (j >> 1) + 16 * o;
            if (par != 2 && o != par) continue;
            /* the code times 2^AVX2_PLACE[j] (x was scaled by its inverse); the top one shifted down */
            const __m256i mask = _mm256_set1_epi32((int)(0xFu << shift));
            const __m256 w0 = _mm256_cvtepi32_ps(j == 7 ? _mm256_srli_epi32(raw0, 28) : _mm256_and_si256(raw0, mask));
            const __m256 w1 = _mm256_cvtepi32_ps(j == 7 ? _mm256_srli_epi32(raw1, 28) : _mm256_and_si256(raw1, mask));
            for (int r = 0; r < MR; r++) {
                const __m256 xv = _mm256_set1_ps(xb[r * ldx + 8 * g + j]);
                s[r][o][0] = _mm256_fmadd_ps(w0, xv, s[r][o][0]);
                s[r][o][1] = _mm256_fmadd_ps(w1, xv, s[r][o][1]);
            }
        }
    }
}

T256 INLINE void avx2_tile(const tile_args *a, const int MR, const int QT) {
    const float *x = a->x;
    __m256 acc[AVX2_MR][2];
    for (int r = 0; r < MR; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = _mm256_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        const uint8_t *blkp = a->w + (int64_t)b * block_bytes(QT);
        const float *xb = x + (int64_t)b * QK;
        if (QT == Q8_0) /* blocks ahead, as quant_vnni.c does (the next panel's lie right after this one's) */
            for (int l = 0; l < block_bytes(QT); l += 64)
                _mm_prefetch((const char *)blkp + AVX2_PF_AHEAD * block_bytes(QT) + l, _MM_HINT_T0);
        __m256 s[AVX2_MR][2][2];
        for (int r = 0; r < MR; r++)
            for (int o = 0; o < 2; o++)
                for (int h = 0; h < 2; h++) s[r][o][h] = _mm256_setzero_ps();
        if (MR <= AVX2_FUSED) {
            avx2_chains(blkp + quants_at(QT), xb, a->ldx, s, MR, QT, 2);
        } else {
            avx2_chains(blkp + quants_at(QT), xb, a->ldx, s, MR, QT, 0);
            avx2_chains(blkp + quants_at(QT), xb, a->ldx, s, MR, QT, 1);
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = avx2_scales(blkp, h), m = avx2_offsets(blkp, h, d, QT);
            for (int r = 0; r < MR; r++) {
                acc[r][h] = _mm256_fmadd_ps(_mm256_add_ps(s[r][0][h], s[r][1][h]), d, acc[r][h]);
                if (QT != Q8_0) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->sx[(int64_t)r * a->nb + b]), acc[r][h]);
            }
        }
    }
    float out[PANEL];
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        float *y = (float *)a->y + (int64_t)r * a->ldy;
        for (int c = 0; c < a->cols && c < PANEL; c++) y[c] = out[c];
    }
}

/* More than QUANT_EXACT_ROWS rows (a prefill) on AVX2: the exact sums unpack every block again
 * for each 4 rows and pay the block's scales per row. Instead each thread unpacks a panel at a
 * time to the dequantized float32 weights, [k][16 columns], and multiplies them by tiles of
 * AVX2_WIDE_MR rows x 16 columns (12 accumulators, two weight vectors and a broadcast: 15 of the
 * 16 registers), as quant_bf16_wide does with bf16 panels. */
#define AVX2_WIDE_MR 6

T256 static void avx2_unpack_panel(const uint8_t *panel, int qt, int nb, float *W) {
    const int bb = block_bytes(qt);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = panel + (int64_t)b * bb, *q = blk + quants_at(qt);
        float *Wb = W + (int64_t)b * QK * PANEL;
        for (int h = 0; h < 2; h++) {
            const __m256 d = avx2_scales(blk, h);
            if (qt == Q8_0) {
                for (int g = 0; g < 16; g++) {
                    const __m256i raw = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(q + g * 32 + h * 16)));
                    for (int o = 0; o < 2; o++)
                        _mm256_storeu_ps(Wb + (2 * g + o) * PANEL + h * 8, _mm256_mul_ps(avx2_q8_values(raw, o), d));
                }
                continue;
            }
            const __m256 mn = avx2_offsets(blk, h, d, qt);
            for (int g = 0; g < 4; g++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + g * 64 + h * 32));
                for (int j = 0; j < 8; j++) { /* d q + m (Q4_0: d q - 8 d), rounded once */
                    const __m256i code = _mm256_and_si256(_mm256_srli_epi32(raw, 4 * (j >> 1) + 16 * (j & 1)),
                                                          _mm256_set1_epi32(0x0F));
                    _mm256_storeu_ps(Wb + (8 * g + j) * PANEL + h * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), d, mn));
                }
            }
        }
    }
}

T256 INLINE void avx2_wide_tile(const float *x, int64_t ldx, const float *W, int k, float *y, int64_t ldy, int cols,
                                const int MR) {
    __m256 acc[AVX2_WIDE_MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int kk = 0; kk < k; kk++) {
        const __m256 w0 = _mm256_loadu_ps(W + (int64_t)kk * PANEL), w1 = _mm256_loadu_ps(W + (int64_t)kk * PANEL + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);
            acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
        }
    }
    float out[PANEL];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        memcpy(y + r * ldy, out, sizeof(float) * (size_t)min_int(cols, PANEL));
    }
}

#define AVX2_WIDE(MR) \
    T256 static void avx2_wide_##MR(const float *x, int64_t ldx, const float *W, int k, float *y, int64_t ldy, int cols) { \
        avx2_wide_tile(x, ldx, W, k, y, ldy, cols, MR); }
AVX2_WIDE(1) AVX2_WIDE(2) AVX2_WIDE(3) AVX2_WIDE(4) AVX2_WIDE(5) AVX2_WIDE(6)
typedef void (*avx2_wide_fn)(const float *x, int64_t ldx, const float *W, int k, float *y, int64_t ldy, int cols);
static const avx2_wide_fn AVX2_WIDE_TABLE[AVX2_WIDE_MR] = {avx2_wide_1, avx2_wide_2, avx2_wide_3, avx2_wide_4,
                                                           avx2_wide_5, avx2_wide_6};

static int quant_avx2_wide(const float *x, const uint8_t *packed, float *y, int m, int n, int k, int qt,
                           int num_threads) {
    const int nb = k / QK, panels = (n + PANEL - 1) / PANEL;
    const int64_t panel_bytes = (int64_t)nb * block_bytes(qt);
    int failed = 0;
#pragma omp parallel num_threads(panels < 2 ? 1 : num_threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        float *W = aligned_alloc(64, sizeof(float) * (size_t)k * PANEL);
        for (int p = p0; W != NULL && p < p1; p++) {
            avx2_unpack_panel(packed + p * panel_bytes, qt, nb, W);
            for (int r = 0; r < m; r += AVX2_WIDE_MR) {
                const int rows = min_int(AVX2_WIDE_MR, m - r);
                AVX2_WIDE_TABLE[rows - 1](x + (int64_t)r * k, k, W, k, y + (int64_t)r * n + p * PANEL, n,
                                          n - p * PANEL);
            }
        }
        failed |= W == NULL;
        free(W);
    }
    return failed ? -2 : 0;
}

/* Every MR up to MAX_MR (the accumulators and block sums fit the 32 registers). */
#define TILE3(KIND, T, MR)                                                                                \
    T static void KIND##_##MR##_q40(const tile_args *a) { KIND##_tile(a, MR, Q4_0); }                    \
    T static void KIND##_##MR##_q41(const tile_args *a) { KIND##_tile(a, MR, Q4_1); }                    \
    T static void KIND##_##MR##_q80(const tile_args *a) { KIND##_tile(a, MR, Q8_0); }
#define TILES(KIND, T)                                                                                    \
    TILE3(KIND, T, 1) TILE3(KIND, T, 2) TILE3(KIND, T, 3) TILE3(KIND, T, 4) TILE3(KIND, T, 5) TILE3(KIND, T, 6) \
    TILE3(KIND, T, 7) TILE3(KIND, T, 8)
TILES(f32, T512)
TILES(bf16, TBF16)
#define AVX2_TILE(MR)                                                                                     \
    T256 static void avx2_##MR##_q40(const tile_args *a) { avx2_tile(a, MR, Q4_0); }                     \
    T256 static void avx2_##MR##_q41(const tile_args *a) { avx2_tile(a, MR, Q4_1); }                     \
    T256 static void avx2_##MR##_q80(const tile_args *a) { avx2_tile(a, MR, Q8_0); }
AVX2_TILE(1) AVX2_TILE(2) AVX2_TILE(3) AVX2_TILE(4)

#define BY_TYPE(NAME) {NAME##_q40, NAME##_q41, NAME##_q80}
#define BY_MR(KIND)                                                                                        \
    {BY_TYPE(KIND##_1), BY_TYPE(KIND##_2), BY_TYPE(KIND##_3), BY_TYPE(KIND##_4), BY_TYPE(KIND##_5),        \
     BY_TYPE(KIND##_6), BY_TYPE(KIND##_7), BY_TYPE(KIND##_8)}
/* [path: 0 f32, 1 bf16][MR - 1][type] */
static const tile_fn TILE_TABLE[2][MAX_MR][3] = {BY_MR(f32), BY_MR(bf16)};
static const tile_fn AVX2_TABLE[AVX2_MR][3] = {BY_TYPE(avx2_1), BY_TYPE(avx2_2), BY_TYPE(avx2_3), BY_TYPE(avx2_4)};

static int type_index(int qt) { return qt == Q4_0 ? 0 : qt == Q4_1 ? 1 : 2; }

/* One thread's panels [p0, p1), one at a time: every row, in balanced chunks of at most max_mr (a
 * panel read from DRAM for the first chunk is in L1 for the next). */
static void run_panels(int path, const void *x, int ldx, const float *sx, const uint8_t *packed, void *y, int y_bf16, int m, int n, int nb, int qt, int p0, int p1) {
    const int64_t panel_bytes = (int64_t)nb * block_bytes(qt);
    const int max_mr = path == 2 ? AVX2_MR : MAX_MR;
    const int chunks = (m + max_mr - 1) / max_mr, rows_per_chunk = (m + chunks - 1) / chunks;
    const int ti = type_index(qt), y_elem = y_bf16 ? 2 : 4;
    for (int p = p0; p < p1; p++) {
        for (int r = 0; r < m; r += rows_per_chunk) {
            const int rows = min_int(rows_per_chunk, m - r);
            const tile_args a = {(const char *)x + (int64_t)r * ldx * 4, ldx, sx + (int64_t)r * nb, nb,
                                 packed + p * panel_bytes, (char *)y + ((int64_t)r * n + p * PANEL) * y_elem,
                                 n, min_int(n - p * PANEL, PANEL), y_bf16};
            if (path == 2) AVX2_TABLE[rows - 1][ti](&a);
            else TILE_TABLE[path][rows - 1][ti](&a);
        }
    }
}

/* x: [m, k] float32 or bf16 (x_bf16), contiguous; packed: the panels above for a weight [n, k] of
 * type qt; y: [m, n] in x's dtype. isa: one ISA_* bit that quant_isas() reported: AVX512-BF16 and
 * AMX take bf16 x only (AMX from QUANT_AMX_MIN_ROWS rows, fewer going to AVX512F); AVX2 float32
 * only; AVX512F widens bf16 x to float32 first.
 * Returns 0, -1 for a shape or type this kernel does not take, -2 out of memory. */
int quant_linear(const void *x, const uint8_t *packed, void *y, int m, int n, int k, int qt, int x_bf16, int isa,
                 int num_threads) {
    if (m < 1 || n < 1 || k < QK || k % QK || !known_type(qt) || !(quant_isas() & isa)) return -1;
    if (isa == ISA_VNNI && m > QUANT_EXACT_ROWS) /* a prefill: as the bf16 paths take it */
        isa = quant_isas() & ISA_AMX ? ISA_AMX : ISA_AVX512BF16;
    const int vnni = isa == ISA_VNNI;
    if (vnni) {
        if (!x_bf16) return -1;
        isa = ISA_AVX512; /* its block sums (Q4_1's offset) */
    }
    const int amx = isa == ISA_AMX && m >= (qt == Q8_0 ? QUANT_AMX_MIN_ROWS_Q8 : 1);
    if (isa == ISA_AMX) {
        if (!x_bf16) return -1;
        isa = ISA_AVX512;
    }
    if (amx && m > QUANT_EXACT_ROWS) return quant_amx_wide(x, packed, y, m, n, k, qt, num_threads);
    const int path = isa == ISA_AVX512BF16 ? 1 : isa == ISA_AVX512 ? 0 : isa == ISA_AVX2 ? 2 : -1;
    if (path < 0 || (path == 1 && !x_bf16) || (path == 2 && x_bf16)) return -1; /* AVX2 stores float32 only */
    if (path == 1 && m > QUANT_EXACT_ROWS) return quant_bf16_wide(x, packed, y, m, n, k, qt, num_threads);
    if (path == 2 && m > QUANT_EXACT_ROWS) return quant_avx2_wide(x, packed, y, m, n, k, qt, num_threads);
    const int nb = k / QK, panels = (n + PANEL - 1) / PANEL;
    const int widen = x_bf16 && !amx && !vnni && path != 1;
    /* sx [m][nb]: the block sums of x (Q4_1's offset term, and Q4_0's on AVX2); widened x [m][k] */
    /* AVX2 reads Q4 codes in place (AVX2_PLACE): x scaled for them, [m][k] */
    const int placing = path == 2 && qt != Q8_0;
    const size_t blocks = (size_t)m * nb, extra = widen || placing ? (size_t)m * k : 0;
    float *scratch = malloc(sizeof(float) * (blocks + extra));
    if (!scratch) return -2;
    float *sx = scratch, *xf = widen ? sx + blocks : NULL, *placed = placing ? sx + blocks : NULL;
    const int need_sx = qt == Q4_1 || (path == 2 && qt == Q4_0);
    if (path == 2) avx2_prepare(x, (int64_t)blocks, need_sx ? sx : NULL, placed);
    else if (need_sx || xf) block_sums512(x, x_bf16, (int64_t)blocks, need_sx ? sx : NULL, xf); /* AVX512 paths */
    if (vnni) {
        const int rc = quant_vnni(x, sx, packed, y, m, n, k, qt, num_threads);
        free(scratch);
        return rc;
    }
    if (amx) {
        const int rc = quant_amx_sums(x, sx, packed, y, m, n, k, qt, num_threads);
        free(scratch);
        return rc;
    }
    const void *xin = placed ? (const void *)placed : xf ? (const void *)xf : x;
    const int ldx = path == 1 ? k / 2 : k; /* float32 values, or bf16 pairs: 4 bytes either way */
    /* Waking the second thread costs microseconds: a small weight (< 32 KB) is read by one. */
    const int threads = (int64_t)panels * nb * block_bytes(qt) < 32 * 1024 ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        run_panels(path, xin, ldx, sx, packed, y, x_bf16, m, n, nb, qt, (int)((int64_t)panels * t / nt),
                   (int)((int64_t)panels * (t + 1) / nt));
    }
    free(scratch);
    return 0;
}
#else
int quant_isas(void) { return 0; }
int quant_linear(const void *x, const uint8_t *packed, void *y, int m, int n, int k, int qt, int x_bf16, int isa,
                 int num_threads) {
    (void)x, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)qt, (void)x_bf16, (void)isa, (void)num_threads;
    return -1;
}
#endif
