/* microgpt_cpu.c: the CPU reference engine. The model of docs/DESIGN.md §2 (pre-LayerNorm GPT, no biases in
 * linear layers, tied embeddings, padded vocabulary) assembled from the layer pairs in cpu/ (one header each),
 * implementing host/engine.h; the training loop itself is host/train_loop.h, shared with the GPU.
 *
 * Everything is fp32, except that with train.precision fp8 the four linear products of each layer
 * (QKV, attention output, MLP up and down) read FP8-emulated operands: each operand is cast to
 * E4M3 (weights, activations; activation gradients in FP8_GRAD_FMT, cpu/fp8.h) with its per-tensor current scale and
 * dequantised exactly as the GPU engine casts it (cpu/fp8.h), then multiplied in fp32 — the
 * reference for the GPU's FP8 products (docs/DESIGN.md §18); in training, the LayerNorm outputs
 * ln1, ln2, the GELU output, the attention output att, MLP up's output gradient dh, the residual
 * gradients that are W_2's and W_O's output gradients and QKV's output gradient dqkv are cast at
 * delayed scales instead
 * (delayed_operand); where the FP8 classifier pays (d_model 512 and up, cpu/fp8.h's
 * fp8_classifier_pays) the classifier's three products, or with train.fp8_classifier logits its
 * logits product alone, read FP8-emulated operands too (classifier_x, classifier_wte, classifier_bwd). Every other precision computes fp32 (and says so). Every buffer
 * is allocated once in engine_setup, sized for B·T positions;
 * smaller calls (one prompt of len tokens in engine_prefill) reuse the same buffers. Results are
 * bit-identical run to run for a fixed OMP thread count (the layer functions fix their summation
 * orders, and the gradient norm is summed in fixed chunks).
 *
 * Generation (docs/DESIGN.md §5a): the KV cache keeps every layer's keys and values per slot;
 * engine_decode runs one position per sequence through the same per-row layer functions as the
 * forward (attention_row included), so a decoded position's logits equal, bit for bit, those of
 * the forward over the whole prefix, and do not depend on the other sequences of the step.
 *
 * Build: make cpu   (gcc -std=c99 -O3 -fopenmp -ffp-contract=off) */
#include "host/train_loop.h"
#include <sys/sysinfo.h>

#include "cpu/adamw.h"
#include "cpu/attention.h"
#include "cpu/classifier.h"
#include "cpu/embed.h"
#include "cpu/fp8.h"
#include "cpu/gelu.h"
#include "cpu/layernorm.h"
#include "cpu/matmul.h"
#include "cpu/residual.h"

/* Forward values of one layer that its backward needs. */
typedef struct {
    float *ln1, *ln1_mean, *ln1_rstd; /* LN1 output [N,C], statistics [N] */
    float *q, *k, *v;                 /* [N,C] */
    float *att;                       /* softmax probabilities [B,H,T,T] */
    float *atty;                      /* attention output before W_O [N,C] */
    float *xmid;                      /* x + attention branch [N,C] */
    float *ln2, *ln2_mean, *ln2_rstd;
    float *h, *h_gelu;                /* [N,F]: GELU input and output */
    float *xout;                      /* layer output [N,C] */
} LayerActs;

static struct {
    Config cfg; /* copy: the engine outlives nothing, but keep it independent of the caller */
    ParamLayout layout;
    int B, T, C, H, F, V, Vp, L;
    float *params, *grads, *m, *v; /* m, v: this rank's shard only (ZeRO-1, docs/DESIGN.md §17) */
    DistPart shard;                /* the weights this rank updates: [lo, hi) of the flat vector */
    /* activations */
    LayerActs* layers;
    float *x0, *lnf, *lnf_mean, *lnf_rstd, *probs, *branch;
    const int* tokens; /* inputs of the last forward (embed_backward needs them) */
    /* generation: KV cache [L][slots][T][C] each, and one decode step's rows [slots][...] */
    int training, slots;
    float *kcache, *vcache;
    float *dec_x, *dec_xmid, *dec_ln, *dec_mean, *dec_rstd, *dec_q, *dec_k, *dec_v, *dec_att, *dec_atty;
    float *dec_h, *dec_h_gelu, *dec_branch;
    /* backward scratch, shared by all layers (each is zeroed before use: the layer backward
     * functions accumulate into every output) */
    float *dres_a, *dres_b, *dbranch, *dln, *datty, *dq, *dk, *dv, *dh_gelu, *dh;
    /* fp8 only: the dequantised operands of the product being computed (else empty); fp8_products:
     * the current forward/backward uses them (training and validation; generation does not, as on
     * the GPU: its decode steps multiply unquantised, and the prefill must give the decode's keys) */
    int fp8, fp8_products, fp8_classifier; /* fp8_classifier: config_fp8_classifier's FP8_CLASSIFIER_* */
    float *fq_act, *fq_weight, *fq_grad;
    /* fp8 training: the delayed-scaling histories of cpu/fp8.h's DELAYED_* tensors per layer
     * ([FP8_DELAYED_PER_LAYER·l + DELAYED_*]), the scales they were last
     * cast with (the backward re-casts the activations alike), and whether the current micro-batch
     * extends the histories (training micro-batches only) */
    int fp8_delayed, fp8_record;
    float micro_loss; /* the last training micro-batch's mean loss (engine_micro_loss) */
    Fp8History* delayed_hist;
    float* delayed_scale;
    double* norm_partials;
    size_t n_norm_chunks;
    float* arena;
    size_t arena_floats;
} E;

