/*
 * Fused small ops for the CPU decode path, fp32, C-contiguous rows.
 *
 * Each replaces several eager torch ops (and their dispatch, ~5 us apiece on
 * this project's CPUs) by one call. References with the same semantics are in
 * engine/models/ops.py (TorchModelOps); tests compare the two.
 *
 * Rows are split across OpenMP threads only when there is enough work to pay
 * for waking them (decode steps of a few rows run on the calling thread).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fuel_internal.h"
#include "fuel_vec.h"

#define PAR_MIN_ELEMS 65536

void fuel_norm_row(const float *xr, float *residual, const float *weight, float *orow,
                   int64_t dim, float eps)
{
    float *hr = residual ? residual : (float *)xr;
    float ss = 0.0f;
    if (residual) {
        for (int64_t c = 0; c < dim; ++c) {
            const float h = xr[c] + hr[c];
            hr[c] = h;
            ss += h * h;
        }
    } else {
        for (int64_t c = 0; c < dim; ++c) ss += xr[c] * xr[c];
    }
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t c = 0; c < dim; ++c) orow[c] = weight[c] * (hr[c] * inv);
}

/* h = x + residual (when residual != NULL; h is written back to residual),
 * out = weight * h / sqrt(mean(h^2) + eps). Hugging Face's Llama order. */
void fuel_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                           int64_t rows, int64_t dim, float eps, int num_threads)
{
    const int nt = rows * dim >= PAR_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; ++r)
        fuel_norm_row(x + r * dim, residual ? residual + r * dim : NULL, weight, out + r * dim,
                      dim, eps);
}

/* GPT-NeoX (half-split) rotary embedding, in place, on the first `heads`
 * heads of each row of `qk` (row r starts at qk + r * row_stride; q heads then
 * k heads, as in a fused qkv projection's output). cos_sin is
 * [max_pos, head_dim]: cos in the first half, sin in the second. */
void fuel_rope_row(float *v0, int64_t heads, int64_t head_dim, const float *cs)
{
    const int64_t half = head_dim / 2;
    const float *cosv = cs, *sinv = cs + half;
    for (int64_t h = 0; h < heads; ++h) {
        float *v = v0 + h * head_dim;
        for (int64_t c = 0; c < half; ++c) {
            const float x1 = v[c], x2 = v[c + half];
            v[c] = x1 * cosv[c] - x2 * sinv[c];
            v[c + half] = x2 * cosv[c] + x1 * sinv[c];
        }
    }
}

void fuel_rope_neox_f32(float *qk, int64_t row_stride, int64_t rows, int64_t heads,
                        int64_t head_dim, const int64_t *positions, const float *cos_sin,
                        int num_threads)
{
    const int nt = rows * heads * head_dim >= PAR_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; ++r)
        fuel_rope_row(qk + r * row_stride, heads, head_dim, cos_sin + positions[r] * head_dim);
}

void fuel_silu_mul_span(const float *g, const float *u, float *o, int64_t j0, int64_t j1)
{
    int64_t j = j0;
    /* Vector exp: the scalar expf made this ~0.25 ms per layer at 16 rows. */
    for (; j + 8 <= j1; j += 8) {
        const v8f gv = load8(g + j);
        const v8f r8 = gv / (1.0f + exp8(-gv)) * load8(u + j);
        memcpy(o + j, &r8, sizeof r8);
    }
    for (; j < j1; ++j) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* out[r, j] = silu(gu[r, j]) * gu[r, inter + j]; gu is [rows, 2 * inter]. */
void fuel_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter, int num_threads)
{
    const int nt = rows * inter >= PAR_MIN_ELEMS ? num_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * inter;
        fuel_silu_mul_span(g, g + inter, out + r * inter, 0, inter);
    }
}
