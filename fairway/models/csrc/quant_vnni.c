/* quant_linear.c's weights times bf16 activations for a few rows (a decode step, a draft's
 * verification), by integer dot products (AVX512-VNNI): a Q4 nibble or a Q8_0 byte is already an
 * integer, so a block's products need no unpacking to floats, and VPDPBUSD / VPDPWSSD take 64 / 32
 * of them an instruction where VDPBF16PS and the AMX pipeline take 32 after a table lookup.
 *
 * The activations become integers first, per row and block of 32: v = x / u rounded to nearest,
 * u the power of two that puts the block's largest |x| just under 2^21. A bf16 value has 8
 * significant bits, so every x within 2^13 of the block's largest is exact in v, and a smaller one
 * is off by at most 2^-21 of the largest: far below a bf16 rounding step of the block's large
 * values, so the model's outlier activations (a value thousands of times its block's others: a
 * 16-bit grid rounded those away and changed the bundled model's greedy text, bench/README.md) keep
 * the small ones. v is then split into signed digits, exact: three bytes for Q4 (v = 65536 h +
 * 256 m + l, VPDPBUSD: nibble u8 x digit s8) and two words for Q8_0 (v = 65536 h + l, VPDPWSSD).
 * A block's integer sums are exact; each block is scaled into the float32 totals as the other
 * paths do (quant_linear.c's finish_block), so a row's outputs do not depend on the rows beside it.
 *
 * Digits are laid out for the weights as they lie (quant_linear.c's layout): a Q4 group's dword c
 * read as bytes holds column c's nibbles at k = 8h + {0, 4, 1, 5} (low nibbles) and 8h + {2, 6, 3,
 * 7} (high nibbles), so each group's digits are stored in that order, a dword to broadcast per
 * nibble half; a Q8_0 k-pair's words are column c's at k0, k0 + 1, the digits' natural order.
 * From AMX_FROM_ROWS rows the products run on AMX int8 tiles where there are some (amx_digits), a
 * row's three byte planes as three rows of a tile, so one product a block serves up to five rows.
 * Q4: TDPBSUD takes the same digits by the same nibbles. Q8_0: TDPBUSD takes each word digit as two
 * unsigned bytes (l + 32768 = 256 mu + lu) and the high one offset (h + 32), times the weights in
 * k-quads; the offsets come off with the block's column sums of the weights, which leaves the two
 * word planes' sums exactly. Either way the block sums, and with them the rows, are the same bits
 * as VPDPBUSD's and VPDPWSSD's.
 * Built with the other kernels by cpu_kernels.py; each VNNI function carries its own target
 * attribute (the AMX ones are built where -march=native has AMX).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
#define QK 32
#define Q4_0 2
#define Q4_1 3
#define Q8_0 8
#define VNNI_MR 4      /* rows a tile: 3 digit sums + a total a row stay in registers */
#define Q4_PLANES 3    /* bytes of a Q4 digit (v < 2^21 in magnitude: three signed bytes) */
#define Q8_PLANES 2    /* words of a Q8_0 digit */
#define PF_AHEAD 8     /* blocks ahead whose bytes are prefetched (a panel's next ones lie right after) */
/* From this many rows the products go to AMX int8 tiles where there are some (amx_digits: the same
 * integer sums; below it VPDPBUSD's and VPDPWSSD's rows cost less: bench/README.md, "Few rows") */
#define AMX_FROM_ROWS 4
#define AMX_GROUP 5    /* rows an int8 tile holds: a row's three digit planes are three of its 16 rows */
#define AMX_PASS 10    /* rows a pass: two groups, two C tiles a block */
#define AMX_DIGIT_BYTES (Q4_PLANES * 32) /* a row's digits of a block on AMX: three byte planes, Q8_0's too */
#define Q8_H_OFFSET 32 /* Q8_0's high word digit (|h| <= 2^(GRID_BITS + 1 - 16)) as an unsigned byte on AMX */
#define GRID_BITS 20   /* |v| < 2^(GRID_BITS + 1): a Q4 block's sum stays within int32 (32 * 15 * 2^21) */