#define NORM_CHUNK 65536 /* grad-norm partial sums: fixed chunks, so the order never depends on threads */

static const char* engine_name(void) { return "cpu"; }
static const char* engine_compute_precision(const Config* cfg) {
    return strcmp(cfg->train.precision, "fp8") == 0 ? "fp8" : "fp32";
}

/* Carves `n` floats off the arena (first pass: only counts). */
static float* take(size_t* cursor, size_t n) {
    float* p = E.arena ? E.arena + *cursor : NULL;
    *cursor += n;
    return p;
}

/* Lays out every activation and scratch buffer; with E.arena == NULL it only counts. Without
 * training, the backward's scratch is empty (and in --generate the loss's probabilities); without
 * samples or --generate, the KV cache. */
static size_t carve_buffers(void) {
    size_t cur = 0, N = (size_t)E.B * E.T, nc = N * E.C, nf = N * E.F;
    size_t att = (size_t)E.B * E.H * E.T * E.T, gnc = E.training ? nc : 0, gnf = E.training ? nf : 0;
    size_t S = (size_t)E.slots, kv = (size_t)E.L * S * E.T * E.C;
    int l;
    for (l = 0; l < E.L; l++) {
        LayerActs* a = &E.layers[l];
        a->ln1 = take(&cur, nc); a->ln1_mean = take(&cur, N); a->ln1_rstd = take(&cur, N);
        a->q = take(&cur, nc); a->k = take(&cur, nc); a->v = take(&cur, nc);
        a->att = take(&cur, att);
        a->atty = take(&cur, nc);
        a->xmid = take(&cur, nc);
        a->ln2 = take(&cur, nc); a->ln2_mean = take(&cur, N); a->ln2_rstd = take(&cur, N);
        a->h = take(&cur, nf); a->h_gelu = take(&cur, nf);
        a->xout = take(&cur, nc);
    }
    E.x0 = take(&cur, nc);
    E.lnf = take(&cur, nc); E.lnf_mean = take(&cur, N); E.lnf_rstd = take(&cur, N);
    E.probs = take(&cur, E.cfg.generate.enabled ? 0 : N * E.Vp); /* the loss's; the prefill needs one row */
    E.branch = take(&cur, nc);
    E.dres_a = take(&cur, gnc); E.dres_b = take(&cur, gnc);
    E.dbranch = take(&cur, gnc); E.dln = take(&cur, gnc); E.datty = take(&cur, gnc);
    E.dq = take(&cur, gnc); E.dk = take(&cur, gnc); E.dv = take(&cur, gnc); /* consecutive: one fp8 tensor */
    E.dh_gelu = take(&cur, gnf); E.dh = take(&cur, gnf);
    if (E.fp8) {
        size_t cc3 = 3 * (size_t)E.C * E.C, cf = (size_t)E.C * E.F, wte = E.fp8_classifier ? (size_t)E.Vp * E.C : 0;
        size_t w = cc3 > cf ? cc3 : cf;
        E.fq_act = take(&cur, nf > nc ? nf : nc);
        E.fq_weight = take(&cur, w > wte ? w : wte);
        E.fq_grad = take(&cur, gnf > 3 * gnc ? gnf : 3 * gnc);
    }
    E.kcache = take(&cur, kv); E.vcache = take(&cur, kv);
    E.dec_x = take(&cur, S * E.C); E.dec_xmid = take(&cur, S * E.C); E.dec_ln = take(&cur, S * E.C);
    E.dec_mean = take(&cur, S); E.dec_rstd = take(&cur, S);
    E.dec_q = take(&cur, S * E.C); E.dec_k = take(&cur, S * E.C); E.dec_v = take(&cur, S * E.C);
    E.dec_att = take(&cur, S * E.H * E.T); E.dec_atty = take(&cur, S * E.C);
    E.dec_h = take(&cur, S * E.F); E.dec_h_gelu = take(&cur, S * E.F); E.dec_branch = take(&cur, S * E.C);
    return cur;
}

