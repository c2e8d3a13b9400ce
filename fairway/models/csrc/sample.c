/* Temperature sampling: one token per row of logits by inverse CDF, in one pass per row.
 *
 * The PyTorch path (fairway/engine/sampler.py) divides by the temperature, takes a softmax, a
 * float64 cumulative sum and a search: ~8 ops over [rows, vocab] with SmolLM2's 49k vocabulary, a
 * visible share of a decode step (bench/README.md, engine_vs_hf.py). Here each row is scaled and
 * exponentiated into a scratch row, summed in double per chunk of 256 tokens (vectorized), and the
 * draw walks the chunk sums before scanning one chunk: the first token whose running mass exceeds
 * u * total, so a token of zero probability is never drawn. Rows with top-k or top-p filters stay
 * on the PyTorch path. Rows are independent and split across threads.
 *
 * Built with the other kernels by fairway/models/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define CHUNK 256 /* the scan walks chunk sums first, then one chunk token by token */

/* The index of the largest value (the fallback for a row of NaN or infinite logits). */
static int64_t argmax(const float *x, int n) {
    int64_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int64_t sample_row(const float *restrict logits, int vocab, float temperature, double u,
                          float *restrict scratch, double *restrict chunk_mass) {
    float m = -INFINITY;
    for (int i = 0; i < vocab; i++) {
        scratch[i] = logits[i] / temperature;
        m = fmaxf(m, scratch[i]);
    }
    const int chunks = (vocab + CHUNK - 1) / CHUNK;
    double total = 0.0;
    for (int c = 0; c < chunks; c++) {
        const int end = (c + 1) * CHUNK < vocab ? (c + 1) * CHUNK : vocab;
        double mass = 0.0;
        for (int i = c * CHUNK; i < end; i++) {
            scratch[i] = expf(scratch[i] - m);
            mass += (double)scratch[i];
        }
        chunk_mass[c] = mass;
        total += mass;
    }
    if (!(total > 0.0) || isinf(total)) return argmax(logits, vocab);
    /* The first token whose running mass exceeds u * total. The running mass is the sum of the
     * chunks before it plus the tokens before it in its chunk; a token of zero mass never raises
     * it, so it is never the one drawn. */
    const double threshold = u * total;
    double before = 0.0;
    int64_t last = -1;
    for (int c = 0; c < chunks; c++) {
        if (before + chunk_mass[c] > threshold || c == chunks - 1) {
            const int end = (c + 1) * CHUNK < vocab ? (c + 1) * CHUNK : vocab;
            double mass = before;
            for (int i = c * CHUNK; i < end; i++) {
                if (scratch[i] > 0.f) last = i;
                mass += (double)scratch[i];
                if (mass > threshold && scratch[i] > 0.f) return i;
            }
        }
        before += chunk_mass[c];
    }
    return last >= 0 ? last : argmax(logits, vocab); /* rounding left u * total past the end */
}

/* logits: [rows, vocab] float32; temperatures: [rows] (> 0); uniforms: [rows] in [0, 1).
 * Returns 0, or -1 for bad arguments or out of memory. */
int sample_temperature(const float *logits, int rows, int vocab, const float *temperatures,
                       const double *uniforms, int64_t *out, int num_threads) {
    if (rows < 0 || vocab < 1) return -1;
    for (int r = 0; r < rows; r++)
        if (!(temperatures[r] > 0.f)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        float *scratch = malloc(sizeof(float) * (size_t)vocab);
        double *chunk_mass = malloc(sizeof(double) * (size_t)(vocab / CHUNK + 1));
        if (!scratch || !chunk_mass) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            if (scratch && chunk_mass)
                out[r] = sample_row(logits + (int64_t)r * vocab, vocab, temperatures[r], uniforms[r], scratch,
                                    chunk_mass);
        free(scratch);
        free(chunk_mass);
    }
    return failed ? -1 : 0;
}