static int block_bytes(int qt) { return qt == Q8_0 ? 16 * 34 : qt == Q4_1 ? 16 * 20 : 16 * 18; }
static int quants_at(int qt) { return qt == Q4_1 ? 64 : 32; }
static inline int min_int(int a, int b) { return a < b ? a : b; }

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <omp.h>

#define TVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bf16,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

int quant_vnni_available(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
                __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
    }
    return known;
}

/* A row's activations as digits. Per block b: unit[b] (u), vsum[b] (the sum of v, Q4_0's offset),
 * and the digits: Q4, three planes of 32 bytes (l, m, h) in the groups' order; Q8_0, two planes of
 * 32 words (l, h) in k's order. */
typedef struct {
    const uint8_t *digits; /* [rows][nb][planes][32 bytes or 64] */
    const float *unit;     /* [rows][nb] */
    const int32_t *vsum;   /* [rows][nb] */
    const float *sx;       /* [rows][nb], Q4_1: the block sums of x */
    const uint8_t *w;      /* the panel's first block */
    uint16_t *y;
    int nb, ldy, cols;
} vnni_args;

static int digit_bytes(int qt) { return qt == Q8_0 ? Q8_PLANES * 64 : Q4_PLANES * 32; }

/* Block b of a row: x (32 bf16) to digits, its unit and v's sum. Q8_0's are two word planes, or
 * where bytes (AMX's int8 tiles) three unsigned byte planes of the same words (b_operand). */
TVNNI static void to_digits(const uint16_t *x, int qt, int bytes, uint8_t *digits, float *unit, int32_t *vsum) {
    const __m512i raw = _mm512_loadu_si512(x);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    /* the exponent of the largest |x|: amax < 2^(e + 1), so |v| < 2^(GRID_BITS + 1) */
    const int e = amax > 0 && amax <= 3.4e38f ? (int)_mm_cvtss_f32(_mm_getexp_ss(_mm_setzero_ps(), _mm_set_ss(amax))) : 0;
    const __m512 to_grid = _mm512_set1_ps((float)(GRID_BITS - e));
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_scalef_ps(lo, to_grid)); /* nearest, ties to even */
    const __m512i v1 = _mm512_cvtps_epi32(_mm512_scalef_ps(hi, to_grid));
    *unit = _mm_cvtss_f32(_mm_scalef_ss(_mm_set_ss(1.0f), _mm_set_ss((float)(e - GRID_BITS))));
    *vsum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
    if (qt == Q8_0) { /* v = 65536 h + l, l in [-32768, 32768) */
        const __m512i half = _mm512_set1_epi32(32768), low16 = _mm512_set1_epi32(0xFFFF);
        const __m512i l0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v0, half), low16), half);
        const __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v1, half), low16), half);
        const __m512i h0 = _mm512_srai_epi32(_mm512_sub_epi32(v0, l0), 16), h1 = _mm512_srai_epi32(_mm512_sub_epi32(v1, l1), 16);
        if (!bytes) {
            _mm256_storeu_si256((__m256i *)digits, _mm512_cvtepi32_epi16(l0));
            _mm256_storeu_si256((__m256i *)(digits + 32), _mm512_cvtepi32_epi16(l1));
            _mm256_storeu_si256((__m256i *)(digits + 64), _mm512_cvtepi32_epi16(h0));
            _mm256_storeu_si256((__m256i *)(digits + 96), _mm512_cvtepi32_epi16(h1));
            return;
        }
        /* unsigned bytes for AMX (TDPBUSD): l + 32768 = 256 mu + lu, and hu = h + Q8_H_OFFSET */
        const __m512i u0 = _mm512_add_epi32(l0, half), u1 = _mm512_add_epi32(l1, half), off = _mm512_set1_epi32(Q8_H_OFFSET);
        const __m512i planes[3][2] = {{u0, u1}, {_mm512_srli_epi32(u0, 8), _mm512_srli_epi32(u1, 8)},
                                      {_mm512_add_epi32(h0, off), _mm512_add_epi32(h1, off)}};
        for (int p = 0; p < 3; p++) /* the low byte of each */
            _mm256_storeu_si256((__m256i *)(digits + p * 32),
                                _mm256_set_m128i(_mm512_cvtepi32_epi8(planes[p][1]), _mm512_cvtepi32_epi8(planes[p][0])));
        return;
    }
    /* signed byte digits, low first (d = ((v + 128) & 255) - 128), the last one the rest */
    const __m512i b128 = _mm512_set1_epi32(128), byte = _mm512_set1_epi32(0xFF);
    __m512i da[Q4_PLANES], dc[Q4_PLANES], a = v0, c = v1;
    for (int p = 0; p < Q4_PLANES; p++) {
        da[p] = p == Q4_PLANES - 1 ? a : _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(a, b128), byte), b128);
        dc[p] = p == Q4_PLANES - 1 ? c : _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(c, b128), byte), b128);
        a = _mm512_srai_epi32(_mm512_sub_epi32(a, da[p]), 8);
        c = _mm512_srai_epi32(_mm512_sub_epi32(c, dc[p]), 8);
    }
    /* group g's dwords: k = 8g + {0, 4, 1, 5}, then 8g + {2, 6, 3, 7} (the nibbles as they lie) */
    const __m256i order = _mm256_set_epi8(31, 27, 30, 26, 29, 25, 28, 24, 23, 19, 22, 18, 21, 17, 20, 16,
                                          15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
    for (int p = 0; p < Q4_PLANES; p++) {
        const __m256i planes = _mm256_set_m128i(_mm512_cvtepi32_epi8(dc[p]), _mm512_cvtepi32_epi8(da[p]));
        _mm256_storeu_si256((__m256i *)(digits + p * 32), _mm256_permutexvar_epi8(order, planes));
    }
}