/* A plan the machine cannot hold ends the run before anything is allocated, one line as on the GPU
 * (§3.4): each allocation alone may pass the kernel's overcommit check, and the run would then be
 * killed without a word by the OOM killer once the first step touches them all. `need`: the plan
 * and the training loop's host copy of the state (weights, and m and v when training). */
static void check_host_memory(size_t need) {
    struct sysinfo si;
    double have;
    if (sysinfo(&si) != 0) return;
    have = ((double)si.totalram + (double)si.totalswap) * (double)si.mem_unit;
    if ((double)need > have)
        die_io("needs %zu bytes of host memory (%.2f GiB), the machine has %.2f GiB (RAM and swap)", need,
               need / 1073741824.0, have / 1073741824.0);
}

static size_t engine_setup(const Config* cfg) {
    size_t n, bytes[5], kv_floats;
    static const char* groups[5] = {"params", "grads", "adam", "activations", "kv_cache"};
    E.cfg = *cfg;
    param_layout_init(&E.layout, cfg);
    E.B = cfg->train.batch_size; E.T = cfg->model.seq_len; E.C = cfg->model.d_model; E.H = cfg->model.n_head;
    E.F = cfg->model.d_ff; E.V = cfg->model.vocab_size; E.Vp = cfg->model.padded_vocab_size; E.L = cfg->model.n_layer;
    E.training = !cfg->generate.enabled && !cfg->evaluate;
    E.slots = config_kv_slots(cfg);
    n = E.layout.n_params;
    E.shard = dist_part(n, NORM_CHUNK, g_dist.rank, g_dist.world); /* whole chunks: the norm stays exact */
    E.fp8 = strcmp(cfg->train.precision, "fp8") == 0;
    E.fp8_delayed = config_keeps_fp8_histories(cfg);
    E.fp8_classifier = config_fp8_classifier(cfg);
    info_fp8_classifier(cfg, "fp32");
    if (E.fp8_delayed) {
        E.delayed_hist = (Fp8History*)xcalloc(FP8_DELAYED_PER_LAYER * (size_t)E.L, sizeof(Fp8History), "fp8 histories");
        E.delayed_scale = (float*)xcalloc(FP8_DELAYED_PER_LAYER * (size_t)E.L, sizeof(float), "fp8 scales");
    }
    E.layers = (LayerActs*)xcalloc((size_t)E.L, sizeof(LayerActs), "layer table");
    E.arena = NULL;
    E.arena_floats = carve_buffers();
    kv_floats = 2 * (size_t)E.L * E.slots * E.T * E.C;
    bytes[0] = n * 4; bytes[1] = E.training ? n * 4 : 0; bytes[2] = E.training ? 2 * (E.shard.hi - E.shard.lo) * 4 : 0;
    bytes[3] = (E.arena_floats - kv_floats) * 4; bytes[4] = kv_floats * 4;
    info("memory plan (cpu): params %.1f MB, grads %.1f MB, adam %.1f MB, activations %.1f MB, "
         "kv_cache %.1f MB (%d slots of %d positions), total %.1f MB", bytes[0] / 1e6, bytes[1] / 1e6, bytes[2] / 1e6,
         bytes[3] / 1e6, bytes[4] / 1e6, E.slots, E.T, (bytes[0] + bytes[1] + bytes[2] + bytes[3] + bytes[4]) / 1e6);
    check_host_memory(bytes[0] + bytes[1] + bytes[2] + bytes[3] + bytes[4] + (E.training ? 3 : 1) * n * 4);
    E.params = (float*)xmalloc(n * sizeof(float), "weights");
    if (E.training) {
        E.grads = (float*)xcalloc(n, sizeof(float), "gradients");
        E.m = (float*)xcalloc(E.shard.hi - E.shard.lo + 1, sizeof(float), "AdamW m");
        E.v = (float*)xcalloc(E.shard.hi - E.shard.lo + 1, sizeof(float), "AdamW v");
    }
    E.arena = (float*)xmalloc(E.arena_floats * sizeof(float), "activations");
    carve_buffers();
    E.n_norm_chunks = (n + NORM_CHUNK - 1) / NORM_CHUNK;
    E.norm_partials = (double*)xmalloc(E.n_norm_chunks * sizeof(double), "norm partials");
    emit_memory(groups, bytes, 5);
    return bytes[0] + bytes[1] + bytes[2] + bytes[3] + bytes[4];
}

