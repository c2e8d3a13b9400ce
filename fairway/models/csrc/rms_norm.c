/* RMSNorm over float32 rows: out = x / sqrt(mean(x^2) + eps) * weight.
 *
 * At decode a norm sees a handful of rows, where PyTorch's rms_norm costs ~70 us per call on this
 * class of CPU (several ops, each with dispatch overhead) for a few hundred FLOPs; 61 norms per
 * step made it ~10% of a one-sequence step. Rows are independent, so large inputs split across
 * threads.
 *
 * Built with the other kernels by fairway/models/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>

int rms_norm_f32(const float *x, const float *weight, float *out, int rows, int dim, float eps,
                 int num_threads) {
    if (rows < 0 || dim < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * dim;
        float *yr = out + (int64_t)r * dim;
        float ss = 0.f;
        for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) yr[i] = xr[i] * inv * weight[i];
    }
    return 0;
}