/* A block's float32 sums scaled in: acc += d * blk (+ m * sum x, Q4_1), as quant_linear.c does. */
TVNNI INLINE void finish_block(__m512 *acc, __m512 blk, const uint8_t *blkp, float sx, const int QT) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blkp));
    *acc = _mm512_fmadd_ps(blk, d, *acc);
    if (QT == Q4_1) *acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blkp + 32))),
                                           _mm512_set1_ps(sx), *acc);
}

/* A Q4 block's three digit-plane sums (exact: |sum| < 32 * 15 * 2^21) scaled into a row's total.
 * The one place both the VPDPBUSD and the AMX int8 tiles do it, so their rows agree to the bit. */
TVNNI INLINE void q4_block_total(__m512 *acc, __m512i l, __m512i m, __m512i h, const uint8_t *blkp, float unit,
                                 int32_t vsum, float sx, const int QT) {
    __m512i sum = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 16), _mm512_slli_epi32(m, 8)), l);
    if (QT == Q4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * vsum));
    finish_block(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(unit)), blkp, sx, QT);
}

/* Rows' float32 totals of one panel out as bf16 (nearest even, as the other paths round), `cols`
 * of its columns. */
TVNNI INLINE void store_panel(uint16_t *y, int64_t ldy, const __m512 *acc, int rows, int cols) {
    const __mmask16 mask = cols >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++) _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

/* A Q8_0 block's two word-digit sums (exact) scaled into a row's total; both paths' one place. */
TVNNI INLINE void q8_block_total(__m512 *acc, __m512i s0, __m512i s1, const uint8_t *blkp, float unit) {
    const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(s0));
    finish_block(acc, _mm512_mul_ps(sum, _mm512_set1_ps(unit)), blkp, 0, Q8_0);
}