static void engine_set_state(const float* params, const float* m, const float* v, float loss_scale) {
    size_t bytes = E.layout.n_params * sizeof(float);
    (void)loss_scale; /* fp32 needs no loss scaling */
    size_t lo = E.shard.lo, shard_bytes = (E.shard.hi - lo) * sizeof(float);
    memcpy(E.params, params, bytes);
    if (m) memcpy(E.m, m + lo, shard_bytes);
    if (v) memcpy(E.v, v + lo, shard_bytes);
}

static void engine_get_state(float* params, float* m, float* v, float* loss_scale) {
    size_t bytes = E.layout.n_params * sizeof(float);
    size_t n = E.layout.n_params, lo = E.shard.lo, shard_bytes = (E.shard.hi - lo) * sizeof(float);
    memcpy(params, E.params, bytes);
    memcpy(m + lo, E.m, shard_bytes);
    memcpy(v + lo, E.v, shard_bytes);
    dist_gather_parts(m, sizeof(float), n, NORM_CHUNK); /* rank 0 gets the whole state */
    dist_gather_parts(v, sizeof(float), n, NORM_CHUNK);
    *loss_scale = 1.0f;
}

static float* P(size_t offset) { return E.params + offset; }
static float* G(size_t offset) { return E.grads + offset; }
static size_t LO(int l, int t) { return layer_offset(&E.layout, l, t); }

/* The residual stream entering layer l. */
static const float* layer_input(int l) { return l == 0 ? E.x0 : E.layers[l - 1].xout; }

/* What an fp8 product reads of the n values x: with precision fp8, their cast to `fmt` at the
 * tensor's current scale, dequantised, in `scratch`; otherwise x itself. */
static const float* operand(float* scratch, const float* x, size_t n, int fmt) {
    if (!E.fp8_products) return x;
    fp8_fake_quantize(scratch, x, n, fmt);
    return scratch;
}

/* The products' operands at their current scales: activations and weights E4M3 (a gradient's is
 * always a delayed tensor's, delayed_operand). */
static const float* act_operand(const float* x, size_t n) { return operand(E.fq_act, x, n, FP8_E4M3); }
static const float* weight_operand(const float* w, size_t n) { return operand(E.fq_weight, w, n, FP8_E4M3); }

/* The product operand of tensor `which` (DELAYED_*: cpu/fp8.h) of layer l. With delayed scaling
 * (docs/DESIGN.md §18) the first cast of a training step's tensor (`first`: the forward's of an
 * activation, the backward's of a gradient) is at its history's scale (its own, current, while the
 * history is empty) and, in training, records its amax; the backward re-casts an activation at the
 * forward's scale, which gives the codes the GPU keeps from its forward. Without histories
 * (--evaluate) at the tensor's current scale. */
static const float* delayed_operand(int l, int which, const float* x, size_t n, int first) {
    int i = FP8_DELAYED_PER_LAYER * l + which, fmt = fp8_delayed_fmt(which);
    float* scratch = which >= FP8_DELAYED_FORWARD ? E.fq_grad : E.fq_act; /* the backward's: gradients */
    if (!E.fp8_products || !E.fp8_delayed) return operand(scratch, x, n, fmt);
    if (first) {
        float amax = fp8_amax(x, n), s = fp8_history_scale(&E.delayed_hist[i]);
        E.delayed_scale[i] = s > 0.0f ? s : fp8_scale_for_amax(amax, fmt);
        if (E.fp8_record) fp8_history_push(&E.delayed_hist[i], amax, fmt);
    }
    fp8_fake_quantize_at(scratch, x, n, fmt, E.delayed_scale[i]);
    return scratch;
}

static int engine_fp8_history_count(void) { return E.fp8_delayed ? FP8_DELAYED_PER_LAYER * E.L : 0; }
static void engine_get_fp8_history(Fp8History* h) {
    if (E.fp8_delayed) memcpy(h, E.delayed_hist, FP8_DELAYED_PER_LAYER * (size_t)E.L * sizeof(Fp8History));
}
static void engine_set_fp8_history(const Fp8History* h) {
    if (E.fp8_delayed) memcpy(E.delayed_hist, h, FP8_DELAYED_PER_LAYER * (size_t)E.L * sizeof(Fp8History));
}

