/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
#ifndef MICROGPT_CPU_GELU_H
#define MICROGPT_CPU_GELU_H

#include "common.h"

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_CUBIC 0.044715f

static inline void gelu_forward(float* out, const float* x, int n) {
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        float xi = x[i];
        out[i] = 0.5f * xi * (1.0f + tanhf(GELU_SCALE * (xi + GELU_CUBIC * xi * xi * xi)));
    }
}

static inline void gelu_backward(float* dx, const float* x, const float* dout, int n) {
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        float xi = x[i];
        float th = tanhf(GELU_SCALE * (xi + GELU_CUBIC * xi * xi * xi));
        float dth = (1.0f - th * th) * GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * xi * xi);
        dx[i] += dout[i] * (0.5f * (1.0f + th) + 0.5f * xi * dth);
    }
}

#endif