/* MR rows x one panel. */
TVNNI INLINE void vnni_tile(const vnni_args *a, const int MR, const int QT) {
    const int db = digit_bytes(QT), bb = block_bytes(QT);
    __m512 acc[VNNI_MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < a->nb; b++) {
        const uint8_t *blkp = a->w + (int64_t)b * bb, *q = blkp + quants_at(QT);
        for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)blkp + PF_AHEAD * bb + l, _MM_HINT_T0);
        if (QT == Q8_0) {
            __m512i s[VNNI_MR][Q8_PLANES];
            for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int g = 0; g < 16; g++) { /* k-pair g: word 2c + o is column c at 2g + o */
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + g * 32)));
                for (int r = 0; r < MR; r++) {
                    const int32_t *xd = (const int32_t *)(a->digits + ((int64_t)r * a->nb + b) * db);
                    s[r][0] = _mm512_dpwssd_epi32(s[r][0], w, _mm512_set1_epi32(xd[g]));
                    s[r][1] = _mm512_dpwssd_epi32(s[r][1], w, _mm512_set1_epi32(xd[16 + g]));
                }
            }
            for (int r = 0; r < MR; r++) q8_block_total(&acc[r], s[r][0], s[r][1], blkp, a->unit[(int64_t)r * a->nb + b]);
            continue;
        }
        /* one row: two sums a digit (the low and the high nibbles), so a chain is 4 products long,
         * not 8; more rows have chains enough, and registers for one sum a digit */
        const int H = MR == 1 ? 2 : 1;
        __m512i s[VNNI_MR][Q4_PLANES][2];
        for (int r = 0; r < MR; r++)
            for (int p = 0; p < Q4_PLANES; p++) s[r][p][0] = s[r][p][1] = _mm512_setzero_si512();
        const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++) {
            const __m512i raw = _mm512_loadu_si512(q + h * 64);
            const __m512i nib_lo = _mm512_and_si512(raw, low), nib_hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            for (int r = 0; r < MR; r++) {
                const int32_t *xd = (const int32_t *)(a->digits + ((int64_t)r * a->nb + b) * db);
                for (int p = 0; p < Q4_PLANES; p++) {
                    s[r][p][0] = _mm512_dpbusd_epi32(s[r][p][0], nib_lo, _mm512_set1_epi32(xd[p * 8 + 2 * h]));
                    s[r][p][H - 1] = _mm512_dpbusd_epi32(s[r][p][H - 1], nib_hi, _mm512_set1_epi32(xd[p * 8 + 2 * h + 1]));
                }
            }
        }
        for (int r = 0; r < MR; r++) {
            const int64_t rb = (int64_t)r * a->nb + b;
            __m512i d[Q4_PLANES];
            for (int p = 0; p < Q4_PLANES; p++) d[p] = H == 2 ? _mm512_add_epi32(s[r][p][0], s[r][p][1]) : s[r][p][0];
            q4_block_total(&acc[r], d[0], d[1], d[2], blkp, a->unit[rb], a->vsum[rb], QT == Q4_1 ? a->sx[rb] : 0, QT);
        }
    }
    store_panel(a->y, a->ldy, acc, MR, a->cols);
}

typedef void (*vnni_fn)(const vnni_args *a);
#define VNNI3(MR)                                                                                         \
    TVNNI static void vnni_##MR##_q40(const vnni_args *a) { vnni_tile(a, MR, Q4_0); }                   \
    TVNNI static void vnni_##MR##_q41(const vnni_args *a) { vnni_tile(a, MR, Q4_1); }                   \
    TVNNI static void vnni_##MR##_q80(const vnni_args *a) { vnni_tile(a, MR, Q8_0); }
VNNI3(1) VNNI3(2) VNNI3(3) VNNI3(4)
#define BY_TYPE(NAME) {NAME##_q40, NAME##_q41, NAME##_q80}
static const vnni_fn VNNI_TABLE[VNNI_MR][3] = {BY_TYPE(vnni_1), BY_TYPE(vnni_2), BY_TYPE(vnni_3), BY_TYPE(vnni_4)};

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
void amx_configure_tiles(const uint8_t rows[8], const uint8_t colsb[8]);
int amx_linear_available(void); /* amx_linear.c: 1 where this process may use AMX tiles */

/* A block's weights as an int8 tile's B operand, 8 rows of 4 k's a column. Q4: each group's low and
 * high nibbles (the k order of the digits, as VPDPBUSD takes them); Q8_0: k-pairs 2j and 2j + 1's
 * words of each column side by side, and it returns the columns' sums (the digits' offsets). */
