/* y = x @ w.T for a few rows of x (decode of one or a few sequences) with w in bfloat16 and x, y in
 * float32: the matmul of a bf16 model on a CPU without bf16 matrix instructions.
 *
 * With one to a few rows a linear layer is bound by reading its weights: bf16 weights halve the
 * bytes of the float32 copy that the wide (prefill, big-batch) matmuls use. Each thread takes a
 * contiguous run of output rows and streams their weights once, converting 8 bf16 values to
 * float32 in registers (a widen and a shift) and multiplying them into every x row.
 *
 * Built with paged_decode.c by fairway/models/cpu_kernels.py.
 */
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 8

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }

static inline v8f load8_bf16(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    const v8u32 u = __builtin_convertvector(h, v8u32) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float sum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* One weight row against m (1 or 2) x rows. The row is read front to back as one stream (what the
 * hardware prefetcher follows best), 32 values per step into four independent accumulator chains
 * per x row, which hide the FMA latency. */
static inline __attribute__((always_inline)) void row_dot(const float *restrict x, const uint16_t *restrict w,
        int k, float *restrict y, int ldy, const int m) {
    v8f a[2][4] = {{{0}}};
    int c = 0;
    for (; c + 32 <= k; c += 32) {
        const v8f w0 = load8_bf16(w + c), w1 = load8_bf16(w + c + 8);
        const v8f w2 = load8_bf16(w + c + 16), w3 = load8_bf16(w + c + 24);
        for (int i = 0; i < m; i++) {
            const float *xi = x + i * k + c;
            a[i][0] += w0 * load8(xi);
            a[i][1] += w1 * load8(xi + 8);
            a[i][2] += w2 * load8(xi + 16);
            a[i][3] += w3 * load8(xi + 24);
        }
    }
    for (; c < k; c += 8) {
        const v8f wv = load8_bf16(w + c);
        for (int i = 0; i < m; i++) a[i][0] += wv * load8(x + i * k + c);
    }
    for (int i = 0; i < m; i++) y[i * ldy] = sum8((a[i][0] + a[i][1]) + (a[i][2] + a[i][3]));
}

/* x: [m, k] float32; w: [n, k] bf16; y: [m, n] float32; k a multiple of 8, m <= MAX_ROWS.
 * Returns 0, or -1 for a shape this kernel does not take. */
int linear_bf16_weights(const float *x, const uint16_t *w, float *y, int m, int n, int k, int num_threads) {
    if (m < 1 || m > MAX_ROWS || k % 8) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int row = 0; row < n; row++) {
        for (int i = 0; i < m; i += 2) {
            if (m - i >= 2) row_dot(x + i * k, w + (int64_t)row * k, k, y + i * n + row, n, 2);
            else row_dot(x + i * k, w + (int64_t)row * k, k, y + i * n + row, n, 1);
        }
    }
    return 0;
}
