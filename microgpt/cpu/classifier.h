/* Tied output layer and loss: logits = x[N,C] @ wte[Vp,C]^T, softmax and cross-entropy over the
 * first V (real) columns only. probs [N,Vp] is saved for backward with padded columns set to 0;
 * the backward overwrites it with dlogits. The loss is the mean over the N positions, so backward
 * uses dloss = 1/N per position. */
#ifndef MICROGPT_CPU_CLASSIFIER_H
#define MICROGPT_CPU_CLASSIFIER_H

#include "common.h"

/* The loss is summed per chunk of rows and the chunk sums are added in order, so the result does
 * not depend on how many threads ran the chunks. */
#define CLASSIFIER_CHUNKS 256
#define CLASSIFIER_ROWS 4

/* one softmax row in place over probs[0:V]; returns -log p[target], computed from the logits */
static inline double classifier_softmax_row(float* p, int target, int V, int Vp) {
    float maxv = -INFINITY;
    for (int v = 0; v < V; v++) if (p[v] > maxv) maxv = p[v];
    float lt = p[target];
    double sum = 0.0;
    for (int v = 0; v < V; v++) { p[v] = expf(p[v] - maxv); sum += p[v]; }
    float inv = (float)(1.0 / sum);
    for (int v = 0; v < V; v++) p[v] *= inv;
    for (int v = V; v < Vp; v++) p[v] = 0.0f;
    return log(sum) - ((double)lt - maxv);
}

static inline float classifier_forward(float* probs, const float* x, const float* wte, const int* targets,
                                int N, int C, int V, int Vp) {
    double chunk_loss[CLASSIFIER_CHUNKS];
    int per_chunk = (N + CLASSIFIER_CHUNKS - 1) / CLASSIFIER_CHUNKS;
    int nchunks = (N + per_chunk - 1) / per_chunk;
    #pragma omp parallel for schedule(static)
    for (int ch = 0; ch < nchunks; ch++) {
        int n_end = (ch + 1) * per_chunk < N ? (ch + 1) * per_chunk : N;
        double loss = 0.0;
        for (int n0 = ch * per_chunk; n0 < n_end; n0 += CLASSIFIER_ROWS) {
            int rows = n0 + CLASSIFIER_ROWS <= n_end ? CLASSIFIER_ROWS : n_end - n0;
            /* logits, four rows per pass over wte so each embedding row is loaded once */
            for (int v = 0; v < V; v++) {
                const float* wv = wte + (size_t)v * C;
                for (int r = 0; r < rows; r++) {
                    probs[(size_t)(n0 + r) * Vp + v] = dot_f32(x + (size_t)(n0 + r) * C, wv, C);
                }
            }
            for (int r = 0; r < rows; r++) {
                loss += classifier_softmax_row(probs + (size_t)(n0 + r) * Vp, targets[n0 + r], V, Vp);
            }
        }
        chunk_loss[ch] = loss;
    }
    double total = 0.0;
    for (int ch = 0; ch < nchunks; ch++) total += chunk_loss[ch];
    return (float)(total / N);
}

/* dlogits [N,Vp] = (probs - onehot(target)) / N on real columns, 0 on padded ones; in place (the
 * probabilities are not needed after). */
static inline void classifier_dlogits(float* probs, const int* targets, int N, int V, int Vp) {
    float dloss = 1.0f / N;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float* p = probs + (size_t)n * Vp;
        for (int v = 0; v < V; v++) p[v] = (p[v] - (v == targets[n] ? 1.0f : 0.0f)) * dloss;
        for (int v = V; v < Vp; v++) p[v] = 0.0f;
    }
}

/* The two products of the classifier backward from dlogits [N,Vp] (real columns read): dx += dlogits @ wte,
 * dwte[:V] += dlogits^T @ x. */
static inline void classifier_backward_products(float* dx, float* dwte, const float* dlogits, const float* x,
                                                const float* wte, int N, int C, int V, int Vp) {
    /* dx[n,:] += sum_v dlogits[n,v] * wte[v,:]   (rows independent) */
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* g = dlogits + (size_t)n * Vp;
        float* o = dx + (size_t)n * C;
        for (int v = 0; v < V; v++) axpy_f32(o, g[v], wte + (size_t)v * C, C);
    }
    /* dwte[v,:] += sum_n dlogits[n,v] * x[n,:]   (threads own tiles of real rows; n in order) */
    int ntiles = (V + CLASSIFIER_ROWS - 1) / CLASSIFIER_ROWS;
    #pragma omp parallel for schedule(static)
    for (int tile = 0; tile < ntiles; tile++) {
        int v0 = tile * CLASSIFIER_ROWS;
        int rows = v0 + CLASSIFIER_ROWS <= V ? CLASSIFIER_ROWS : V - v0;
        for (int n = 0; n < N; n++) {
            const float* g = dlogits + (size_t)n * Vp + v0;
            const float* xn = x + (size_t)n * C;
            for (int r = 0; r < rows; r++) axpy_f32(dwte + (size_t)(v0 + r) * C, g[r], xn, C);
        }
    }
}

/* The classifier backward: probs [N,Vp] (from classifier_forward) becomes dlogits, then dx and dwte
 * take its products. */
static inline void classifier_backward(float* dx, float* dwte, float* probs, const float* x, const float* wte,
                                       const int* targets, int N, int C, int V, int Vp) {
    classifier_dlogits(probs, targets, N, V, Vp);
    classifier_backward_products(dx, dwte, probs, x, wte, N, C, V, Vp);
}

#endif