TVNNI INLINE __m512i b_operand(const uint8_t *q, uint8_t *B, const int QT) {
    if (QT == Q8_0) { /* and each column's sum of the block's weights */
        const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                               23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        __m512i sum = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const __m512i w = _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(q + j * 64));
            _mm512_store_si512(B + j * 64, w);
            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), w);
        }
        return sum;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int h = 0; h < 4; h++) {
        const __m512i raw = _mm512_loadu_si512(q + h * 64);
        _mm512_store_si512(B + h * 128, _mm512_and_si512(raw, low));
        _mm512_store_si512(B + h * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
    return _mm512_setzero_si512();
}

/* One thread's share of a pass on AMX int8 tiles: `rows` rows (their digits block by block, ldb
 * bytes apart; unit, vsum, sx [rows][nb]) times panels [p0, p1). */
typedef struct {
    const uint8_t *digits, *packed;
    const float *unit, *sx;
    const int32_t *vsum;
    uint16_t *y;
    int64_t ldb;
    int n, nb, rows;
} digits_args;

#define D_B_SLOTS 4   /* B operands made ahead, a ring (a tile load right after the stores that wrote it waits) */
#define D_SUM_SLOTS 8 /* blocks' stored C tiles (and Q8_0's column sums), a ring */
#define D_LAG 5       /* blocks between a block's product and its scaling: its tile stores have landed */
#define D_SLOT_INTS (AMX_PASS * Q4_PLANES * 16) /* int32s of a block's C rows */

/* Block s's sums (its rows' stored C tile rows, three a row) scaled into the rows' totals; at a
 * panel's last block the totals go out as bf16. */
TVNNI INLINE void digits_scale(const digits_args *a, __m512 *acc, const int32_t *sums, __m512i wsum, int64_t s,
                               const int QT) {
    const int64_t p = s / a->nb;
    const int b = (int)(s - p * a->nb);
    const uint8_t *blkp = a->packed + s * block_bytes(QT);
    /* Q8_0: what the digits' offsets added to the planes' sums, 32768 sum w and Q8_H_OFFSET sum w */
    const __m512i low_off = _mm512_slli_epi32(wsum, 15), high_off = _mm512_mullo_epi32(wsum, _mm512_set1_epi32(Q8_H_OFFSET));
    if (b == 0)
        for (int r = 0; r < a->rows; r++) acc[r] = _mm512_setzero_ps();
    for (int r = 0; r < a->rows; r++) {
        const int64_t rb = (int64_t)r * a->nb + b;
        const int32_t *c = sums + r * Q4_PLANES * 16; /* the row's three planes' tile rows */
        const __m512i l = _mm512_load_si512(c), m = _mm512_load_si512(c + 16), h = _mm512_load_si512(c + 32);
        if (QT == Q8_0) /* the word planes' sums: 256 mu + lu - 32768 sum w, hu - Q8_H_OFFSET sum w */
            q8_block_total(&acc[r], _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(m, 8), l), low_off),
                           _mm512_sub_epi32(h, high_off), blkp, a->unit[rb]);
        else q4_block_total(&acc[r], l, m, h, blkp, a->unit[rb], QT == Q4_0 ? a->vsum[rb] : 0,
                            QT == Q4_1 ? a->sx[rb] : 0, QT);
    }
    if (b == a->nb - 1) store_panel(a->y + p * PANEL, a->n, acc, a->rows, min_int(PANEL, a->n - (int)p * PANEL));
}

/* Stage u of the pipeline over the thread's blocks [0, total) (panel-major from its first):
 * prefetch block u + PF_AHEAD, make block u + 1's B operand, multiply block u into C tiles (CT0,
 * and CT1 for a second group of rows: a row's three planes are three rows of A), scale block
 * u - D_LAG. One group stores block u - 1's C tile (P0: a turn late, a store right behind its
 * product waits; four C tiles in turn); two groups, with two C tiles a turn in turn, store their
 * own after the scaling (a turn later the next product would wait for the tiles). Tile numbers
 * are immediates. */
