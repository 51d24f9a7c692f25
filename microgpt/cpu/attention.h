/* Causal multi-head self-attention core (the projections are separate matmuls).
 * q, k, v, out: [B*T, C]; head h uses columns [h*hs, (h+1)*hs), hs = C/H.
 * att: [B, H, T, T] softmax probabilities, saved for backward; entries above the diagonal are 0.
 * scores = q.k / sqrt(hs). */
#ifndef MICROGPT_CPU_ATTENTION_H
#define MICROGPT_CPU_ATTENTION_H

#include "common.h"

/* One query row of one head: qt attends to the rows 0..t of k and v (rows `stride` floats apart,
 * already offset to the head's columns); probabilities into a[0..t], the output into o[0:hs]. The
 * forward and the KV-cache decode (microgpt_cpu.c) share it, so both give the same bits. */
static inline void attention_row(float* o, float* a, const float* qt, const float* k, const float* v, int t,
                                 size_t stride, int hs, float scale) {
    float maxv = -INFINITY;
    for (int t2 = 0; t2 <= t; t2++) {
        a[t2] = dot_f32(qt, k + (size_t)t2 * stride, hs) * scale;
        if (a[t2] > maxv) maxv = a[t2];
    }
    double sum = 0.0;
    for (int t2 = 0; t2 <= t; t2++) { a[t2] = expf(a[t2] - maxv); sum += a[t2]; }
    float inv = (float)(1.0 / sum);
    for (int t2 = 0; t2 <= t; t2++) a[t2] *= inv;
    for (int i = 0; i < hs; i++) o[i] = 0.0f;
    for (int t2 = 0; t2 <= t; t2++) axpy_f32(o, a[t2], v + (size_t)t2 * stride, hs);
}

static inline void attention_forward(float* out, float* att, const float* q, const float* k, const float* v,
                              int B, int T, int C, int H) {
    int hs = C / H;
    float scale = (float)(1.0 / sqrt((double)hs));
    /* every (b, h, t) query row is an independent output */
    #pragma omp parallel for schedule(static)
    for (int bht = 0; bht < B * H * T; bht++) {
        int t = bht % T, h = (bht / T) % H, b = bht / (T * H);
        size_t head = (size_t)b * T * C + h * hs; /* row 0 of sequence b, head h's columns */
        float* a = att + (size_t)bht * T;
        attention_row(out + head + (size_t)t * C, a, q + head + (size_t)t * C, k + head, v + head, t, (size_t)C, hs,
                      scale);
        for (int t2 = t + 1; t2 < T; t2++) a[t2] = 0.0f;
    }
}

/* dk and dv rows collect terms from every later query, so each (b, h) pair is one task that walks
 * t in order: no races, and the summation order is fixed whatever the thread count.
 * datt[t2] = dout_t . v_t2 is computed twice (once for the softmax sum, once per element) rather than
 * kept in a scratch row: the engine allocates nothing inside the training loop. */
static inline void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* att,
                               const float* q, const float* k, const float* v,
                               int B, int T, int C, int H) {
    int hs = C / H;
    float scale = (float)(1.0 / sqrt((double)hs));
    #pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        for (int t = 0; t < T; t++) {
            const float* a = att + ((size_t)bh * T + t) * T;
            const float* go = dout + ((size_t)b * T + t) * C + h * hs;
            /* s = sum_t2 att * (dout . v) ; dv += att * dout */
            double s = 0.0;
            for (int t2 = 0; t2 <= t; t2++) {
                size_t row = ((size_t)b * T + t2) * C + h * hs;
                s += (double)a[t2] * dot_f32(go, v + row, hs);
                axpy_f32(dv + row, a[t2], go, hs);
            }
            /* softmax backward, then the scaled dot product's two inputs */
            float ssum = (float)s;
            const float* qt = q + ((size_t)b * T + t) * C + h * hs;
            float* dqt = dq + ((size_t)b * T + t) * C + h * hs;
            for (int t2 = 0; t2 <= t; t2++) {
                size_t row = ((size_t)b * T + t2) * C + h * hs;
                float ds = a[t2] * (dot_f32(go, v + row, hs) - ssum) * scale;
                axpy_f32(dqt, ds, k + row, hs);
                axpy_f32(dk + row, ds, qt, hs);
            }
        }
    }
}

#endif
