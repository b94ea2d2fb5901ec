/*
 * RMSNorm with the decoder's residual add fused in (CPU, fp32): one pass over each row.
 *
 *   with residual:  s = x + residual;  residual_out = s;  out = s / sqrt(mean(s^2) + eps) * weight
 *   without:        out = x / sqrt(mean(x^2) + eps) * weight
 *
 * torch spends tens of microseconds of dispatch on an rms_norm of a few rows (plus another op for
 * the add); a decode step of a small model runs two of these per layer, so on the CPU that
 * overhead, not the arithmetic, is what costs. Rows are split over threads only when there are
 * enough of them to pay for it (prefill).
 *
 * Layouts: x, residual, residual_out, out [rows, cols] contiguous; weight [cols].
 */
#include <math.h>
#include <stdint.h>

void llmc_add_rms_norm_f32(const float *x, const float *residual, float *residual_out, const float *weight,
                           float *out, int64_t rows, int64_t cols, float eps, int num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= 262144) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * cols;
        const float *src = xr;
        float sum_sq = 0.0f;
        if (residual != 0) {
            const float *rr = residual + r * cols;
            float *ro = residual_out + r * cols;
            for (int64_t c = 0; c < cols; ++c) {
                const float s = xr[c] + rr[c];
                ro[c] = s;
                sum_sq += s * s;
            }
            src = ro;
        } else {
            for (int64_t c = 0; c < cols; ++c) sum_sq += xr[c] * xr[c];
        }
        const float inv = 1.0f / sqrtf(sum_sq / (float)cols + eps);
        float *o = out + r * cols;
        for (int64_t c = 0; c < cols; ++c) o[c] = src[c] * inv * weight[c];
    }
}