#define DIGITS_STAGE(u, CT0, CT1, AT, BT, P0)                                                         \
    do {                                                                                                 \
        const int64_t u_ = (u);                                                                          \
        if (u_ + PF_AHEAD < total)                                                                       \
            for (int l_ = 0; l_ < bb; l_ += 64) _mm_prefetch((const char *)first + (u_ + PF_AHEAD) * bb + l_, _MM_HINT_T0); \
        if (u_ + 1 < total)                                                                              \
            wsums[(u_ + 1) % D_SUM_SLOTS] = b_operand(first + (u_ + 1) * bb + quants_at(QT), B + ((u_ + 1) % D_B_SLOTS) * 512, QT); \
        if (u_ < total) {                                                                                \
            const uint8_t *xd_ = a->digits + ((g0 + u_) % a->nb) * a->ldb;                               \
            _tile_loadd(BT, B + (u_ % D_B_SLOTS) * 512, 64);                                             \
            _tile_loadd(AT, xd_, 32);                                                                    \
            _tile_zero(CT0);                                                                             \
            if (QT == Q8_0) _tile_dpbusd(CT0, AT, BT);                                                   \
            else _tile_dpbsud(CT0, AT, BT);                                                              \
            if (G == 2) {                                                                                \
                _tile_loadd(5, xd_ + (int64_t)g0r * AMX_DIGIT_BYTES, 32);                                \
                _tile_zero(CT1);                                                                         \
                if (QT == Q8_0) _tile_dpbusd(CT1, 5, BT);                                                \
                else _tile_dpbsud(CT1, 5, BT);                                                           \
            }                                                                                            \
        }                                                                                                \
        if (G == 1 && u_ >= 1 && u_ - 1 < total)                                                         \
            _tile_stored(P0, sums + ((u_ - 1) % D_SUM_SLOTS) * D_SLOT_INTS, 64);                         \
        if (u_ >= D_LAG && u_ - D_LAG < total)                                                           \
            digits_scale(a, acc, sums + ((u_ - D_LAG) % D_SUM_SLOTS) * D_SLOT_INTS,                      \
                         wsums[(u_ - D_LAG) % D_SUM_SLOTS], g0 + u_ - D_LAG, QT);                        \
        if (G == 2 && u_ < total) { /* two tiles a turn: their own, after the scaling */                 \
            int32_t *s_ = sums + (u_ % D_SUM_SLOTS) * D_SLOT_INTS;                                       \
            _tile_stored(CT0, s_, 64);                                                                   \
            _tile_stored(CT1, s_ + g0r * Q4_PLANES * 16, 64);                                            \
        }                                                                                                \
    } while (0)

/* Panels [p0, p1) of a pass, as quant_amx.c's run_exact runs its pipeline: B: D_B_SLOTS operands;
 * sums: D_SUM_SLOTS blocks' C rows (64-byte aligned). One group of up to AMX_GROUP rows (G = 1):
 * C tiles 0-3 in turn; two (G = 2): C 0 and 1, then 2 and 3. */
TVNNI INLINE void run_digits(const digits_args *a, int p0, int p1, uint8_t *B, int32_t *sums, const int G, const int QT) {
    const int bb = block_bytes(QT), g0r = G == 1 ? a->rows : (a->rows + 1) / 2;
    const int64_t g0 = (int64_t)p0 * a->nb, total = (int64_t)(p1 - p0) * a->nb;
    const uint8_t *first = a->packed + g0 * bb;
    __m512 acc[AMX_PASS];
    __m512i wsums[D_SUM_SLOTS]; /* Q8_0's column sums of each block in the ring */
    if (total <= 0) return;
    wsums[0] = b_operand(first + quants_at(QT), B, QT);
    for (int64_t u = 0; u < total + D_LAG; u += 4) {
        if (G == 1) {
            DIGITS_STAGE(u, 0, 0, 4, 6, 3);
            DIGITS_STAGE(u + 1, 1, 1, 4, 7, 0);
            DIGITS_STAGE(u + 2, 2, 2, 4, 6, 1);
            DIGITS_STAGE(u + 3, 3, 3, 4, 7, 2);
        } else {
            DIGITS_STAGE(u, 0, 1, 4, 6, 0);
            DIGITS_STAGE(u + 1, 2, 3, 4, 7, 0);
            DIGITS_STAGE(u + 2, 0, 1, 4, 6, 0);
            DIGITS_STAGE(u + 3, 2, 3, 4, 7, 0);
        }
    }
}

