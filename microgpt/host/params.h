/* params.h: the flat parameter vector (docs/DESIGN.md §2 order, which is also the checkpoint order), the
 * parameter count, which tensors are 2-D (weight-decayed), and the seeded initialisation.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_PARAMS_H
#define MICROGPT_HOST_PARAMS_H

#include "config.h"
#include "rng.h"

/* Per-layer tensors, in their order inside a layer's block of the flat vector. */
enum {
    T_WQ, T_WK, T_WV, T_WO, /* [d, d] */
    T_W1,                   /* [d, d_ff] */
    T_W2,                   /* [d_ff, d] */
    T_LN1_GAMMA, T_LN1_BETA, T_LN2_GAMMA, T_LN2_BETA, /* [d] */
    T_PER_LAYER
};

/* How a tensor starts (params_init): see docs/ANDREA.md. */
typedef enum { INIT_NORMAL, INIT_NORMAL_RESIDUAL, INIT_ONES, INIT_ZEROS } ParamInit;

typedef struct {
    char name[32];
    ParamInit init;
    size_t offset, size; /* in floats */
    int rows, cols;      /* 1-D tensors have rows = 1 */
    int decay;           /* 1 for 2-D tensors (wte, wpe, W_*): AdamW weight decay applies */
} ParamTensor;

typedef struct {
    size_t wte, wpe;                 /* [padded_vocab, d], [seq_len, d] */
    size_t layer0[T_PER_LAYER];      /* offsets of layer 0's tensors */
    size_t layer_stride;             /* floats per layer block */
    size_t lnf_gamma, lnf_beta;      /* [d] */
    size_t n_params;
    int n_tensors;
    ParamTensor* tensors;            /* every tensor in flat order */
} ParamLayout;

/* Offset of tensor `t` (T_WQ ...) of layer `l` in the flat vector. */
static size_t layer_offset(const ParamLayout* p, int l, int t) {
    return p->layer0[t] + (size_t)l * p->layer_stride;
}