/* Forward over B sequences of T tokens up to the final LayerNorm (E.lnf). */
static void forward_trunk(const int* tokens, int B, int T) {
    int N = B * T, C = E.C, l;
    E.tokens = tokens;
    embed_forward(E.x0, tokens, P(E.layout.wte), P(E.layout.wpe), B, T, C);
    for (l = 0; l < E.L; l++) {
        LayerActs* a = &E.layers[l];
        const float* x = layer_input(l);
        const float *xa, *wqkv;
        size_t nc = (size_t)N * C, nf = (size_t)N * E.F, cc = (size_t)C * C, cf = (size_t)C * E.F;
        layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x, P(LO(l, T_LN1_GAMMA)), P(LO(l, T_LN1_BETA)), N, C);
        /* W_Q, W_K, W_V are consecutive: one tensor (one fp8 scale) for the three products */
        xa = delayed_operand(l, DELAYED_LN1, a->ln1, nc, 1);
        wqkv = weight_operand(P(LO(l, T_WQ)), 3 * cc);
        matmul_forward(a->q, xa, wqkv, N, C, C);
        matmul_forward(a->k, xa, wqkv + cc, N, C, C);
        matmul_forward(a->v, xa, wqkv + 2 * cc, N, C, C);
        attention_forward(a->atty, a->att, a->q, a->k, a->v, B, T, C, E.H);
        matmul_forward(E.branch, delayed_operand(l, DELAYED_ATT, a->atty, nc, 1), weight_operand(P(LO(l, T_WO)), cc), N, C, C);
        residual_forward(a->xmid, x, E.branch, N * C);
        layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->xmid, P(LO(l, T_LN2_GAMMA)), P(LO(l, T_LN2_BETA)), N, C);
        matmul_forward(a->h, delayed_operand(l, DELAYED_LN2, a->ln2, nc, 1), weight_operand(P(LO(l, T_W1)), cf), N, C, E.F);
        gelu_forward(a->h_gelu, a->h, N * E.F);
        matmul_forward(E.branch, delayed_operand(l, DELAYED_GELU, a->h_gelu, nf, 1), weight_operand(P(LO(l, T_W2)), cf), N, E.F, C);
        residual_forward(a->xout, a->xmid, E.branch, N * C);
    }
    layernorm_forward(E.lnf, E.lnf_mean, E.lnf_rstd, layer_input(E.L), P(E.layout.lnf_gamma), P(E.layout.lnf_beta), N, C);
}

/* The classifier's operands: for the FP8 classifier's products (`fp8`), LNf's output and wte cast to
 * E4M3 at their current scales (cpu/fp8.h), as the GPU casts them once a forward and reads them in
 * its products (the logits' alone, or all three: config_fp8_classifier); otherwise themselves. */
static int fp8_classifier(void) { return E.fp8_classifier != FP8_CLASSIFIER_NONE && E.fp8_products; }
static const float* classifier_x(int fp8) {
    size_t nc = (size_t)E.B * E.T * E.C;
    return fp8 ? act_operand(E.lnf, nc) : E.lnf;
}
static const float* classifier_wte(int fp8) {
    return fp8 ? weight_operand(P(E.layout.wte), (size_t)E.Vp * E.C) : P(E.layout.wte);
}

static float forward_loss(const int* inputs, const int* targets) {
    E.fp8_products = E.fp8;
    forward_trunk(inputs, E.B, E.T);
    return classifier_forward(E.probs, classifier_x(fp8_classifier()), classifier_wte(fp8_classifier()), targets,
                              E.B * E.T, E.C, E.V, E.Vp);
}

/* The classifier backward: dlogits from the probabilities, in place; with the FP8 classifier cast
 * to FP8_DLOGITS_FMT at the static scale of its bound (cpu/fp8.h's fp8_dlogits_scale, the GPU's loss
 * rows' for every chunk), rounded stochastically with the micro-batch's salt (fp8_dlogits_salt) as
 * the GPU's loss rows round them; then its two products into dln and dwte. With the logits' product alone
 * in FP8 (FP8_CLASSIFIER_LOGITS) the fp32 classifier's backward follows the FP8 logits. */
static void classifier_bwd(const int* targets) {
    int N = E.B * E.T, fp8 = fp8_classifier() && E.fp8_classifier == FP8_CLASSIFIER_ALL;
    classifier_dlogits(E.probs, targets, N, E.V, E.Vp);
    if (fp8)
        fp8_fake_quantize_dlogits(E.probs, E.probs, N, E.Vp, 0, fp8_dlogits_salt(targets, N), FP8_DLOGITS_FMT,
                                  fp8_dlogits_scale(1.0f / N));
    classifier_backward_products(E.dln, G(E.layout.wte), E.probs, classifier_x(fp8), classifier_wte(fp8), N, E.C, E.V,
                                 E.Vp);
}