typedef void (*digits_fn)(const digits_args *a, int p0, int p1, uint8_t *B, int32_t *sums);
#define RUN_DIGITS(G)                                                                                    \
    TVNNI static void run_digits_##G##_q40(const digits_args *a, int p0, int p1, uint8_t *B, int32_t *s) { \
        run_digits(a, p0, p1, B, s, G, Q4_0);                                                            \
    }                                                                                                    \
    TVNNI static void run_digits_##G##_q41(const digits_args *a, int p0, int p1, uint8_t *B, int32_t *s) { \
        run_digits(a, p0, p1, B, s, G, Q4_1);                                                            \
    }                                                                                                    \
    TVNNI static void run_digits_##G##_q80(const digits_args *a, int p0, int p1, uint8_t *B, int32_t *s) { \
        run_digits(a, p0, p1, B, s, G, Q8_0);                                                            \
    }
RUN_DIGITS(1) RUN_DIGITS(2)
static const digits_fn DIGITS_TABLE[2][3] = {BY_TYPE(run_digits_1), BY_TYPE(run_digits_2)};

/* The tiles of a pass of `rows` (three tile rows a row; A 32 bytes of k a row, C and B 64): one
 * group C 0-3, A 4; two groups C 0 and 2 (the first group's rows), 1 and 3 (the second's), A 4 and
 * 5; B 6 and 7. */
static void configure_pass(int rows) {
    const int g0 = rows <= AMX_GROUP ? rows : (rows + 1) / 2, g1 = rows - g0;
    uint8_t r[8] = {0}, cb[8] = {0};
    for (int t = 0; t < 4; t++) {
        r[t] = (uint8_t)(Q4_PLANES * (g1 > 0 && t % 2 ? g1 : g0));
        cb[t] = 64;
    }
    r[4] = (uint8_t)(Q4_PLANES * g0), cb[4] = 32;
    if (g1 > 0) r[5] = (uint8_t)(Q4_PLANES * g1), cb[5] = 32;
    r[6] = r[7] = 8, cb[6] = cb[7] = 64;
    amx_configure_tiles(r, cb);
}

/* Where amx_digits_available(): rows on AMX int8 tiles, passes of up to AMX_PASS rows; the digits
 * block by block (quant_vnni). Returns 0, -2 out of memory (quant_vnni then takes the rows itself). */
static int amx_digits_available(void) { return amx_linear_available(); }

static int amx_digits(const uint8_t *digits, const float *unit, const int32_t *vsum, const float *sx,
                      const uint8_t *packed, uint16_t *y, int m, int n, int nb, int qt, int num_threads) {
    const int panels = (n + PANEL - 1) / PANEL, threads = panels < 2 ? 1 : num_threads;
    const int passes = (m + AMX_PASS - 1) / AMX_PASS, per_pass = (m + passes - 1) / passes;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint8_t *B = aligned_alloc(64, D_B_SLOTS * 512 + D_SUM_SLOTS * D_SLOT_INTS * 4);
        if (B == NULL) {
            failed = 1;
        } else {
            const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
            for (int r0 = 0; r0 < m; r0 += per_pass) {
                const int rows = min_int(m - r0, per_pass);
                const int64_t rb = (int64_t)r0 * nb;
                const digits_args a = {digits + (int64_t)r0 * AMX_DIGIT_BYTES, packed, unit + rb, sx + rb, vsum + rb,
                                       y + (int64_t)r0 * n, (int64_t)m * AMX_DIGIT_BYTES, n, nb, rows};
                configure_pass(rows);
                DIGITS_TABLE[rows > AMX_GROUP][qt == Q4_0 ? 0 : qt == Q4_1 ? 1 : 2](&a, p0, p1, B,
                                                                                  (int32_t *)(B + D_B_SLOTS * 512));
            }
            _tile_release();
            free(B);
        }
    }
    return failed ? -2 : 0;
}
#else
static int amx_digits_available(void) { return 0; } /* a build without AMX int8 */
static int amx_digits(const uint8_t *digits, const float *unit, const int32_t *vsum, const float *sx,
                      const uint8_t *packed, uint16_t *y, int m, int n, int nb, int qt, int num_threads) {
    (void)digits, (void)unit, (void)vsum, (void)sx, (void)packed, (void)y, (void)m, (void)n, (void)nb, (void)qt,
        (void)num_threads;
    return -1;
}
#endif