/* Weight decay applies exactly to the normal-initialised (2-D) tensors. */
static size_t param_add(ParamLayout* p, size_t* cursor, const char* name, int rows, int cols, ParamInit init) {
    ParamTensor* t = &p->tensors[p->n_tensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->init = init;
    t->offset = *cursor;
    t->rows = rows;
    t->cols = cols;
    t->size = (size_t)rows * (size_t)cols;
    t->decay = init == INIT_NORMAL || init == INIT_NORMAL_RESIDUAL;
    *cursor += t->size;
    return t->offset;
}

/* Counts only: cheap, allocates nothing big, used to validate before any large allocation. */
static void param_layout_init(ParamLayout* p, const Config* c) {
    int d = c->model.d_model, f = c->model.d_ff, L = c->model.n_layer, l, t;
    size_t cur = 0;
    static const char* names[T_PER_LAYER] = {"W_Q", "W_K", "W_V", "W_O", "W_1", "W_2",
                                             "ln1.gamma", "ln1.beta", "ln2.gamma", "ln2.beta"};
    static const ParamInit inits[T_PER_LAYER] = {INIT_NORMAL, INIT_NORMAL, INIT_NORMAL, INIT_NORMAL_RESIDUAL,
                                                 INIT_NORMAL, INIT_NORMAL_RESIDUAL, INIT_ONES, INIT_ZEROS,
                                                 INIT_ONES, INIT_ZEROS};
    memset(p, 0, sizeof *p);
    p->tensors = (ParamTensor*)xmalloc(sizeof(ParamTensor) * (size_t)(4 + T_PER_LAYER * L), "parameter table");
    p->wte = param_add(p, &cur, "wte", c->model.padded_vocab_size, d, INIT_NORMAL);
    p->wpe = param_add(p, &cur, "wpe", c->model.seq_len, d, INIT_NORMAL);
    for (l = 0; l < L; l++) {
        for (t = 0; t < T_PER_LAYER; t++) {
            char name[32];
            int rows = (t == T_W2) ? f : (t <= T_W1 ? d : 1);
            int cols = (t == T_W1) ? f : d;
            size_t off;
            snprintf(name, sizeof name, "h%d.%s", l, names[t]);
            off = param_add(p, &cur, name, rows, cols, inits[t]);
            if (l == 0) p->layer0[t] = off;
            if (l == 1 && t == 0) p->layer_stride = off - p->layer0[0];
        }
    }
    if (L == 1) p->layer_stride = cur - p->layer0[0];
    p->lnf_gamma = param_add(p, &cur, "lnf.gamma", 1, d, INIT_ONES);
    p->lnf_beta = param_add(p, &cur, "lnf.beta", 1, d, INIT_ZEROS);
    p->n_params = cur;
}

/* --layout-json: the layout for programs, so that no other language restates it:
 * {"n_params":N,"tensors":[{"name":"wte","shape":[50304,192],"offset":0,"decay":true},...]};
 * 1-D tensors have a shape of one dimension. */
static void param_layout_json(FILE* out, const ParamLayout* p) {
    int i;
    fprintf(out, "{\"n_params\":%zu,\"tensors\":[", p->n_params);
    for (i = 0; i < p->n_tensors; i++) {
        const ParamTensor* t = &p->tensors[i];
        fprintf(out, "%s\n{\"name\":\"%s\",\"shape\":", i ? "," : "", t->name);
        if (t->rows == 1) fprintf(out, "[%d]", t->cols);
        else fprintf(out, "[%d,%d]", t->rows, t->cols);
        fprintf(out, ",\"offset\":%zu,\"decay\":%s}", t->offset, t->decay ? "true" : "false");
    }
    fputs("]}\n", out);
}

/* The layout of the model every mode runs, once it is known (training: from its flags; --generate
 * and --evaluate: from the checkpoint's sidecar, flags over it): a parameter count the checkpoint
 * format holds (its header's int32; a layout too: offsets past any checkpoint are of no model the
 * engine runs), then --layout-json's answer, exit 0. config_parse returned early for it, with the
 * model flags alone validated: a mode that went on (--generate served requests, --evaluate scored
 * the checkpoint) ran with the rest of its flags never checked. */
static void param_layout_check(const Config* c, const ParamLayout* p) {
    if (p->n_params > 2147483647u)
        die_input("the model has %zu parameters; the checkpoint format holds at most 2^31-1", p->n_params);
    if (!c->layout_json) return;
    param_layout_json(stdout, p);
    exit_once_written();
}

static void param_layout_free(ParamLayout* p) {
    free(p->tensors);
    p->tensors = NULL;
}

/* Seeded initialisation (docs/ANDREA.md): N(0, 0.02) for wte, wpe, W_*; W_O and W_2 scaled by
 * 1/sqrt(2·n_layer) because each adds into the residual stream once per layer; LayerNorm gamma 1,
 * beta 0. The normal for parameter i uses counter i, so the layout alone fixes every value. */
static void params_init(float* params, const ParamLayout* p, const Config* c) {
    int i;
    double proj_std = 0.02 / sqrt(2.0 * c->model.n_layer);
    for (i = 0; i < p->n_tensors; i++) {
        const ParamTensor* t = &p->tensors[i];
        long j, n = (long)t->size;
        float* w = params + t->offset;
        if (t->init == INIT_ONES || t->init == INIT_ZEROS) {
            float value = t->init == INIT_ONES ? 1.0f : 0.0f;
            for (j = 0; j < n; j++) w[j] = value;
        } else {
            double std = t->init == INIT_NORMAL_RESIDUAL ? proj_std : 0.02;
            uint64_t seed = (uint64_t)c->train.seed, first = (uint64_t)t->offset;
#pragma omp parallel for schedule(static)
            for (j = 0; j < n; j++) w[j] = (float)(std * rng_normal(seed, STREAM_INIT, first + (uint64_t)j));
        }
    }
}

#endif