static void zero(float* p, size_t n) { memset(p, 0, n * sizeof(float)); }

/* Backward of the last forward_loss; adds into E.grads. */
static void backward(const int* targets) {
    int N = E.B * E.T, C = E.C, l;
    size_t nc = (size_t)N * C, nf = (size_t)N * E.F, cc = (size_t)C * C, cf = (size_t)C * E.F;
    float *dres = E.dres_a, *dxmid = E.dres_b;
    zero(E.dln, nc);
    classifier_bwd(targets);
    zero(dres, nc);
    layernorm_backward(dres, G(E.layout.lnf_gamma), G(E.layout.lnf_beta), E.dln, layer_input(E.L),
                       P(E.layout.lnf_gamma), E.lnf_mean, E.lnf_rstd, N, C);
    for (l = E.L - 1; l >= 0; l--) {
        LayerActs* a = &E.layers[l];
        const float* x = layer_input(l);
        /* xout = xmid + W_2·gelu(W_1·LN2(xmid)); dres holds d(xout) */
        zero(dxmid, nc); zero(E.dbranch, nc);
        residual_backward(dxmid, E.dbranch, dres, (int)nc);
        zero(E.dh_gelu, nf);
        matmul_backward(E.dh_gelu, G(LO(l, T_W2)), delayed_operand(l, DELAYED_DRES_W2, E.dbranch, nc, 1),
                        delayed_operand(l, DELAYED_GELU, a->h_gelu, nf, 0),
                        weight_operand(P(LO(l, T_W2)), cf), N, E.F, C);
        zero(E.dh, nf);
        gelu_backward(E.dh, a->h, E.dh_gelu, (int)nf);
        zero(E.dln, nc);
        matmul_backward(E.dln, G(LO(l, T_W1)), delayed_operand(l, DELAYED_DGELU, E.dh, nf, 1),
                        delayed_operand(l, DELAYED_LN2, a->ln2, nc, 0), weight_operand(P(LO(l, T_W1)), cf), N, C, E.F);
        layernorm_backward(dxmid, G(LO(l, T_LN2_GAMMA)), G(LO(l, T_LN2_BETA)), E.dln, a->xmid, P(LO(l, T_LN2_GAMMA)),
                           a->ln2_mean, a->ln2_rstd, N, C);
        /* xmid = x + W_O·attn(LN1(x)); dxmid holds d(xmid); dres becomes d(x) */
        zero(dres, nc); zero(E.dbranch, nc);
        residual_backward(dres, E.dbranch, dxmid, (int)nc);
        zero(E.datty, nc);
        matmul_backward(E.datty, G(LO(l, T_WO)), delayed_operand(l, DELAYED_DRES_WO, E.dbranch, nc, 1),
                        delayed_operand(l, DELAYED_ATT, a->atty, nc, 0), weight_operand(P(LO(l, T_WO)), cc), N, C, C);
        zero(E.dq, nc); zero(E.dk, nc); zero(E.dv, nc);
        attention_backward(E.dq, E.dk, E.dv, E.datty, a->att, a->q, a->k, a->v, E.B, E.T, C, E.H);
        zero(E.dln, nc);
        {   /* dq, dk, dv (consecutive) are one fp8 tensor, as are W_Q, W_K, W_V */
            const float *dqkv = delayed_operand(l, DELAYED_DQKV, E.dq, 3 * nc, 1), *xa = delayed_operand(l, DELAYED_LN1, a->ln1, nc, 0);
            const float* wqkv = weight_operand(P(LO(l, T_WQ)), 3 * cc);
            matmul_backward(E.dln, G(LO(l, T_WQ)), dqkv, xa, wqkv, N, C, C);
            matmul_backward(E.dln, G(LO(l, T_WK)), dqkv + nc, xa, wqkv + cc, N, C, C);
            matmul_backward(E.dln, G(LO(l, T_WV)), dqkv + 2 * nc, xa, wqkv + 2 * cc, N, C, C);
        }
        layernorm_backward(dres, G(LO(l, T_LN1_GAMMA)), G(LO(l, T_LN1_BETA)), E.dln, x, P(LO(l, T_LN1_GAMMA)),
                           a->ln1_mean, a->ln1_rstd, N, C);
        /* dres = d(x) = d(xout) of the layer below */
    }
    embed_backward(G(E.layout.wte), G(E.layout.wpe), dres, E.tokens, E.B, E.T, C);
}