/* x: [m, k] bf16; sx: its block sums [m][k/32] (read for Q4_1); packed: quant_linear.c's panels of
 * a [n, k] weight of type qt; y: [m, n] bf16. Every row count, in tiles of up to VNNI_MR rows.
 * Returns 0, -1 for what it does not take (no AVX512-VNNI), -2 out of memory. */
int quant_vnni(const uint16_t *x, const float *sx, const uint8_t *packed, uint16_t *y, int m, int n, int k, int qt,
               int num_threads) {
    if (m < 1 || n < 1 || k < QK || k % QK || !(qt == Q4_0 || qt == Q4_1 || qt == Q8_0) || !quant_vnni_available())
        return -1;
    const int nb = k / QK, panels = (n + PANEL - 1) / PANEL, db = digit_bytes(qt);
    const int64_t blocks = (int64_t)m * nb, panel_bytes = (int64_t)nb * block_bytes(qt);
    uint8_t *digits = aligned_alloc(64, (size_t)(blocks * (db + 8) + 64) / 64 * 64);
    if (digits == NULL) return -2;
    float *unit = (float *)(digits + blocks * db);
    int32_t *vsum = (int32_t *)(unit + blocks);
    if (m >= AMX_FROM_ROWS && amx_digits_available()) { /* the digits block by block */
        for (int r = 0; r < m; r++)
            for (int b = 0; b < nb; b++)
                to_digits(x + ((int64_t)r * nb + b) * QK, qt, 1, digits + ((int64_t)b * m + r) * AMX_DIGIT_BYTES,
                          unit + r * nb + b, vsum + r * nb + b);
        if (amx_digits(digits, unit, vsum, sx, packed, y, m, n, nb, qt, num_threads) == 0) {
            free(digits);
            return 0;
        }
    }
    for (int64_t i = 0; i < blocks; i++) to_digits(x + i * QK, qt, 0, digits + i * db, unit + i, vsum + i);
    const int ti = qt == Q4_0 ? 0 : qt == Q4_1 ? 1 : 2;
    const int tiles = (m + VNNI_MR - 1) / VNNI_MR, rows_per_tile = (m + tiles - 1) / tiles;
    /* Waking the second thread costs microseconds: a small weight (< 32 KB) is read by one. */
    const int threads = panels * panel_bytes < 32 * 1024 ? 1 : num_threads;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        for (int p = p0; p < p1; p++) /* a panel read from DRAM for the first tile is in L1 for the next */
            for (int r = 0; r < m; r += rows_per_tile) {
                const int64_t rb = (int64_t)r * nb;
                const vnni_args a = {digits + rb * db, unit + rb, vsum + rb, sx + rb, packed + p * panel_bytes,
                                     y + (int64_t)r * n + p * PANEL, nb, n, min_int(n - p * PANEL, PANEL)};
                VNNI_TABLE[min_int(rows_per_tile, m - r) - 1][ti](&a);
            }
    }
    free(digits);
    return 0;
}
#else
int quant_vnni_available(void) { return 0; }
int quant_vnni(const uint16_t *x, const float *sx, const uint8_t *packed, uint16_t *y, int m, int n, int k, int qt,
               int num_threads) {
    (void)x, (void)sx, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)qt, (void)num_threads;
    return -1;
}
#endif