static void engine_forward_backward(const int* inputs, const int* targets) {
    E.fp8_record = 1; /* a training micro-batch extends the delayed-scaling histories */
    E.micro_loss = forward_loss(inputs, targets);
    backward(targets);
    E.fp8_record = 0;
}

static float engine_micro_loss(void) { return E.micro_loss; }

static float engine_forward_loss(const int* inputs, const int* targets) { return forward_loss(inputs, targets); }

/* Logits of the real vocabulary for one final-LayerNorm row x (the classifier's dot products). */
static void logits_of(const float* x, float* logits) {
    int v;
#pragma omp parallel for schedule(static)
    for (v = 0; v < E.V; v++) logits[v] = dot_f32(x, P(E.layout.wte) + (size_t)v * E.C, E.C);
}

/* Row `pos` of layer l's key (or value) cache of `slot`. */
static float* kv_row(float* cache, int l, int slot, int pos) {
    return cache + (((size_t)l * E.slots + slot) * E.T + pos) * E.C;
}

static void engine_prefill(int slot, const int* tokens, int len, float* logits) {
    int l;
    if (len < 1 || len > E.T || slot < 0 || slot >= E.slots)
        die_io("internal: engine_prefill of %d tokens into slot %d (1..%d tokens, %d slots)", len, slot, E.T, E.slots);
    E.fp8_products = 0;
    forward_trunk(tokens, 1, len);
    for (l = 0; l < E.L; l++) {
        memcpy(kv_row(E.kcache, l, slot, 0), E.layers[l].k, (size_t)len * E.C * sizeof(float));
        memcpy(kv_row(E.vcache, l, slot, 0), E.layers[l].v, (size_t)len * E.C * sizeof(float));
    }
    logits_of(E.lnf + (size_t)(len - 1) * E.C, logits);
}

/* Attention of the n decoded rows: row i's query over the cached positions 0..positions[i] of its
 * slot (its own key and value already appended). */
static void decode_attention(int l, int n, const int* slots, const int* positions) {
    int hs = E.C / E.H, i;
    float scale = (float)(1.0 / sqrt((double)hs));
#pragma omp parallel for schedule(static)
    for (i = 0; i < n * E.H; i++) {
        int row = i / E.H, h = i % E.H;
        size_t col = (size_t)row * E.C + (size_t)h * hs;
        attention_row(E.dec_atty + col, E.dec_att + (size_t)i * E.T, E.dec_q + col,
                      kv_row(E.kcache, l, slots[row], 0) + h * hs, kv_row(E.vcache, l, slots[row], 0) + h * hs,
                      positions[row], (size_t)E.C, hs, scale);
    }
}

/* One position per sequence through the model with the layer functions of forward_trunk, row by row
 * the same arithmetic. */
static void engine_decode(int n, const int* slots, const int* tokens, const int* positions, float* logits) {
    int C = E.C, i, l;
    float* x = E.dec_x;
    if (n < 1 || n > E.slots) die_io("internal: engine_decode of %d sequences (1..%d)", n, E.slots);
    for (i = 0; i < n; i++) {
        if (positions[i] < 0 || positions[i] >= E.T || slots[i] < 0 || slots[i] >= E.slots)
            die_io("internal: engine_decode at position %d of slot %d", positions[i], slots[i]);
        embed_forward(x + (size_t)i * C, tokens + i, P(E.layout.wte), P(E.layout.wpe) + (size_t)positions[i] * C, 1, 1, C);
    }
    for (l = 0; l < E.L; l++) {
        layernorm_forward(E.dec_ln, E.dec_mean, E.dec_rstd, x, P(LO(l, T_LN1_GAMMA)), P(LO(l, T_LN1_BETA)), n, C);
        matmul_forward(E.dec_q, E.dec_ln, P(LO(l, T_WQ)), n, C, C);
        matmul_forward(E.dec_k, E.dec_ln, P(LO(l, T_WK)), n, C, C);
        matmul_forward(E.dec_v, E.dec_ln, P(LO(l, T_WV)), n, C, C);
        for (i = 0; i < n; i++) {
            memcpy(kv_row(E.kcache, l, slots[i], positions[i]), E.dec_k + (size_t)i * C, (size_t)C * sizeof(float));
            memcpy(kv_row(E.vcache, l, slots[i], positions[i]), E.dec_v + (size_t)i * C, (size_t)C * sizeof(float));
        }
        decode_attention(l, n, slots, positions);
        matmul_forward(E.dec_branch, E.dec_atty, P(LO(l, T_WO)), n, C, C);
        residual_forward(E.dec_xmid, x, E.dec_branch, n * C);
        layernorm_forward(E.dec_ln, E.dec_mean, E.dec_rstd, E.dec_xmid, P(LO(l, T_LN2_GAMMA)), P(LO(l, T_LN2_BETA)), n, C);
        matmul_forward(E.dec_h, E.dec_ln, P(LO(l, T_W1)), n, C, E.F);
        gelu_forward(E.dec_h_gelu, E.dec_h, n * E.F);
        matmul_forward(E.dec_branch, E.dec_h_gelu, P(LO(l, T_W2)), n, E.F, C);
        residual_forward(x, E.dec_xmid, E.dec_branch, n * C);
    }
    layernorm_forward(E.dec_ln, E.dec_mean, E.dec_rstd, x, P(E.layout.lnf_gamma), P(E.layout.lnf_beta), n, C);
    for (i = 0; i < n; i++) logits_of(E.dec_ln + (size_t)i * C, logits + (size_t)i * E.V);
}

/* Global L2 norm of the gradients: per-chunk double sums, then the chunks in order. Each rank sums
 * the chunks of its shard; rank 0 adds all chunks in order, so the norm does not depend on the
 * number of ranks. */
static double grad_norm(void) {
    long c, c_lo = (long)(E.shard.lo / NORM_CHUNK), c_hi = (long)((E.shard.hi + NORM_CHUNK - 1) / NORM_CHUNK);
    long nc = (long)E.n_norm_chunks;
    size_t n = E.layout.n_params;
    double total = 0.0;
#pragma omp parallel for schedule(static)
    for (c = c_lo; c < c_hi; c++) {
        size_t i, lo = (size_t)c * NORM_CHUNK, hi = lo + NORM_CHUNK < n ? lo + NORM_CHUNK : n;
        double s = 0.0;
        for (i = lo; i < hi; i++) s += (double)E.grads[i] * (double)E.grads[i];
        E.norm_partials[c] = s;
    }
    dist_gather_parts(E.norm_partials, sizeof(double), (size_t)nc, 1);
    for (c = 0; c < nc; c++) total += E.norm_partials[c];
    dist_broadcast(&total, sizeof total);
    return sqrt(total);
}

/* The shard's gradients (the whole vector with one rank) times s. */
static void scale_grads(float s) {
    long i, lo = (long)E.shard.lo, hi = (long)E.shard.hi;
#pragma omp parallel for schedule(static)
    for (i = lo; i < hi; i++) E.grads[i] *= s;
}

static UpdateResult engine_update(float lr, int t, const Config* cfg) {
    UpdateResult r;
    double norm;
    int i, micro_batches = cfg->train.grad_accum * g_dist.world;
    size_t n = E.layout.n_params;
    /* ZeRO-1 (§17): the ranks' sums in rank order, this rank's shard of it; AdamW on the shard */
    dist_reduce_scatter_sum(E.grads, n, NORM_CHUNK);
    if (micro_batches > 1) scale_grads(1.0f / (float)micro_batches);
    norm = grad_norm();
    if (cfg->train.grad_clip > 0.0f && norm > cfg->train.grad_clip) scale_grads((float)(cfg->train.grad_clip / norm));
    for (i = 0; i < E.layout.n_tensors; i++) {
        const ParamTensor* pt = &E.layout.tensors[i];
        size_t lo = pt->offset > E.shard.lo ? pt->offset : E.shard.lo;
        size_t hi = pt->offset + pt->size < E.shard.hi ? pt->offset + pt->size : E.shard.hi;
        if (lo >= hi) continue;
        adamw_update(E.params + lo, E.grads + lo, E.m + (lo - E.shard.lo), E.v + (lo - E.shard.lo), (long)(hi - lo), lr,
                     cfg->train.beta1, cfg->train.beta2, cfg->train.eps, pt->decay ? cfg->train.weight_decay : 0.0f, t);
    }
    dist_all_gather_parts(E.params, sizeof(float), n, NORM_CHUNK);
    zero(E.grads, n);
    r.grad_norm = (float)norm;
    r.skipped = 0;
    r.loss_scale = 1.0f;
    return r;
}

static void engine_get_grads(float* grads) { memcpy(grads, E.grads, E.layout.n_params * sizeof(float)); }

static size_t engine_device_bytes_in_use(void) { return 0; }

static void engine_shutdown(void) {
    free(E.params); free(E.grads); free(E.m); free(E.v); free(E.arena); free(E.norm_partials); free(E.layers);
    free(E.delayed_hist); free(E.delayed_scale);
    param_layout_free(&E.layout);
    memset(&E, 0, sizeof E);
}

int main(int argc, char** argv) { return engine_main(argc, argv); }
