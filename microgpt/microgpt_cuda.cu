/* microgpt_cuda.cu: the GPU engine. The model of docs/DESIGN.md §2 (pre-LayerNorm GPT, no biases, tied
 * embeddings, padded vocabulary) assembled from the kernel pairs in cuda/ (one header per layer),
 * implementing host/engine.h; the training loop itself is host/train_loop.h, shared with the CPU
 * engine.
 *
 * Precision (train.precision):
 *   fp32  everything fp32, no TF32: the reference that is compared tightly with the CPU engine.
 *   tf32  fp32 in every buffer and kernel, but cuBLAS multiplies fp32 inputs on tensor cores in
 *         TF32 (10-bit mantissa, fp32 accumulation): PyTorch's default for fp32 matmuls, and
 *         several times faster products; compared with the CPU engine at fp16-like tolerances.
 *   bf16  fp32 master weights, gradients and AdamW moments; a bf16 copy of the weights (rewritten
 *         by the AdamW kernel) feeds the matrix products; activations and their gradients bf16;
 *         every product accumulates in fp32; LayerNorm/embedding read the fp32 masters; attention
 *         scores are fp32; logits are bf16, their softmax and loss fp32 (cuda/loss.cuh).
 *   fp16  as bf16 with fp16, plus dynamic loss scaling: the loss gradient is multiplied by the
 *         scale; engine_update unscales, and when the gradient norm is not finite it skips the
 *         step (the next micro-batch overwrites its gradients) and halves the scale; every
 *         LOSS_SCALE_GROW_EVERY-th step (a pure function of the step, so resume stays exact) that
 *         is not skipped doubles it.
 *   fp8   as bf16, except the four linear products of each layer (QKV, attention output, MLP up
 *         and down): FP8 tensor-core products (cuda/fp8.cuh) of operands cast per tensor at their
 *         current scale, E4M3 weights, activations and activation gradients, fp32
 *         accumulation (the forward's products in cuBLASLt's fast-accumulation mode:
 *         FP8_FAST_ACCUM), bf16 activations and fp32 weight gradients out. Where that pays (d_model 512 and up:
 *         config_fp8_classifier, loss_chunks) the classifier's three products run in FP8 too (dlogits
 *         rounded stochastically), or with train.fp8_classifier logits its logits product alone (its
 *         backward in bf16); else all three in bf16.
 *         Needs compute capability 8.9 or newer. docs/DESIGN.md §18. In training, ln1, ln2 and
 *         h_gelu are cast at delayed scales (from amax histories) instead, written by their
 *         producers (LayerNorm, GELU) as FP8 codes; so are the attention output att, by the
 *         flash attention forward (Hopper's kernel), MLP up's output gradient dh, by the GELU
 *         backward, the residual gradients that are W_2's and W_O's output gradients, by the
 *         LayerNorm backwards that add into them, and QKV's output gradient dqkv, by the flash
 *         attention backward (Hopper's kernels).
 *
 * Memory: engine_setup sizes every buffer from the config, prints the plan, checks it fits, and
 * allocates once; nothing is allocated afterwards. Activation buffers are sized for B·T positions
 * and reused by smaller calls (one prompt's prefill). --generate and --evaluate train nothing, so
 * their plan has no gradients, AdamW state or backward scratch.
 *
 * Generation (docs/DESIGN.md §5a): engine_prefill runs the training forward over a prompt (padded
 * to T, as one sequence) and copies its keys and values into a KV-cache slot; engine_decode runs
 * one position of n sequences with cuda/decode.cuh as one CUDA graph per n, captured on first use
 * (the training samples' n = 1 by the warm-up), the step's tokens uploaded by its first node and
 * the fp32 logits downloaded by its last.
 *
 * Determinism: no float atomics anywhere; fixed-shape reductions; one cuBLAS and one cuBLASLt
 * handle sharing a fixed workspace on one stream, cuBLASLt's algorithms chosen by a fixed rule over
 * its heuristic's offers or a fixed table (common.cuh; not by timing). Two runs of the same config
 * on the same GPU give identical bits. (Where the layers' products are small, side_stream_pays, the
 * backward's weight gradients run on a second stream with its own handle and workspace of the same
 * size, ordered by events: the same kernels on the same data, the same bits; see backward().)
 *
 * Speed: a micro-batch (tokens in, forward, loss, backward, mean loss out) and the update (norm,
 * clip, AdamW, norm out) each run as one CUDA graph, captured at setup and replayed: no per-kernel
 * launch cost and no host round trip inside either. The micro-batch has two graphs, the first
 * micro-batch of a step's (its parameter gradients overwrite the buffer, so the gradients are never
 * zeroed) and the later ones' (they add). Whatever changes
 * between replays (tokens, learning rate, bias corrections, loss scale) is copied from pinned host
 * memory by the graph's first kernel (copy_words: no copy-engine node); the one float each returns
 * (loss, norm) is written back by its last. The micro-batch's graph is queued and not waited for,
 * so the update's follows it without a host round trip (micro_batch_settle).
 * ANDREA_CUDA_SYNC=1 (synchronise after every launch) and ANDREA_NO_GRAPH=1 run the same work
 * uncaptured, launch by launch.
 *
 * Build: make cuda   (nvcc -O3 -std=c++17, linked with -lcublas -lcublasLt) */
#include "host/train_loop.h"

#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/decode.cuh"
#include "cuda/dist.cuh"
#include "cuda/embed.cuh"
#include "cuda/fp8.cuh"
#include "cuda/layernorm.cuh"
#include "cuda/loss.cuh"
#include "cuda/matmul.cuh"
#include "cuda/mlp.cuh"
#include "cuda/optimizer.cuh"
#include "cuda/residual.cuh"

enum { PREC_FP32, PREC_BF16, PREC_FP16 };

/* precision fp8: the FP8 products of a layer, by weight tensor (W_Q, W_K, W_V are one). Each has
 * three casts, hence three scales: its weight's, its input's, its output gradient's. */
enum { FP8_W_QKV, FP8_W_O, FP8_W_1, FP8_W_2, FP8_W_PER_LAYER };

/* The instance of function template `fn` for the run's activation type: the one place where the
 * precision picks a type (fp32 and tf32 both run on float). Every `fn` instance has the same
 * signature, so the result is one function pointer whatever the type. */
#define FOR_ACT_TYPE(fn) (E.prec == PREC_BF16 ? fn<bf16> : E.prec == PREC_FP16 ? fn<fp16> : fn<float>)

/* What the graphs read from the host on each replay (uploaded first) and hand back (downloaded
 * last), so that their kernels' arguments never change. */
typedef struct {
    UpdateCtl uctl; /* engine_update: learning rate, bias corrections, gradient multiplier, clip */
    float dscale;   /* the loss gradient's weight: 1/N, times the loss scale in fp16 */
    unsigned dlogits_salt; /* the FP8 classifier's: cpu/fp8.h's fp8_dlogits_salt of the targets */
    /* outputs (from offsetof(StepIO, loss) on) */
    float loss; /* mean loss of the last micro-batch */
    float norm; /* gradient norm of the last update */
} StepIO;
#define STEPIO_IN_BYTES offsetof(StepIO, loss)

#define LOSS_SCALE_DEFAULT 65536.0f  /* 2^16: fp16's usual starting scale */
#define LOSS_SCALE_MAX 16777216.0f   /* 2^24 */
#define LOSS_SCALE_GROW_EVERY 1000

/* Memory groups of the plan, in the order printed and emitted. */
enum { G_PARAMS, G_GRADS, G_ADAM, G_WEIGHTS_LOWP, G_ACTIVATIONS, G_ACT_GRADS, G_SCRATCH, G_KV_CACHE, G_CUBLAS,
       N_GROUPS };
static const char* const GROUP_NAMES[N_GROUPS] = {"params", "grads", "adam", "weights_lowp", "activations",
                                                  "activation_grads", "scratch", "kv_cache", "cublas_workspace"};
static const char* const GROUP_HELP[N_GROUPS] = {
    "fp32 master weights", "fp32 gradients", "fp32 AdamW m and v, weight-decay mask",
    "16-bit weight copy for the products",
    "forward values saved for backward", "activation gradients (shared by layers)",
    "attention scores or dS tiles, logits chunk, reductions, tokens, decode step",
    "keys and values of the sequences being generated",
    "fixed cuBLAS workspace (two with the backward's side stream)"};

static struct {
    Config cfg;
    ParamLayout layout;
    int prec;
    size_t es; /* bytes per activation element */
    int B, T, C, H, F, V, Vp, L, N; /* N = B*T, the positions the buffers are sized for */
    int chunk;                      /* logits rows per chunk */
    size_t P;                       /* parameter count */
    float loss_scale;

    /* parameters (fp32 unless noted) */
    float *params, *grads, *m, *v; /* m, v: this rank's part only (ZeRO-1, docs/DESIGN.md §17) */
    DistPart shard;       /* the weights this rank updates; the whole vector with one rank */
    size_t shard_stride;  /* parts' stride; params and grads hold P_padded = world × stride */
    size_t P_padded;
    unsigned* decay_bits; /* AdamW's weight-decay mask, adamw_decay_words(P) words */
    void* wlow; /* weights in the activation type; == params when fp32 */

    /* precision fp8 only (else NULL): fp8 copies of the linear layers' weights at their parameter
     * offsets, in the layouts of cuda/fp8.cuh (w8_fwd: W^T for the forward, w8_dx: W for the
     * input gradient); the scales of every cast ([L][FP8_W_PER_LAYER] each of the weights', the
     * products' inputs' and their output gradients', in that order; the FP8 classifier's too:
     * w8_scale); the cast input of the forward product in flight (a8); the cast inputs kept transposed for the weight gradients (x8t, per
     * layer: ln1, atty, ln2 [N][C] each, h_gelu [N][F], written by the forward's casts); the cast
     * output gradient of the backward product in flight (g8, g8t) */
    int use_fp8, use_fp8_classifier; /* use_fp8_classifier: config_fp8_classifier's logits or all */
    int fp8_classifier_all;          /* config_fp8_classifier's all: its backward's products too */
    fp8 *w8_fwd, *w8_dx;
    Fp8CastJob<float>* w8_job_list; /* the weights' casts (device), w8_jobs the list */
    Fp8CastJobs<float> w8_jobs;
    AmaxRange* w8_amax_ranges; /* the casts' inputs as parameter ranges, for AdamW's amax (device) */
    int lowp_stale; /* an update left the fp8 weights' part of wlow behind: refresh_stale_lowp_weights */
    Fp8Scale* fp8_scales;
    fp8 *a8, *x8t, *g8, *g8t;
    /* the FP8 classifier only (else NULL): LNf's output cast transposed, chunk by chunk of the
     * logits (chunk r0's [C][n] at r0 * C; its row-major codes go to a8, which no product reads
     * again until the next forward), and one chunk's dlogits codes [chunk][Vp] and [Vp][chunk] */
    fp8 *lnf8t, *dl8, *dl8t;
    /* delayed scaling (docs/DESIGN.md §18), training fp8 only: cpu/fp8.h's DELAYED_* tensors (ln1,
     * ln2, h_gelu, att, dh, W_2's and W_O's output gradients, dqkv) are cast at delayed scales,
     * from the histories fp8_hist
     * [L][FP8_DELAYED_PER_LAYER] (device), which every training micro-batch extends by their amaxes
     * (k_fp8_history_push) and the checkpoint sidecar keeps */
    int fp8_delayed;
    Fp8History* fp8_hist;
    int fp8_hist_filled; /* the histories hold entries: the producers write the codes themselves */

    /* saved activations, per layer l at offset l * (size of one layer's slice) */
    void *res;   /* [L+1][N][C] residual stream: res[l] = input of layer l, res[L] = final */
    void *xmid;  /* [L][N][C] stream after the attention branch */
    void *ln1, *ln2; /* [L][N][C] */
    void *qkv;   /* [L][3][N][C] */
    void *atty;  /* [L][N][C] attention output before W_O */
    void *h;     /* [L][N][F] MLP pre-activation */
    void *h_gelu; /* [L][N][F] gelu(h); fp8: [N][F], one layer's (its backward reads x8t instead) */
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd; /* [L][N] */
    float *att_lse; /* [L][B][H][T] */
    void *lnf;      /* [N][C] */
    float *lnf_mean, *lnf_rstd;

    /* activation gradients, shared by all layers; each sub-layer's backward overwrites its input
     * gradient (matmul.cuh), only dres is added into (zeroed once per backward) */
    void *dres; /* [N][C] gradient of the residual stream at the current depth */
    void *dln;  /* [N][C] gradient of a LayerNorm output */
    void *dqkv; /* [3][N][C] */
    void *datty; /* [N][C] */
    void *dh;   /* [N][F] MLP scratch gradient */

    /* scratch */
    float *att_S, *att_dP; void* att_P; /* [H][T][T], cuBLAS attention only (else empty) */
    float* att_delta;                     /* [B][H][T], flash attention only (else empty) */
    void* att_ds;                         /* dS tiles of the causal half, flash attention only (else empty) */
    void* logits;   /* [chunk][Vp] logits, then their gradient; at least Vp floats (a prefill's row) */
    float *losses, *loss_lse; /* [N] */
    float* loss_part;         /* the fused classifier backward's partials (classifier_grad.cuh), or empty */
    float* ln_partial;
    float* norm_partial;
    int* tok;     /* device: inputs [N] | targets [N] */
    void* embed_scratch; /* the embedding backward's (embed_bwd_scratch_bytes) */
    StepIO* io;   /* device: per-call inputs and outputs of the graphs */
    void* cublas_ws;
    void* side_ws; /* use_side_stream: the side stream's cuBLAS workspace */

    /* host */
    int* tok_host;    /* pinned mirror of tok */
    StepIO* io_host;  /* pinned mirror of io */
    int use_graphs;   /* 0: ANDREA_CUDA_SYNC / ANDREA_NO_GRAPH, run launch by launch */
    int use_side_stream; /* training, small products (side_stream_pays): weight gradients on a side stream */
    /* fb_graph[0]: the first micro-batch after an update (parameter gradients overwritten, so
     * never zeroed), [1]: the later ones (added); all instantiated by the warm-up */
    cudaGraphExec_t fb_graph[2], update_graph;
    int grads_pending; /* the gradients hold micro-batches not yet used by an update */
    int micro_batch_queued; /* a micro-batch's graph was queued and not yet waited for (micro_batch_settle) */
    float micro_loss;       /* the last waited-for micro-batch's mean loss (engine_micro_loss) */
    float grad_beta;   /* of the micro-batch being recorded: 0 overwrite, 1 add (matmul.cuh) */
    char* group_base[N_GROUPS];
    size_t group_bytes[N_GROUPS];

    /* generation */
    int training;              /* 0 in --generate and --evaluate: no gradients, no AdamW state */
    int slots;                 /* KV-cache slots (config_kv_slots) */
    void *kcache, *vcache;     /* [L][slots][T][C] each */
    void *dec_x, *dec_res1, *dec_ln, *dec_qkv, *dec_atty, *dec_fc; /* one decode step's rows [slots][..] */
    float *dec_mean, *dec_rstd, *dec_scores, *dec_logits;          /* [slots], [slots][H][T], [slots][V] */
    int* dec_io;               /* device: slots | tokens | positions, [slots] each */
    int* dec_io_host;          /* pinned mirror of dec_io */
    float* dec_logits_host;    /* pinned [slots][V] */
    cudaGraphExec_t* decode_graph; /* [slots]: the step of n sequences is decode_graph[n-1] */
    int decode_n;              /* sequences of the step being recorded */
} E;

static const char* engine_name(void) { return "cuda"; }
static const char* engine_compute_precision(const Config* cfg) { return cfg->train.precision; }

/* The logits chunks of a micro-batch; how many activation scales the FP8 classifier's casts add to
 * E.fp8_scales (LNf output's, each chunk's dlogits'; wte's is among the weights'), none without it. */
static int loss_chunk_count(void) { return (E.N + E.chunk - 1) / E.chunk; }
static int fp8_cls_act_scale_count(void) { return E.use_fp8_classifier ? 1 + loss_chunk_count() : 0; }

/* precision fp8: how many casts the weights' list holds (fp8_list_weight_casts): the layers' and,
 * with the FP8 classifier, wte's. */
static size_t fp8_weight_cast_count(void) { return (size_t)FP8_W_PER_LAYER * E.L + (E.use_fp8_classifier ? 1 : 0); }

/* Whether the FP8 classifier's backward products are FP8 too (train.fp8_classifier all): what LNf's
 * transposed codes, wte's and the dlogits' codes are made for. The dlogits' scales stay in
 * fp8_cls_act_scale_count either way (a few bytes). */
static bool fp8_cls_bwd(void) { return E.use_fp8_classifier && E.fp8_classifier_all; }

/* Whether training takes the classifier backward of classifier_grad.cuh (its partials need scratch):
 * in every chunk of the step (rows a multiple of CG_ALIGN) or in none; in bf16, and in fp8 where its
 * classifier is bf16 (not the FP8 classifier, whose products are its own). */
static bool classifier_fused(void) {
    return E.training && E.prec == PREC_BF16 && !(E.use_fp8 && E.use_fp8_classifier) && E.N % CG_ALIGN == 0 &&
           E.chunk % CG_ALIGN == 0 && classifier_grad_fused_ok<bf16>(E.C, E.Vp);
}

/* ---------------------------------------------------------------------------------------------- */
/* The memory plan. plan_buffers walks every buffer once; with bases NULL it only sums the sizes
 * per group, with real bases it hands out the pointers. One walk, so the plan and the allocation
 * cannot disagree. */

static void* carve(int group, size_t bytes, size_t* used) {
    size_t at = used[group];
    used[group] += align_256(bytes); /* 256-byte alignment for every buffer */
    return E.group_base[group] ? E.group_base[group] + at : NULL;
}

static void plan_buffers(size_t* used) {
    size_t es = E.es, L = (size_t)E.L, N = (size_t)E.N, C = (size_t)E.C, F = (size_t)E.F, P = E.P;
    size_t nc = N * C, tt = attn_scratch_elems(E.prec != PREC_FP32, E.B, E.T, E.C, E.H);
    size_t S = (size_t)E.slots, tr = (size_t)E.training; /* tr: 0 leaves the training-only buffers empty */
    int g;
    for (g = 0; g < N_GROUPS; g++) used[g] = 0;
    E.params = (float*)carve(G_PARAMS, E.P_padded * 4, used);
    E.grads = (float*)carve(G_GRADS, tr * E.P_padded * 4, used);
    E.m = (float*)carve(G_ADAM, tr * (E.shard.hi - E.shard.lo) * 4, used);
    E.v = (float*)carve(G_ADAM, tr * (E.shard.hi - E.shard.lo) * 4, used);
    E.decay_bits = (unsigned*)carve(G_ADAM, tr * adamw_decay_words(P) * 4, used);
    E.wlow = E.prec == PREC_FP32 ? (void*)E.params : carve(G_WEIGHTS_LOWP, P * es, used);
    if (E.use_fp8) {
        size_t act = N * (F > C ? F : C), grad = N * (F > 3 * C ? F : 3 * C);
        E.w8_fwd = (fp8*)carve(G_WEIGHTS_LOWP, P, used);
        E.w8_dx = (fp8*)carve(G_WEIGHTS_LOWP, P, used);
        size_t cls = fp8_cls_bwd() ? 1 : 0, dl = cls * tr * E.chunk * (size_t)E.Vp;
        size_t scales = fp8_weight_cast_count() + 2 * FP8_W_PER_LAYER * L + fp8_cls_act_scale_count();
        E.fp8_scales = (Fp8Scale*)carve(G_SCRATCH, scales * sizeof(Fp8Scale), used);
        E.w8_job_list = (Fp8CastJob<float>*)carve(G_SCRATCH, fp8_weight_cast_count() * sizeof(Fp8CastJob<float>), used);
        E.w8_amax_ranges = (AmaxRange*)carve(G_SCRATCH, fp8_weight_cast_count() * sizeof(AmaxRange), used);
        E.a8 = (fp8*)carve(G_SCRATCH, act, used);
        E.x8t = (fp8*)carve(G_ACTIVATIONS, tr * L * N * (3 * C + F), used);
        E.g8 = (fp8*)carve(G_SCRATCH, tr * grad, used);
        E.g8t = (fp8*)carve(G_SCRATCH, tr * grad, used);
        E.fp8_hist = (Fp8History*)carve(G_SCRATCH, (E.fp8_delayed ? FP8_DELAYED_PER_LAYER * L : 0) * sizeof(Fp8History),
                                        used);
        E.lnf8t = (fp8*)carve(G_ACTIVATIONS, cls * tr * nc, used);
        E.dl8 = (fp8*)carve(G_SCRATCH, dl, used);
        E.dl8t = (fp8*)carve(G_SCRATCH, dl, used);
    }

    E.res = carve(G_ACTIVATIONS, (L + 1) * nc * es, used);
    E.xmid = carve(G_ACTIVATIONS, L * nc * es, used);
    E.ln1 = carve(G_ACTIVATIONS, L * nc * es, used);
    E.ln2 = carve(G_ACTIVATIONS, L * nc * es, used);
    E.qkv = carve(G_ACTIVATIONS, L * 3 * nc * es, used);
    E.atty = carve(G_ACTIVATIONS, L * nc * es, used);
    E.h = carve(G_ACTIVATIONS, L * N * F * es, used);
    E.h_gelu = carve(G_ACTIVATIONS, (E.use_fp8 ? 1 : L) * N * F * es, used);
    E.ln1_mean = (float*)carve(G_ACTIVATIONS, L * N * 4, used);
    E.ln1_rstd = (float*)carve(G_ACTIVATIONS, L * N * 4, used);
    E.ln2_mean = (float*)carve(G_ACTIVATIONS, L * N * 4, used);
    E.ln2_rstd = (float*)carve(G_ACTIVATIONS, L * N * 4, used);
    E.att_lse = (float*)carve(G_ACTIVATIONS, L * N * (size_t)E.H * 4, used);
    E.lnf = carve(G_ACTIVATIONS, nc * es, used);
    E.lnf_mean = (float*)carve(G_ACTIVATIONS, N * 4, used);
    E.lnf_rstd = (float*)carve(G_ACTIVATIONS, N * 4, used);

    E.dres = carve(G_ACT_GRADS, tr * nc * es, used);
    E.dln = carve(G_ACT_GRADS, tr * nc * es, used);
    E.dqkv = carve(G_ACT_GRADS, tr * 3 * nc * es, used);
    E.datty = carve(G_ACT_GRADS, tr * nc * es, used);
    E.dh = carve(G_ACT_GRADS, tr * N * F * es, used);

    E.att_S = (float*)carve(G_SCRATCH, tt * 4, used);
    E.att_dP = (float*)carve(G_SCRATCH, tr * tt * 4, used);
    E.att_P = carve(G_SCRATCH, tt * es, used);
    E.att_delta = (float*)carve(G_SCRATCH, tr * attn_delta_elems(E.prec != PREC_FP32, E.B, E.T, E.C, E.H) * 4, used);
    E.att_ds = carve(G_SCRATCH, tr * attn_ds_elems(E.prec != PREC_FP32, E.B, E.T, E.C, E.H) * es, used);
    E.logits = carve(G_SCRATCH, (size_t)E.Vp * (E.chunk * es > 4 ? E.chunk * es : 4), used);
    E.losses = (float*)carve(G_SCRATCH, N * 4, used);
    E.loss_lse = (float*)carve(G_SCRATCH, N * 4, used);
    E.loss_part = classifier_fused() ? (float*)carve(G_SCRATCH, classifier_grad_scratch_floats(E.chunk, E.C) * 4, used) : NULL;
    E.ln_partial = (float*)carve(G_SCRATCH, layernorm_scratch_floats(E.C) * 4, used);
    E.norm_partial = (float*)carve(G_SCRATCH, NORM_BLOCKS * 4, used);
    E.tok = (int*)carve(G_SCRATCH, 2 * N * 4, used);
    E.embed_scratch = carve(G_SCRATCH, embed_bwd_scratch_bytes(E.V, E.N, E.C), used);
    E.io = (StepIO*)carve(G_SCRATCH, sizeof(StepIO), used);
    E.dec_x = carve(G_SCRATCH, S * C * es, used);
    E.dec_res1 = carve(G_SCRATCH, S * C * es, used);
    E.dec_ln = carve(G_SCRATCH, S * C * es, used);
    E.dec_qkv = carve(G_SCRATCH, 3 * S * C * es, used);
    E.dec_atty = carve(G_SCRATCH, S * C * es, used);
    E.dec_fc = carve(G_SCRATCH, S * F * es, used);
    E.dec_mean = (float*)carve(G_SCRATCH, S * 4, used);
    E.dec_rstd = (float*)carve(G_SCRATCH, S * 4, used);
    E.dec_scores = (float*)carve(G_SCRATCH, S * (size_t)E.H * E.T * 4, used);
    E.dec_logits = (float*)carve(G_SCRATCH, S * (size_t)E.V * 4, used);
    E.dec_io = (int*)carve(G_SCRATCH, 3 * S * 4, used);
    E.kcache = carve(G_KV_CACHE, L * S * E.T * C * es, used);
    E.vcache = carve(G_KV_CACHE, L * S * E.T * C * es, used);
    E.cublas_ws = carve(G_CUBLAS, CUBLAS_WORKSPACE_BYTES, used);
    E.side_ws = carve(G_CUBLAS, (size_t)E.use_side_stream * CUBLAS_WORKSPACE_BYTES, used);
}

static void print_plan(const size_t* bytes) {
    size_t total = 0;
    int g;
    info("memory plan (%s, B=%d T=%d, %zu parameters, logits in chunks of %d rows):", E.cfg.train.precision, E.B, E.T,
         E.P, E.chunk);
    for (g = 0; g < N_GROUPS; g++) {
        info("  %-18s %14zu bytes %10.1f MiB   %s", GROUP_NAMES[g], bytes[g], bytes[g] / 1048576.0, GROUP_HELP[g]);
        total += bytes[g];
    }
    info("  %-18s %14zu bytes %10.1f MiB", "total", total, total / 1048576.0);
}

/* ---------------------------------------------------------------------------------------------- */
/* Typed views of the buffers */

template <typename T> static T* layer_act(void* base, int l, size_t per_layer) { return (T*)base + (size_t)l * per_layer; }

/* The residual stream entering layer l (l = L: the last layer's output, LNf's input). */
template <typename T> static T* layer_input(int l) { return layer_act<T>(E.res, l, (size_t)E.N * E.C); }

/* The saved forward values of layer l. */
template <typename T> struct LayerActs {
    T *x, *xmid, *ln1, *ln2, *qkv, *atty, *h, *h_gelu;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd, *att_lse;
};

template <typename T> static LayerActs<T> layer_acts(int l) {
    size_t nc = (size_t)E.N * E.C, nf = (size_t)E.N * E.F, n = (size_t)E.N; /* per-layer strides: allocated sizes */
    LayerActs<T> a;
    a.x = layer_input<T>(l);
    a.xmid = layer_act<T>(E.xmid, l, nc);
    a.ln1 = layer_act<T>(E.ln1, l, nc);
    a.ln2 = layer_act<T>(E.ln2, l, nc);
    a.qkv = layer_act<T>(E.qkv, l, 3 * nc);
    a.atty = layer_act<T>(E.atty, l, nc);
    a.h = layer_act<T>(E.h, l, nf);
    a.h_gelu = layer_act<T>(E.h_gelu, E.use_fp8 ? 0 : l, nf);
    a.ln1_mean = E.ln1_mean + l * n;
    a.ln1_rstd = E.ln1_rstd + l * n;
    a.ln2_mean = E.ln2_mean + l * n;
    a.ln2_rstd = E.ln2_rstd + l * n;
    a.att_lse = E.att_lse + l * n * E.H;
    return a;
}

/* Weight tensor `t` of layer l in the activation type (products) / fp32 master (LayerNorm). */
template <typename T> static const T* wl(int l, int t) { return (const T*)E.wlow + layer_offset(&E.layout, l, t); }
static const float* wf(int l, int t) { return E.params + layer_offset(&E.layout, l, t); }
static float* gl(int l, int t) { return E.grads + layer_offset(&E.layout, l, t); }

/* ---------------------------------------------------------------------------------------------- */
/* Precision fp8: the layers' linear products on FP8 operands (cuda/fp8.cuh) */

/* The scales of layer l's product k: its weight's, its input's, its output gradient's. The weights'
 * casts' scales come first, all of them (fp8_weight_cast_count: the FP8 classifier's wte last),
 * then the inputs', the output gradients', and the FP8 classifier's LNf output's and dlogits'. */
static Fp8Scale* w8_scale(int l, int k) { return E.fp8_scales + (size_t)l * FP8_W_PER_LAYER + k; }
static Fp8Scale* x8_scale(int l, int k) { return w8_scale(l, k) + fp8_weight_cast_count(); }
static Fp8Scale* g8_scale(int l, int k) { return x8_scale(l, k) + (size_t)FP8_W_PER_LAYER * E.L; }
/* Where a producer with the amax fused (LayerNorm, GELU) puts it: a cast's scale; NULL off fp8. */
static unsigned* x8_amax(int l, int k) { return E.use_fp8 ? &x8_scale(l, k)->amax_bits : NULL; }
static unsigned* g8_amax(int l, int k) { return E.use_fp8 ? &g8_scale(l, k)->amax_bits : NULL; }
/* The FP8 classifier's scales (wte's, then fp8_cls_act_scale_count), and whether a forward with fp8 products runs
 * the classifier's in FP8 too. */
static Fp8Scale* cls_w_scale(void) { return w8_scale(0, 0) + (size_t)FP8_W_PER_LAYER * E.L; }
static Fp8Scale* cls_x_scale(void) { return g8_scale(0, 0) + (size_t)FP8_W_PER_LAYER * E.L; }
static Fp8Scale* cls_g_scale(int chunk) { return cls_x_scale() + 1 + chunk; }
static bool fp8_classifier(bool fp8) { return E.use_fp8_classifier && fp8; }

/* Layer l's input of product k, cast and transposed [in][N] by the forward (E.x8t). */
static fp8* x8t(int l, int k) {
    size_t N = (size_t)E.N, C = (size_t)E.C;
    return E.x8t + (size_t)l * N * (3 * C + E.F) + (size_t)k * N * C;
}

static Fp8Mat w8_fwd(int l, int t, int k, long long stride = 0) {
    return fp8_mat(E.w8_fwd + layer_offset(&E.layout, l, t), FP8_E4M3, w8_scale(l, k), stride);
}
static Fp8Mat w8_dx(int l, int t, int k) { return fp8_mat(E.w8_dx + layer_offset(&E.layout, l, t), FP8_E4M3, w8_scale(l, k)); }

static int amax_range_order(const void* a, const void* b) {
    size_t x = ((const AmaxRange*)a)->lo, y = ((const AmaxRange*)b)->lo;
    return x < y ? -1 : x > y;
}

/* The inputs of the weights' casts jobs[0..n) as ranges of the parameter vector, sorted (wte, listed
 * last, lies first), onto the device for AdamW's amax (adamw_all). */
static void fp8_list_weight_amax_ranges(const Fp8CastJob<float>* jobs, int n) {
    AmaxRange* r = (AmaxRange*)xcalloc((size_t)n, sizeof *r, "fp8 amax ranges");
    for (int i = 0; i < n; i++) {
        r[i].lo = (size_t)(jobs[i].in - E.params);
        r[i].hi = r[i].lo + (size_t)jobs[i].batch * jobs[i].R * jobs[i].Cc;
        r[i].amax_bits = &jobs[i].sc->amax_bits;
        r[i].keep_low = jobs[i].in == E.params + E.layout.wte && !fp8_cls_bwd(); /* the bf16 backward reads it */
    }
    qsort(r, (size_t)n, sizeof *r, amax_range_order);
    for (int i = 0; i < n; i++)
        if ((i > 0 && r[i].lo < r[i - 1].hi) || r[i].hi > E.P)
            die_io("internal: the fp8 weights' ranges overlap or pass the last parameter");
    CUDA_CHECK(cudaMemcpy(E.w8_amax_ranges, r, (size_t)n * sizeof *r, cudaMemcpyHostToDevice));
    free(r);
}

/* The casts of the fp8 weights from the fp32 masters, listed once (engine_setup): per layer W_Q,
 * W_K, W_V as one cast of 3 blocks [C, C], then W_O [C, C], W_1 [C, F], W_2 [F, C]; with the FP8
 * classifier also wte [Vp, C] (the logits read it as it is, in w8_dx; dx its
 * transpose, in w8_fwd). */
static void fp8_list_weight_casts(void) {
    static const int tensor[FP8_W_PER_LAYER] = {T_WQ, T_WO, T_W1, T_W2};
    int C = E.C, F = E.F, n = 0;
    const int batch[FP8_W_PER_LAYER] = {3, 1, 1, 1}, rows[FP8_W_PER_LAYER] = {C, C, C, F};
    const int cols[FP8_W_PER_LAYER] = {C, C, F, C};
    Fp8CastJob<float>* jobs = (Fp8CastJob<float>*)xcalloc(fp8_weight_cast_count(), sizeof *jobs, "fp8 casts");
    for (int l = 0; l < E.L; l++)
        for (int k = 0; k < FP8_W_PER_LAYER; k++) {
            size_t off = layer_offset(&E.layout, l, tensor[k]);
            Fp8CastJob<float> j = {wf(l, tensor[k]), E.w8_dx + off, E.w8_fwd + off, w8_scale(l, k), batch[k],
                                   rows[k], cols[k], FP8_E4M3, 0};
            jobs[n++] = j;
        }
    if (E.use_fp8_classifier) {
        size_t off = E.layout.wte;
        Fp8CastJob<float> j = {E.params + off, E.w8_dx + off, fp8_cls_bwd() ? E.w8_fwd + off : NULL, cls_w_scale(), 1,
                               E.Vp, C, FP8_E4M3, 0};
        jobs[n++] = j;
    }
    E.w8_jobs = fp8_jobs_upload(jobs, n, E.w8_job_list);
    fp8_list_weight_amax_ranges(jobs, n);
    free(jobs);
}

/* The fp8 weights from the fp32 masters (after every update, like the 16-bit copy): one memset,
 * one amax launch and one cast launch for all of them. */
static void fp8_quantize_weights(void) {
    fp8_zero_scales(w8_scale(0, 0), fp8_weight_cast_count());
    fp8_quantize_jobs(E.w8_jobs);
}

/* The input x [N, in] of layer l's product k, cast once: into E.a8 for the forward product and,
 * when training, transposed into x8t(l, k) for the backward's weight gradient (the same codes at
 * the same scale, x8_scale(l, k)). `input`: what x's producer already did (FP8_IN_*). */
/* What a product's operand holds when the product starts: only the values (the cast takes their
 * amax first), the values with their amax (fused into their producer), or already its codes and
 * scale (delayed scaling's fused producers: the LayerNorm, the GELU and the flash attention
 * forward, E.a8, x8t and x8_scale written; the GELU backward, the LayerNorm backward and the flash
 * attention backward, E.g8, E.g8t and g8_scale). */
enum { FP8_IN_RAW, FP8_IN_AMAX, FP8_IN_CODES };

/* The delayed-scaling history of layer l's tensor `which` (DELAYED_*: cpu/fp8.h) in an fp8
 * training run; NULL (current scaling) otherwise. */
static const Fp8History* fp8_delayed_history(int l, int which) {
    return E.fp8_delayed ? E.fp8_hist + FP8_DELAYED_PER_LAYER * (size_t)l + which : NULL;
}

/* The delayed-scaling history of product k's input in layer l: ln1 (QKV), att (W_O), ln2 (MLP up)
 * or h_gelu (MLP down). */
static const Fp8History* fp8_history_of(int l, int k) {
    return fp8_delayed_history(l, k == FP8_W_QKV ? DELAYED_LN1 : k == FP8_W_O ? DELAYED_ATT
                                  : k == FP8_W_1 ? DELAYED_LN2 : DELAYED_GELU);
}

/* The delayed-scaling history of the residual gradient that is layer l's product k's output
 * gradient (W_2: at the layer's output; W_O: after the attention). */
static const Fp8History* fp8_dres_history(int l, int k) {
    return fp8_delayed_history(l, k == FP8_W_2 ? DELAYED_DRES_W2 : DELAYED_DRES_WO);
}

/* Delayed scaling with histories that hold entries (all but a run's first micro-batch): the
 * producers of the delayed tensors (cpu/fp8.h's DELAYED_*) write their products' codes themselves. */
static bool fp8_producers_write_codes(void) { return E.fp8_delayed && E.fp8_hist_filled; }

/* Where the delayed tensors' amaxes sit (k_fp8_history_push): the casts' scales of their products. */
static Fp8DelayedScales fp8_delayed_scales(void) {
    Fp8DelayedScales w;
    w.scales = E.fp8_scales;
    w.stride = FP8_W_PER_LAYER;
    w.at[DELAYED_LN1] = (int)(x8_scale(0, FP8_W_QKV) - E.fp8_scales);
    w.at[DELAYED_LN2] = (int)(x8_scale(0, FP8_W_1) - E.fp8_scales);
    w.at[DELAYED_GELU] = (int)(x8_scale(0, FP8_W_2) - E.fp8_scales);
    w.at[DELAYED_ATT] = (int)(x8_scale(0, FP8_W_O) - E.fp8_scales);
    w.at[DELAYED_DGELU] = (int)(g8_scale(0, FP8_W_1) - E.fp8_scales);
    w.at[DELAYED_DRES_W2] = (int)(g8_scale(0, FP8_W_2) - E.fp8_scales);
    w.at[DELAYED_DRES_WO] = (int)(g8_scale(0, FP8_W_O) - E.fp8_scales);
    w.at[DELAYED_DQKV] = (int)(g8_scale(0, FP8_W_QKV) - E.fp8_scales);
    return w;
}

template <typename T> static Fp8Mat fp8_act(const T* x, int l, int k, int N, int in, int input) {
    Fp8Scale* sc = x8_scale(l, k);
    if (input == FP8_IN_CODES) return fp8_mat(E.a8, FP8_E4M3, sc);
    if (input == FP8_IN_RAW) fp8_reduce_amax(sc, x, (size_t)N * in);
    fp8_cast(E.a8, E.training ? x8t(l, k) : (fp8*)NULL, sc, x, 1, N, in, FP8_E4M3, fp8_history_of(l, k));
    return fp8_mat(E.a8, FP8_E4M3, sc);
}

/* out = x @ W (+ residual) for weight tensor t (product k) of layer l. */
template <typename T>
static void fp8_linear_fwd(T* out, const T* x, int l, int t, int k, int N, int in, int out_dim, const T* residual,
                           int input) {
    fp8_gemm<T>(FP8_PASS_FORWARD, N, out_dim, in, fp8_act(x, l, k, N, in, input), w8_fwd(l, t, k), out, residual,
                residual ? 1.0f : 0.0f);
}

/* Before a gradient's cast writes E.g8 and E.g8t: the previous product's weight gradient (on the
 * side stream) has read its cast. (Two g8t buffers taken by turns, so that a weight gradient
 * overlapped more, gained nothing: docs/BENCHMARKS.md #79.) */
static void fp8_wait_grad_codes(void) {
    side_wait(E.g8t);
}

/* The backward of a product whose output gradient dout is `batch` blocks [N, out_dim] (QKV: 3):
 * dw (/ += by grad_beta) = x^T dout_i per block (x as the forward cast it, x8t), dx = sum_i dout_i
 * @ W_i^T (one product, K = batch * out_dim, over the side-by-side layouts of cuda/fp8.cuh).
 * `input` (FP8_IN_*): what dout's producer already did: nothing, its amax in g8_scale(l, k), or its
 * codes in E.g8 and E.g8t (then it waited for E.g8t's reader, fp8_wait_grad_codes). `hist`: dout's
 * delayed-scaling history (NULL: current scaling). */
template <typename T>
static void fp8_linear_bwd(T* dx, float* dw, const T* dout, int l, int t, int k, int N, int in, int out_dim,
                           int batch, float grad_beta, int input, const Fp8History* hist = NULL) {
    Fp8Scale *gs = g8_scale(l, k), *xs = x8_scale(l, k);
    if (input == FP8_IN_RAW) fp8_reduce_amax(gs, dout, (size_t)batch * N * out_dim);
    if (input != FP8_IN_CODES) {
        fp8_wait_grad_codes();
        fp8_cast(E.g8, E.g8t, gs, dout, batch, N, out_dim, FP8_GRAD_FMT, hist);
    }
    side_product(E.g8t, [&] {
        fp8_gemm<float>(FP8_PASS_BACKWARD, in, out_dim, N, fp8_mat(x8t(l, k), FP8_E4M3, xs),
                        fp8_mat(E.g8t, FP8_GRAD_FMT, gs, (long long)out_dim * N), dw, NULL, grad_beta, batch,
                        (long long)in * out_dim);
    });
    fp8_gemm<T>(FP8_PASS_INPUT_GRAD, N, in, batch * out_dim, fp8_mat(E.g8, FP8_GRAD_FMT, gs), w8_dx(l, t, k), dx, NULL,
                0.0f);
}

/* The fp8 forward of layer l's sub-layers around attention (the LayerNorms and attention as in
 * forward(), which put the amax of ln1 and ln2 in their casts' scales). */
template <typename T>
static void fp8_qkv_fwd(const LayerActs<T>& a, int l, int N, int input) {
    int C = E.C;
    fp8_gemm<T>(FP8_PASS_FORWARD, N, C, C, fp8_act(a.ln1, l, FP8_W_QKV, N, C, input),
                w8_fwd(l, T_WQ, FP8_W_QKV, (long long)C * C), a.qkv, NULL, 0.0f, 3, (long long)N * C);
}

template <typename T>
static void fp8_mlp_fwd(const LayerActs<T>& a, int l, int N, int input) {
    int C = E.C, F = E.F;
    fp8_linear_fwd<T>(a.h, a.ln2, l, T_W1, FP8_W_1, N, C, F, NULL, input);
    int gelu_input = FP8_IN_AMAX;
    if (fp8_producers_write_codes()) { /* the GELU and its cast in one pass, no h_gelu in T */
        fp8_cast_gelu(E.a8, x8t(l, FP8_W_2), x8_scale(l, FP8_W_2), a.h, N, F, fp8_history_of(l, FP8_W_2));
        gelu_input = FP8_IN_CODES;
    } else {
        gelu_fwd<T, FP8_GELU_TANH>(a.h_gelu, a.h, (size_t)N * F, x8_amax(l, FP8_W_2));
    }
    fp8_linear_fwd<T>(layer_input<T>(l + 1), a.h_gelu, l, T_W2, FP8_W_2, N, F, C, a.xmid, gelu_input);
}

/* dres is what the LayerNorm backward that produced it left (dres_input, FP8_IN_*: its amax or its
 * codes); dh's comes from the GELU backward, which with histories that
 * hold entries writes dh's codes itself, at dh's delayed scale (fp8_cast_dgelu: no dh in T). */
template <typename T>
static void fp8_mlp_bwd(T* dln, const T* dres, int dres_input, const LayerActs<T>& a, int l, int N, float gb) {
    int C = E.C, F = E.F, dh_input = FP8_IN_AMAX;
    const Fp8History* dh_hist = fp8_delayed_history(l, DELAYED_DGELU);
    fp8_linear_bwd<T>((T*)E.dh, gl(l, T_W2), dres, l, T_W2, FP8_W_2, N, F, C, 1, gb, dres_input,
                      fp8_dres_history(l, FP8_W_2));
    if (dh_hist && fp8_producers_write_codes()) {
        fp8_wait_grad_codes();
        fp8_cast_dgelu(E.g8, E.g8t, g8_scale(l, FP8_W_1), (const T*)E.dh, a.h, N, F, FP8_GRAD_FMT, dh_hist);
        dh_input = FP8_IN_CODES;
    } else {
        gelu_bwd_inplace<T, FP8_GELU_TANH>((T*)E.dh, a.h, (size_t)N * F, g8_amax(l, FP8_W_1));
    }
    fp8_linear_bwd<T>(dln, gl(l, T_W1), (const T*)E.dh, l, T_W1, FP8_W_1, N, C, F, 1, gb, dh_input, dh_hist);
}

/* ---------------------------------------------------------------------------------------------- */
/* Forward and backward */

template <typename T> static AttnScratch<T> attn_scratch(void) {
    AttnScratch<T> s;
    s.S = E.att_S;
    s.dP = E.att_dP;
    s.P = (T*)E.att_P;
    s.delta = E.att_delta;
    s.ds = (T*)E.att_ds;
    return s;
}

/* The FP8 classifier's operands for the chunk of n rows from r0, the `chunk`-th (cuda/fp8.cuh). */
static Fp8ClassifierOps fp8_cls_ops(int r0, int chunk) {
    size_t at = (size_t)r0 * E.C, wte = E.layout.wte;
    Fp8ClassifierOps c;
    c.x = fp8_mat(E.a8 + at, FP8_E4M3, cls_x_scale());
    c.wte = fp8_mat(E.w8_dx + wte, FP8_E4M3, cls_w_scale());
    c.x_t = E.lnf8t ? E.lnf8t + at : NULL;
    c.wte_t = E.w8_fwd + wte;
    c.g = E.dl8, c.g_t = E.dl8t;
    c.g_sc = cls_g_scale(chunk);
    c.salt = &E.io->dlogits_salt, c.row0 = r0;
    return c;
}

/* LayerNorm out = LN(x) (gamma, beta: layer l's tensors tg, tb), the input of layer l's product k.
 * In fp8 its amax goes to the product's cast; with delayed scaling and histories that hold entries
 * (all but a run's first micro-batch), the LayerNorm writes the product's codes itself (and no
 * bf16 out: nothing else reads it in fp8). Returns what the product finds (FP8_IN_*). */
template <typename T>
static int ln_fwd_for_product(T* out, float* mean, float* rstd, const T* x, int l, int tg, int tb, int k, int N,
                              bool fp8) {
    if (fp8 && fp8_producers_write_codes() && layernorm_fwd_fp8_fits(N, E.C)) {
        layernorm_fwd_fp8<T>(E.a8, x8t(l, k), x8_scale(l, k), fp8_history_of(l, k), mean, rstd, x, wf(l, tg),
                             wf(l, tb), N, E.C);
        return FP8_IN_CODES;
    }
    layernorm_fwd<T>(out, mean, rstd, x, wf(l, tg), wf(l, tb), N, E.C, fp8 ? x8_amax(l, k) : NULL);
    return FP8_IN_AMAX;
}

/* Layer l's attention forward: out (a.atty) and lse from a.qkv. In fp8, out is W_O's input: its amax
 * goes to that product's cast (where the flash path fuses it); with histories that hold entries, the flash forward also writes the product's codes (E.a8, x8t) where
 * attn_fwd_fp8_fits, else the product casts at the delayed scale. out in T is written either way:
 * the backward's delta reads it. Returns what the product finds (FP8_IN_*). */
template <typename T>
static int attn_fwd_for_product(const LayerActs<T>& a, int l, int B, int Tn, bool fp8) {
    int C = E.C, H = E.H;
    size_t nc = (size_t)B * Tn * C;
    const Fp8History* hist = fp8 ? fp8_history_of(l, FP8_W_O) : NULL;
    if (hist && fp8_producers_write_codes() && attn_fwd_fp8_fits<T>(C, H)) {
        attn_fwd_fp8<T>(E.a8, x8t(l, FP8_W_O), x8_scale(l, FP8_W_O), hist, a.atty, a.att_lse, a.qkv, a.qkv + nc,
                        a.qkv + 2 * nc, B, Tn, C, H);
        return FP8_IN_CODES;
    }
    /* precision fp8: the flash kernels take the amax of atty, W_O's input (cuBLAS path: the cast) */
    bool amax = attn_fwd<T>(a.atty, a.att_lse, a.qkv, a.qkv + nc, a.qkv + 2 * nc, B, Tn, C, H, attn_scratch<T>(),
                            fp8 ? x8_amax(l, FP8_W_O) : NULL);
    return amax ? FP8_IN_AMAX : FP8_IN_RAW;
}

/* Forward of B sequences of Tn positions (tokens already on the device) up to LNf's output; `fp8`:
 * the linear products in FP8 (precision fp8's training and validation forward). Generation's
 * prefill runs without: its decode steps multiply in bf16 (cuda/decode.cuh), and per-tensor scales
 * of a decode step's few rows could not match the prompt's, so the whole of generation runs on the
 * bf16 weights and the prefill's keys and values are the decode's. */
template <typename T>
static void forward(int B, int Tn, bool fp8, bool training) {
    int C = E.C, F = E.F, L = E.L, N = B * Tn, l;
    /* every amax of the activations' and gradients' casts that this micro-batch takes starts at 0 */
    if (fp8) /* the FP8 classifier's too: LNf's output's and the dlogits' (cls_x_scale, cls_g_scale) */
        fp8_zero_scales(x8_scale(0, 0), 2 * (size_t)FP8_W_PER_LAYER * L + fp8_cls_act_scale_count());
    embed_fwd<T>((T*)E.res, E.tok, E.params + E.layout.wte, E.params + E.layout.wpe, B, Tn, C);
    /* training: the embedding backward's sort needs only the tokens, so it runs beside the first
     * layer rather than on the step's one chain at the end of the backward (docs/DESIGN.md §9);
     * forked behind a kernel, so the graph's first node still leads straight into the forward */
    if (training) ahead_run([] { embed_bwd_sort(E.embed_scratch, E.tok, E.V, E.N, E.C); });
    for (l = 0; l < L; l++) {
        LayerActs<T> a = layer_acts<T>(l);
        int in1 = ln_fwd_for_product<T>(a.ln1, a.ln1_mean, a.ln1_rstd, a.x, l, T_LN1_GAMMA, T_LN1_BETA, FP8_W_QKV, N,
                                        fp8);
        if (fp8) fp8_qkv_fwd<T>(a, l, N, in1);
        else attn_qkv_fwd<T>(a.qkv, a.ln1, wl<T>(l, T_WQ), N, C);
        int in_o = attn_fwd_for_product<T>(a, l, B, Tn, fp8);
        if (fp8) fp8_linear_fwd<T>(a.xmid, a.atty, l, T_WO, FP8_W_O, N, C, C, a.x, in_o);
        else attn_out_fwd<T>(a.xmid, a.atty, wl<T>(l, T_WO), a.x, N, C); /* xmid = x + attn(...) W_O */
        int in2 = ln_fwd_for_product<T>(a.ln2, a.ln2_mean, a.ln2_rstd, a.xmid, l, T_LN2_GAMMA, T_LN2_BETA, FP8_W_1,
                                        N, fp8);
        if (fp8) fp8_mlp_fwd<T>(a, l, N, in2);
        else mlp_fwd<T>(layer_input<T>(l + 1), a.h, a.h_gelu, a.ln2, wl<T>(l, T_W1), wl<T>(l, T_W2), a.xmid, N, C, F);
    }
    layernorm_fwd<T>((T*)E.lnf, E.lnf_mean, E.lnf_rstd, layer_input<T>(L), E.params + E.layout.lnf_gamma,
                     E.params + E.layout.lnf_beta, N, C, fp8_classifier(fp8) ? &cls_x_scale()->amax_bits : NULL);
    if (fp8_classifier(fp8)) /* LNf's output cast once a forward for the FP8 classifier's logits chunks */
        fp8_cast_classifier_input<T>(E.a8, E.training && fp8_cls_bwd() ? E.lnf8t : NULL, cls_x_scale(),
                                     (const T*)E.lnf, N, C, E.chunk);
}

/* LayerNorm backward: dres += the gradient through LN(x) of its output's gradient dout, dgamma and
 * dbeta by grad_beta. In fp8, dres is then the output gradient of layer l's product k (W_2 of the
 * layer below, or W_O; l < 0: no product, the embedding's): its amax goes to that product's cast;
 * with histories that hold entries, the LayerNorm backward writes the
 * product's codes itself (E.g8, E.g8t, after their side-stream reader: fp8_wait_grad_codes).
 * Returns what the product finds (FP8_IN_*). */
template <typename T>
static int ln_bwd_for_product(T* dres, float* dgamma, float* dbeta, const T* dout, const T* x, const float* gamma,
                              const float* mean, const float* rstd, int l, int k) {
    int N = E.N, C = E.C;
    const Fp8History* hist = l >= 0 ? fp8_dres_history(l, k) : NULL;
    if (hist && fp8_producers_write_codes() && layernorm_bwd_fp8_fits(dres, dout, x, gamma, N, C)) {
        fp8_wait_grad_codes();
        layernorm_bwd_fp8<T>(E.g8, E.g8t, g8_scale(l, k), hist, FP8_GRAD_FMT, dres, dgamma, dbeta, dout, x, gamma,
                             mean, rstd, N, C, E.ln_partial, E.grad_beta);
        return FP8_IN_CODES;
    }
    layernorm_bwd<T>(dres, dgamma, dbeta, dout, x, gamma, mean, rstd, N, C, E.ln_partial, E.grad_beta,
                     l >= 0 ? g8_amax(l, k) : NULL);
    return FP8_IN_AMAX;
}

/* Attention backward of layer l: dq, dk, dv (E.dqkv) from the gradient of its output, E.datty. In
 * fp8, dqkv is the QKV product's output gradient: its amax goes to that product's cast (where the
 * flash path fuses it); with histories that hold entries, the flash backward
 * writes the product's codes instead of dqkv (E.g8, E.g8t, after their side-stream reader:
 * fp8_wait_grad_codes) where attn_bwd_fp8_fits, else the product casts at the delayed scale.
 * Returns what the product finds (FP8_IN_*). */
template <typename T>
static int attn_bwd_for_product(const LayerActs<T>& a, int l) {
    int B = E.B, Tn = E.T, C = E.C, H = E.H;
    size_t nc = (size_t)E.N * C;
    T* dqkv = (T*)E.dqkv;
    const Fp8History* hist = fp8_delayed_history(l, DELAYED_DQKV);
    if (hist && fp8_producers_write_codes() && attn_bwd_fp8_fits<T>(C, H)) {
        fp8_wait_grad_codes();
        attn_bwd_fp8<T>(E.g8, E.g8t, g8_scale(l, FP8_W_QKV), hist, FP8_GRAD_FMT, (const T*)E.datty, a.atty,
                        a.att_lse, a.qkv, a.qkv + nc, a.qkv + 2 * nc, B, Tn, C, H, attn_scratch<T>());
        return FP8_IN_CODES;
    }
    /* precision fp8: dq, dk, dv's amax as attn_fwd's (one tensor to the QKV backward's cast) */
    bool amax = attn_bwd<T>(dqkv, dqkv + nc, dqkv + 2 * nc, (T*)E.datty, a.atty, a.att_lse, a.qkv, a.qkv + nc,
                            a.qkv + 2 * nc, B, Tn, C, H, attn_scratch<T>(), g8_amax(l, FP8_W_QKV));
    return amax ? FP8_IN_AMAX : FP8_IN_RAW;
}

/* Loss over the N positions, chunk by chunk, and its mean into io->loss; with `train`, also the
 * classifier backward (weighted by io->dscale), which writes the gradient of LNf's output into dln
 * and adds into dwte. With the FP8 classifier (config_fp8_classifier) in an fp8 forward, the
 * classifier's products are FP8 (cuda/fp8.cuh's loss_fwd_fp8, loss_fwd_bwd_fp8), as the forward
 * cast LNf's output for them: all three (fp8_cls_bwd) or the logits' alone (loss_fwd_fp8_bwd). */
template <typename T>
static void loss_chunks(int N, int train) {
    int C = E.C, r0;
    const T* wte = (const T*)E.wlow + E.layout.wte;
    const int* targets = E.tok + E.N;
    bool fp8 = fp8_classifier(E.use_fp8), fp8_bwd = fp8 && fp8_cls_bwd();
    for (r0 = 0; r0 < N; r0 += E.chunk) {
        int n = N - r0 < E.chunk ? N - r0 : E.chunk;
        const T* x = (const T*)E.lnf + (size_t)r0 * C;
        T* dx = (T*)E.dln + (size_t)r0 * C;
        float gb = r0 == 0 ? E.grad_beta : 1.0f; /* the first chunk honours the micro-batch's, the later ones add */
        side_wait(fp8_bwd ? (const void*)E.dl8t : E.logits); /* the previous chunk's dwte has read its dlogits */
        if (fp8_bwd && train)
            loss_fwd_bwd_fp8<T>(E.losses + r0, E.loss_lse + r0, dx, E.grads + E.layout.wte, (T*)E.logits,
                                fp8_cls_ops(r0, r0 / E.chunk), targets + r0, n, C, E.V, E.Vp, &E.io->dscale, gb);
        else if (fp8 && train)
            loss_fwd_fp8_bwd<T>(E.losses + r0, E.loss_lse + r0, dx, E.grads + E.layout.wte, (T*)E.logits,
                                fp8_cls_ops(r0, r0 / E.chunk), x, wte, targets + r0, n, C, E.V, E.Vp, &E.io->dscale,
                                gb);
        else if (fp8)
            loss_fwd_fp8<T>(E.losses + r0, E.loss_lse + r0, (T*)E.logits, fp8_cls_ops(r0, r0 / E.chunk), targets + r0,
                            n, C, E.V, E.Vp);
        else if (train)
            loss_fwd_bwd<T>(E.losses + r0, E.loss_lse + r0, dx, E.grads + E.layout.wte, (T*)E.logits, x, wte,
                            targets + r0, n, C, E.V, E.Vp, &E.io->dscale, gb, E.loss_part);
        else
            loss_fwd<T>(E.losses + r0, E.loss_lse + r0, (T*)E.logits, x, wte, targets + r0, n, C, E.V, E.Vp);
    }
    loss_mean(&E.io->loss, E.losses, N);
}

/* The backward's two streams (use_side_stream, cuda/side_stream.cuh; without a side stream the
 * waits below are no-ops). Every weight-gradient product runs on the side stream, forked after the
 * work that produced its inputs; what it reads, who overwrites that later on the main stream, and
 * the wait that orders the two (rows dW_*: the products of every precision but fp8, which read
 * their casts instead):
 *
 *   side-stream product   reads (besides saved forward values     overwritten next by          wait before it
 *                          and casts, which the backward never
 *                          writes)
 *   dwte (classifier)     logits (the chunk's dlogits)            the next chunk's logits      side_wait(E.logits)
 *   FP8 classifier: dwte  dl8t (the chunk's dlogits' codes)       the next chunk's codes       side_wait(E.dl8t)
 *   dW_2                  dres                                    LN2 backward (dres +=)       side_wait(dres)
 *   dW_1                  dh                                      the layer below's dh         side_wait(E.dh)
 *   dW_O                  dres                                    LN1 backward (dres +=)       side_wait(dres)
 *   dW_QKV                dqkv                                    the layer below's attn_bwd   side_wait(dqkv)
 *   fp8: every dW         g8t (the output gradient's cast)        the next product's cast      fp8_wait_grad_codes
 *                                                                 (fp8_linear_bwd; fp8_cast_dgelu;  (side_wait(E.g8t))
 *                                                                 the LN2 and LN1 backwards,
 *                                                                 layernorm_bwd_fp8; attn_bwd_fp8)
 *   a LayerNorm's final   ln_partial (the chunk partials)         the next LayerNorm backward  side_wait(ln_partial)
 *   sums (behind the next                                                                      (layernorm_bwd_
 *   weight gradient)                                                                           scratch_free)
 * The side stream runs its products in issue order, so a wait covers its earlier products too.
 * Each gradient tensor has one writer per micro-batch (matmul.cuh), the side stream's products
 * write only their own, and the one tensor two writers share, wte (dwte, then the embedding
 * backward adds), is ordered by side_join before embed_bwd_sorted, which also ends the backward with every
 * product done (the gradient norm and AdamW run after it; a capture ends with the streams joined).
 * dln, datty and the attention scratch have no side-stream reader. An fp8 weight gradient also reads
 * its two casts' scales (Fp8Scale: x8_scale, set by the forward's cast; g8_scale, set by its own
 * cast, issued before the fork); nothing writes them again before the next forward. Waits sit just before the
 * overwrite, so a product overlaps everything in between; in bf16, dW_1 runs beside the LN2 backward,
 * W_O's input gradient and attention's backward; dW_O beside attention's backward and the QKV
 * input gradient; dW_QKV beside the LN1 backward and the layer below's MLP. In fp8 the single g8t
 * lets a weight gradient overlap only its own input-gradient product: the next product's producer
 * (its cast, or the GELU, LayerNorm or attention backward that writes its codes) waits for it. */
template <typename T>
static void backward(void) {
    int B = E.B, Tn = E.T, C = E.C, F = E.F, L = E.L, N = E.N, l;
    size_t nc = (size_t)N * C, es = E.es;
    float gb = E.grad_beta;
    T* dres = (T*)E.dres;
    T* dln = (T*)E.dln;
    T* dqkv = (T*)E.dqkv;
    /* dln holds d(LNf output) from loss_chunks */
    CUDA_CHECK(cudaMemsetAsync(dres, 0, nc * es, g_stream));
    /* precision fp8: each LayerNorm backward's dres is the next product's output gradient (W_2 of the
     * layer below, W_O of its own): ln_bwd_for_product */
    int dres_in = ln_bwd_for_product<T>(dres, E.grads + E.layout.lnf_gamma, E.grads + E.layout.lnf_beta, dln,
                                        layer_input<T>(L), E.params + E.layout.lnf_gamma, E.lnf_mean, E.lnf_rstd,
                                        L - 1, FP8_W_2);
    for (l = L - 1; l >= 0; l--) {
        LayerActs<T> a = layer_acts<T>(l);
        /* MLP branch: its output gradient is the stream's, dres */
        side_wait(E.dh);
        if (E.use_fp8)
            fp8_mlp_bwd<T>(dln, dres, dres_in, a, l, N, gb);
        else
            mlp_bwd<T>(dln, gl(l, T_W1), gl(l, T_W2), dres, a.ln2, a.h, a.h_gelu, wl<T>(l, T_W1), wl<T>(l, T_W2),
                       (T*)E.dh, N, C, F, gb);
        side_wait(dres);
        dres_in = ln_bwd_for_product<T>(dres, gl(l, T_LN2_GAMMA), gl(l, T_LN2_BETA), dln, a.xmid, wf(l, T_LN2_GAMMA),
                                        a.ln2_mean, a.ln2_rstd, l, FP8_W_O);
        /* attention branch: dres is now the gradient at xmid */
        if (E.use_fp8)
            fp8_linear_bwd<T>((T*)E.datty, gl(l, T_WO), dres, l, T_WO, FP8_W_O, N, C, C, 1, gb, dres_in,
                              fp8_dres_history(l, FP8_W_O));
        else attn_out_bwd<T>((T*)E.datty, gl(l, T_WO), dres, a.atty, wl<T>(l, T_WO), N, C, gb);
        side_wait(dqkv);
        int dqkv_in = attn_bwd_for_product<T>(a, l);
        if (E.use_fp8)
            fp8_linear_bwd<T>(dln, gl(l, T_WQ), dqkv, l, T_WQ, FP8_W_QKV, N, C, C, 3, gb, dqkv_in,
                              fp8_delayed_history(l, DELAYED_DQKV));
        else attn_qkv_bwd<T>(dln, gl(l, T_WQ), dqkv, a.ln1, wl<T>(l, T_WQ), N, C, gb);
        side_wait(dres);
        dres_in = ln_bwd_for_product<T>(dres, gl(l, T_LN1_GAMMA), gl(l, T_LN1_BETA), dln, a.x, wf(l, T_LN1_GAMMA),
                                        a.ln1_mean, a.ln1_rstd, l - 1, FP8_W_2);
    }
    side_join();
    ahead_join(); /* the tokens' sort, forked by forward() after the embedding */
    embed_bwd_sorted<T>(E.grads + E.layout.wte, E.grads + E.layout.wpe, dres, E.embed_scratch, B, Tn, C, gb);
}

/* Runs `record` (the device work of one call, everything on g_stream) as a CUDA graph: captured
 * and instantiated the first time (by the warm-up), replayed after; or, with graphs off, launch by
 * launch. With `wait`, returns when the work is done; else once it is queued. */
static void run_graph(cudaGraphExec_t* exec, void (*record)(void), bool wait = true) {
    if (!E.use_graphs) {
        record();
    } else {
        if (!*exec) {
            cudaGraph_t graph;
            CUDA_CHECK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
            record();
            CUDA_CHECK(cudaStreamEndCapture(g_stream, &graph));
            CUDA_CHECK(cudaGraphInstantiate(exec, graph, 0));
            CUDA_CHECK(cudaGraphDestroy(graph));
        }
        CUDA_CHECK(cudaGraphLaunch(*exec, g_stream));
    }
    if (wait) CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

/* A training micro-batch is queued and not waited for (engine_forward_backward), so that the
 * update's graph follows it on the GPU without a round trip to the host between the two. Whatever
 * next writes the pinned staging buffers the micro-batch's graph reads (its tokens, its StepIO
 * fields), or reads the loss it hands back, waits for it first: micro_batch_settle. The update's
 * own field (uctl) is one the micro-batch's graph does not upload (upload_step_io). */
static void micro_batch_done(void) { /* after a wait that covered the queued micro-batch */
    if (!E.micro_batch_queued) return;
    E.micro_loss = E.io_host->loss; /* before a validation forward downloads its own loss there */
    E.micro_batch_queued = 0;
}

static void micro_batch_settle(void) {
    if (E.micro_batch_queued) CUDA_CHECK(cudaStreamSynchronize(g_stream));
    micro_batch_done();
}

/* The N inputs and N targets of a batch into the pinned staging buffer (the graphs upload it). */
static void stage_batch(const int* inputs, const int* targets) {
    memcpy(E.tok_host, inputs, (size_t)E.N * sizeof(int));
    memcpy(E.tok_host + E.N, targets, (size_t)E.N * sizeof(int));
}

/* The StepIO inputs of a forward (`update` 0: dscale and dlogits_salt) or of the update (1: uctl),
 * from the pinned host copy: disjoint bytes, so the update's graph can be queued while a
 * micro-batch's upload is still pending. */
static void upload_step_io(int update) {
    size_t from = update ? 0 : offsetof(StepIO, dscale), to = update ? offsetof(StepIO, dscale) : STEPIO_IN_BYTES;
    copy_words((char*)E.io + from, (char*)E.io_host + from, to - from);
}

/* A forward's inputs: its first tok_count staged tokens and its StepIO fields. Uploads and
 * downloads are kernels reading and writing the pinned buffers (common.cuh's copy_words). */
static void upload_inputs(size_t tok_count) {
    copy_words(E.tok, E.tok_host, tok_count * sizeof(int));
    upload_step_io(0);
}

static void download_output(const float* dev, float* host) { copy_words(host, dev, sizeof(float)); }

/* One training micro-batch, as recorded into fb_graph[grad_beta]. */
template <typename T>
static void record_forward_backward(void) {
    upload_inputs(2 * (size_t)E.N);
    forward<T>(E.B, E.T, E.use_fp8, true);
    loss_chunks<T>(E.N, 1);
    backward<T>();
    /* every delayed tensor's history extended by this micro-batch's amax, the forward's (ln1, ln2,
     * h_gelu, att) and the backward's (dh, W_2's and W_O's output gradients, dqkv), by one launch
     * after the backward rather than a launch of the forward's four a layer between LNf and the
     * classifier, on the step's one chain (docs/BENCHMARKS.md #89): only the forward's producers
     * read the forward histories (validation and the next micro-batch come after this push), and
     * nothing in the backward writes the amaxes pushed (the forward casts' x8_scale, which the next
     * forward zeroes), so the entries are the same */
    if (E.fp8_delayed) fp8_history_push_all(E.fp8_hist, fp8_delayed_scales(), E.L);
    download_output(&E.io->loss, &E.io_host->loss);
}

template <typename T>
static void forward_backward_t(const int* inputs, const int* targets) {
    micro_batch_settle();
    stage_batch(inputs, targets);
    E.io_host->dscale = (E.prec == PREC_FP16 ? E.loss_scale : 1.0f) / (float)E.N;
    if (fp8_cls_bwd()) E.io_host->dlogits_salt = fp8_dlogits_salt(targets, E.N);
    E.grad_beta = E.grads_pending ? 1.0f : 0.0f;
    if (E.fp8_delayed && !E.fp8_hist_filled) { /* empty histories: current scaling, not the graphs' fused path */
        int graphs = E.use_graphs;
        E.use_graphs = 0;
        run_graph(&E.fb_graph[E.grads_pending], record_forward_backward<T>, false);
        E.use_graphs = graphs;
        E.fp8_hist_filled = 1;
    } else {
        run_graph(&E.fb_graph[E.grads_pending], record_forward_backward<T>, false);
    }
    E.grads_pending = 1;
    E.micro_batch_queued = 1;
}

/* Validation runs uncaptured: it is rare, and its launches are few next to its work. */
template <typename T>
static float forward_loss_t(const int* inputs, const int* targets) {
    micro_batch_settle();
    stage_batch(inputs, targets);
    upload_inputs(2 * (size_t)E.N);
    forward<T>(E.B, E.T, E.use_fp8, false);
    loss_chunks<T>(E.N, 0);
    download_output(&E.io->loss, &E.io_host->loss);
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    return E.io_host->loss;
}

/* Layer l's cache rows of `slot` (keys or values). */
template <typename T> static T* kv_slot(void* cache, int l, int slot) {
    return (T*)cache + (((size_t)l * E.slots + slot) * E.T) * E.C;
}

/* Before generation reads the 16-bit copy of the weights: the copy from the masters if an update
 * left the fp8 weights' part of it behind (adamw_all). The same values AdamW would have stored. */
template <typename T>
static void refresh_stale_lowp_weights(void) {
    if constexpr (sizeof(T) == 2)
        if (E.lowp_stale) convert<T>((T*)E.wlow, E.params, E.P);
    E.lowp_stale = 0;
}

/* The prompt is padded with token 0 to the full T and run at the one shape (1, T) of the training
 * forward: attention is causal, so positions < len see exactly what they would without the
 * padding, and every call runs the same kernels (all of them loaded by the warm-up). Then the
 * keys and values of positions < len go to the slot, and the logits of position len-1 out. */
template <typename T>
static void prefill_t(int slot, const int* tokens, int len, float* logits) {
    micro_batch_settle();
    refresh_stale_lowp_weights<T>();
    size_t nc = (size_t)E.T * E.C; /* the forward's N = T rows */
    memcpy(E.tok_host, tokens, (size_t)len * sizeof(int));
    memset(E.tok_host + len, 0, (size_t)(E.T - len) * sizeof(int));
    upload_inputs((size_t)E.T);
    forward<T>(1, E.T, false, false);
    for (int l = 0; l < E.L; l++) {
        const T* qkv = layer_acts<T>(l).qkv;
        size_t bytes = (size_t)len * E.C * sizeof(T);
        CUDA_CHECK(cudaMemcpyAsync(kv_slot<T>(E.kcache, l, slot), qkv + nc, bytes, cudaMemcpyDeviceToDevice, g_stream));
        CUDA_CHECK(cudaMemcpyAsync(kv_slot<T>(E.vcache, l, slot), qkv + 2 * nc, bytes, cudaMemcpyDeviceToDevice,
                                   g_stream));
    }
    classifier_logits<T, float>((float*)E.logits, (const T*)E.lnf + (size_t)(len - 1) * E.C,
                                (const T*)E.wlow + E.layout.wte, 1, E.C, E.Vp);
    CUDA_CHECK(cudaMemcpyAsync(logits, E.logits, (size_t)E.V * sizeof(float), cudaMemcpyDeviceToHost, g_stream));
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

/* One decode step of E.decode_n sequences, as recorded into decode_graph[n-1]: their slots, tokens
 * and positions up, the model (cuda/decode.cuh), their logits down. */
template <typename T>
static void record_decode(void) {
    int n = E.decode_n, C = E.C, F = E.F, S = E.slots, l;
    const int *slots = E.dec_io, *tokens = E.dec_io + S, *positions = E.dec_io + 2 * S;
    T *x = (T*)E.dec_x, *res1 = (T*)E.dec_res1, *ln = (T*)E.dec_ln, *qkv = (T*)E.dec_qkv, *atty = (T*)E.dec_atty;
    CUDA_CHECK(cudaMemcpyAsync(E.dec_io, E.dec_io_host, 3 * (size_t)S * sizeof(int), cudaMemcpyHostToDevice, g_stream));
    decode_embed<T>(x, tokens, positions, E.params + E.layout.wte, E.params + E.layout.wpe, n, C);
    for (l = 0; l < E.L; l++) {
        layernorm_fwd<T>(ln, E.dec_mean, E.dec_rstd, x, wf(l, T_LN1_GAMMA), wf(l, T_LN1_BETA), n, C);
        decode_matmul<T>(qkv, ln, wl<T>(l, T_WQ), NULL, n, C, C, DECODE_PLAIN, 3); /* W_Q, W_K, W_V consecutive */
        decode_kv_append<T>(kv_slot<T>(E.kcache, l, 0), kv_slot<T>(E.vcache, l, 0), qkv + (size_t)n * C,
                              qkv + 2 * (size_t)n * C, slots, positions, n, E.T, C);
        decode_attention<T>(atty, E.dec_scores, qkv, kv_slot<T>(E.kcache, l, 0), kv_slot<T>(E.vcache, l, 0), slots,
                              positions, n, E.T, C, E.H);
        decode_matmul<T>(res1, atty, wl<T>(l, T_WO), x, n, C, C, DECODE_RESIDUAL);
        layernorm_fwd<T>(ln, E.dec_mean, E.dec_rstd, res1, wf(l, T_LN2_GAMMA), wf(l, T_LN2_BETA), n, C);
        decode_matmul<T>((T*)E.dec_fc, ln, wl<T>(l, T_W1), NULL, n, C, F, DECODE_GELU);
        decode_matmul<T>(x, (const T*)E.dec_fc, wl<T>(l, T_W2), res1, n, F, C, DECODE_RESIDUAL);
    }
    layernorm_fwd<T>(ln, E.dec_mean, E.dec_rstd, x, E.params + E.layout.lnf_gamma, E.params + E.layout.lnf_beta, n,
                       C);
    decode_logits<T>(E.dec_logits, ln, (const T*)E.wlow + E.layout.wte, n, C, E.V);
    CUDA_CHECK(cudaMemcpyAsync(E.dec_logits_host, E.dec_logits, (size_t)n * E.V * sizeof(float),
                               cudaMemcpyDeviceToHost, g_stream));
}

template <typename T>
static void decode_t(int n, const int* slots, const int* tokens, const int* positions, float* logits) {
    refresh_stale_lowp_weights<T>();
    memcpy(E.dec_io_host, slots, (size_t)n * sizeof(int));
    memcpy(E.dec_io_host + E.slots, tokens, (size_t)n * sizeof(int));
    memcpy(E.dec_io_host + 2 * E.slots, positions, (size_t)n * sizeof(int));
    E.decode_n = n;
    /* before the first capture of this n, one run launch by launch: no kernel is then loaded for the
     * first time inside a capture (warm_up's rule). It writes the same cache rows the replay does. */
    if (E.use_graphs && !E.decode_graph[n - 1]) record_decode<T>();
    run_graph(&E.decode_graph[n - 1], record_decode<T>);
    memcpy(logits, E.dec_logits_host, (size_t)n * E.V * sizeof(float));
}

/* ---------------------------------------------------------------------------------------------- */
/* Update */

/* AdamW over every parameter in one launch; which decay, the mask says (upload_decay_bits). In
 * fp8 the same launch also takes the fp8 weights' amax (E.w8_amax_ranges: one read of the masters
 * fewer, docs/BENCHMARKS.md #91) and leaves their 16-bit copy, which only generation reads in fp8
 * training (docs/DESIGN.md §18), to refresh_stale_lowp_weights (docs/BENCHMARKS.md #92). */
template <typename T>
static void adamw_all(const Config* cfg) {
    T* p_low = E.prec == PREC_FP32 ? (T*)NULL : (T*)E.wlow;
    if (E.use_fp8) {
        adamw_amax<T>(E.params, E.grads, E.m, E.v, p_low, E.P, cfg->train.beta1, cfg->train.beta2, cfg->train.eps,
                      cfg->train.weight_decay, E.decay_bits, &E.io->uctl, &E.io->norm, E.w8_amax_ranges,
                      (int)fp8_weight_cast_count(), 1);
        return;
    }
    adamw<T>(E.params, E.grads, E.m, E.v, p_low, E.P, cfg->train.beta1, cfg->train.beta2, cfg->train.eps,
             cfg->train.weight_decay, E.decay_bits, &E.io->uctl, &E.io->norm);
}

/* The weight-decay mask of the layout's tensors (their decay flags), onto the device once. */
static void upload_decay_bits(void) {
    size_t words = adamw_decay_words(E.P);
    unsigned* bits = (unsigned*)xcalloc(words, sizeof(unsigned), "decay mask");
    for (int t = 0; t < E.layout.n_tensors; t++) {
        const ParamTensor* pt = &E.layout.tensors[t];
        size_t i = pt->offset, end = pt->offset + pt->size;
        if (!pt->decay) continue;
        for (; i < end && i % 32; i++) bits[i / 32] |= 1u << (i % 32); /* up to a word boundary */
        for (; i + 32 <= end; i += 32) bits[i / 32] = ~0u;             /* whole words */
        for (; i < end; i++) bits[i / 32] |= 1u << (i % 32);
    }
    CUDA_CHECK(cudaMemcpy(E.decay_bits, bits, words * sizeof(unsigned), cudaMemcpyHostToDevice));
    free(bits);
}

/* The 16-bit copy of the weights the products read, from the fp32 masters (fp32 has no copy). */
template <typename T>
static void refresh_lowp_weights_t(void) {
    if constexpr (sizeof(T) == 2) convert<T>((T*)E.wlow, E.params, E.P);
    if (E.use_fp8) fp8_quantize_weights();
    E.lowp_stale = 0;
}

/* The update, as recorded into update_graph: the norm of the unscaled gradients, AdamW (which
 * clips, and skips on a non-finite norm in fp16, by itself), the norm back. The gradients are not
 * zeroed: the next micro-batch overwrites them (fb_graph[0]). In fp8, AdamW
 * takes the weights' amax (their scales zeroed before it) and only their cast follows. */
template <typename T>
static void record_update(void) {
    upload_step_io(1);
    grad_norm_partial(E.norm_partial, E.grads, E.P, &E.io->uctl.unscale);
    grad_norm_final(&E.io->norm, E.norm_partial);
    if (E.use_fp8) fp8_zero_scales(w8_scale(0, 0), fp8_weight_cast_count()); /* AdamW takes their amax */
    adamw_all<T>(&E.cfg);
    if (E.use_fp8) fp8_cast_jobs(E.w8_jobs);
    download_output(&E.io->norm, &E.io_host->norm);
}

/* The update with WORLD_SIZE > 1 (ZeRO-1, docs/DESIGN.md §17), launch by launch (NCCL stays out of
 * the graphs): reduce-scatter the gradients; the norm of this rank's part, the parts' squares added
 * by rank 0 in rank order over host/dist.h (a fixed order); AdamW on the part (the kernel clips and
 * skips as in record_update); all-gather the weights; the 16-bit copy from them. */
template <typename T>
static void update_sharded(void) {
    size_t lo = E.shard.lo, n = E.shard.hi - E.shard.lo;
    double square;
    micro_batch_settle(); /* the collectives' progress timeout (dist.cuh) must not time the micro-batch */
    upload_step_io(1);
    dist_reduce_scatter_grads(E.grads, E.shard_stride);
    grad_norm_partial(E.norm_partial, E.grads + lo, n, &E.io->uctl.unscale);
    grad_norm_final(&E.io->norm, E.norm_partial);
    download_output(&E.io->norm, &E.io_host->norm);
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    square = (double)E.io_host->norm * (double)E.io_host->norm;
    E.io_host->norm = (float)sqrt(dist_sum_in_rank_order(&square, 1));
    CUDA_CHECK(cudaMemcpyAsync(&E.io->norm, &E.io_host->norm, sizeof(float), cudaMemcpyHostToDevice, g_stream));
    if (n > 0)
        adamw<T>(E.params + lo, E.grads + lo, E.m, E.v, (T*)NULL, n, E.cfg.train.beta1, E.cfg.train.beta2,
                 E.cfg.train.eps, E.cfg.train.weight_decay, E.decay_bits + lo / 32, &E.io->uctl, &E.io->norm);
    dist_all_gather_params(E.params, E.shard_stride);
    refresh_lowp_weights_t<T>();
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

/* Runs every code path once on a dummy batch (all-zero weights and tokens), then clears what it
 * touched. The CUDA driver loads kernels (ours and cuBLAS's) lazily, on first use, and that takes
 * device memory, as does instantiating and first launching a graph; after this, the first training
 * step already sees the memory every later step sees, so device_memory at the first and the last
 * step agree. The first round runs uncaptured, so that nothing is loaded for the first time inside
 * a capture; the second captures the graphs and replays them once. engine_set_state overwrites
 * the weights and moments the lr-0 updates went through. */
static void warm_up(void) {
    int* zeros = (int*)xcalloc((size_t)E.N, sizeof(int), "warm-up tokens");
    float* logits = (float*)xmalloc((size_t)E.V * sizeof(float), "warm-up logits");
    int graphs = E.use_graphs, round;
    FOR_ACT_TYPE(refresh_lowp_weights_t)();
    for (round = 0; round < 2; round++) { /* two micro-batches: both fb_graph variants */
        E.use_graphs = round == 0 ? 0 : graphs;
        engine_forward_backward(zeros, zeros);
        engine_forward_backward(zeros, zeros);
        engine_update(0.0f, 1, &E.cfg);
    }
    engine_forward_loss(zeros, zeros);
    if (E.fp8_delayed) { /* the warm-up's forwards recorded amaxes: a run starts with empty histories */
        CUDA_CHECK(cudaMemset(E.fp8_hist, 0, engine_fp8_history_count() * sizeof(Fp8History)));
        E.fp8_hist_filled = 0;
    }
    if (E.slots > 0) { /* the training samples: a prefill and the decode graph of one sequence */
        int slot = 0, pos = 0;
        engine_prefill(slot, zeros, 1, logits);
        engine_decode(1, &slot, zeros, &pos, logits);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    free(zeros);
    free(logits);
}

/* ---------------------------------------------------------------------------------------------- */
/* engine.h */

static size_t engine_setup(const Config* cfg) {
    const char* prec = cfg->train.precision;
    size_t used[N_GROUPS], total = 0, free_b = 0, total_b = 0;
    int g, n_dev = 0;
    memset(&E, 0, sizeof E);
    E.cfg = *cfg;
    /* fp8: the FP8 products, everything else as bf16; generation multiplies in bf16 alone (docs/DESIGN.md
     * §18), so it is the bf16 engine and needs no FP8 tensor cores (a checkpoint trained in fp8 chats
     * on any GPU) */
    E.use_fp8 = strcmp(prec, "fp8") == 0 && !cfg->generate.enabled;
    E.fp8_delayed = config_keeps_fp8_histories(cfg);
    E.use_fp8_classifier = config_fp8_classifier(cfg) != FP8_CLASSIFIER_NONE;
    E.fp8_classifier_all = config_fp8_classifier(cfg) == FP8_CLASSIFIER_ALL;
    E.prec = strcmp(prec, "bf16") == 0 || strcmp(prec, "fp8") == 0 ? PREC_BF16
             : strcmp(prec, "fp16") == 0                          ? PREC_FP16
                                                                  : PREC_FP32; /* or tf32 */
    E.es = E.prec == PREC_FP32 ? 4 : 2;
    E.B = cfg->train.batch_size;
    E.T = cfg->model.seq_len;
    E.C = cfg->model.d_model;
    E.H = cfg->model.n_head;
    E.F = cfg->model.d_ff;
    E.V = cfg->model.vocab_size;
    g_fp8_fast_input_grads = E.use_fp8 && fp8_fast_input_grads_at(E.C);
    E.Vp = cfg->model.padded_vocab_size;
    E.L = cfg->model.n_layer;
    if ((size_t)E.B * E.T > (size_t)INT_MAX / 4)
        die_input("train.batch_size x model.seq_len = %zu positions is too many for one micro-batch",
                  (size_t)E.B * E.T);
    E.N = E.B * E.T;
    E.training = !cfg->generate.enabled && !cfg->evaluate;
    E.slots = config_kv_slots(cfg);
    /* FP8 products need d_model, d_ff and the B·T rows multiples of 16: config_validate refuses others */
    param_layout_init(&E.layout, cfg);
    E.P = E.layout.n_params;
    E.shard = dist_part(E.P, DIST_CUDA_UNIT, g_dist.rank, g_dist.world);
    E.shard_stride = dist_stride(E.P, DIST_CUDA_UNIT, g_dist.world);
    E.P_padded = g_dist.world > 1 ? E.shard_stride * (size_t)g_dist.world : E.P;
    /* attn_qkv_fwd does the three projections as one batched product over consecutive weights */
    if (layer_offset(&E.layout, 0, T_WK) != layer_offset(&E.layout, 0, T_WQ) + (size_t)E.C * E.C ||
        layer_offset(&E.layout, 0, T_WV) != layer_offset(&E.layout, 0, T_WK) + (size_t)E.C * E.C)
        die_io("internal: W_Q, W_K, W_V are not consecutive in the parameter layout");
    E.chunk = loss_chunk_rows(E.Vp, E.es, E.N);
    if (fp8_cls_bwd() && E.chunk % 16) /* dwte's FP8 product contracts over a chunk's rows */
        E.chunk = E.chunk < 16 ? 16 : E.chunk - E.chunk % 16; /* N is a multiple of 16 (config_validate) */
    if (cfg->generate.enabled) E.chunk = 1; /* no loss: the prefill's one row of logits */
    E.loss_scale = E.prec == PREC_FP16 ? LOSS_SCALE_DEFAULT : 1.0f;

    {
        cudaError_t err = cudaGetDeviceCount(&n_dev);
        if (err != cudaSuccess || n_dev < 1)
            die_io("no usable CUDA device (%s); the CPU engine is build/microgpt_cpu",
                   err != cudaSuccess ? cudaGetErrorString(err) : "none found");
    }
    {
        cudaDeviceProp p;
        if (dist_device() >= n_dev) die_input("LOCAL_RANK %d: only %d CUDA devices are visible", dist_device(), n_dev);
        CUDA_CHECK(cudaGetDeviceProperties(&p, dist_device()));
        info("device %d: %s, compute capability %d.%d, %.1f GiB", dist_device(), p.name, p.major, p.minor, p.totalGlobalMem / 1073741824.0);
        if (E.use_fp8 && p.major * 10 + p.minor < 89)
            die_input("train.precision fp8 needs FP8 tensor cores: compute capability 8.9 or newer (this GPU: %d.%d)",
                      p.major, p.minor);
        if (E.prec == PREC_BF16 && p.major < 8) die_input("train.precision bf16 needs compute capability 8.0 or newer");
        E.use_side_stream = E.training && side_stream_pays(E.N, E.C, p.multiProcessorCount);
        if (E.training) /* docs/DESIGN.md §9 */
            info("backward: weight gradients %s (%d multiprocessors)",
                 E.use_side_stream ? "on a side stream, the products being small" : "in line with the rest",
                 p.multiProcessorCount);
        info_fp8_classifier(cfg, "bf16");
    }
    CUDA_CHECK(cudaSetDevice(dist_device())); /* LOCAL_RANK's GPU (docs/DESIGN.md §17) */
    info("kernel launches: %s", pdl_enabled() ? "programmatic dependent launch" /* docs/DESIGN.md §9 */
                                              : "ordinary (programmatic dependent launch needs a GPU of compute "
                                                "capability 9.0 and kernels compiled for it)");
    CUDA_CHECK(cudaFree(0)); /* create the context now, so the free-memory figure below accounts for it */
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    CUBLAS_CHECK(cublasCreate(&g_cublas));
    dist_cuda_init();
    info("cuBLASLt algorithms: %s", lt_table_applies() ? "the fixed table measured on " LT_TABLE_GPU_NAME
                                                         " (docs/DESIGN.md §9)"
                                                       : "its heuristic, by the engine's rule (the fixed table is for "
                                                         LT_TABLE_GPU_NAME " with another cuBLASLt or GPU)");
    E.use_graphs = !sync_launches() && !(getenv("ANDREA_NO_GRAPH") && getenv("ANDREA_NO_GRAPH")[0] == '1');

    plan_buffers(used); /* sizes only */
    if (E.training)
        info("classifier backward: %s", classifier_fused()
                                            ? "the softmax folded into its products (classifier_grad.cuh)"
                                            : "the loss rows, then two products");
    print_plan(used);
    emit_memory(GROUP_NAMES, used, N_GROUPS);
    for (g = 0; g < N_GROUPS; g++) total += used[g];
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (total > free_b)
        die_io("needs %zu bytes of device memory (%.2f GiB), %zu free (%.2f GiB)", total, total / 1073741824.0, free_b,
               free_b / 1073741824.0);
    for (g = 0; g < N_GROUPS; g++) {
        E.group_bytes[g] = used[g];
        if (used[g]) {
            CUDA_CHECK(cudaMalloc((void**)&E.group_base[g], used[g]));
            /* every byte defined before first use (the warm-up reads zero weights; the padding
             * between buffers is read by nothing, but initcheck stays meaningful) */
            CUDA_CHECK(cudaMemset(E.group_base[g], 0, used[g]));
        }
    }
    plan_buffers(used); /* now with the bases: the pointers */
    if (E.training) upload_decay_bits();
    if (E.use_fp8) fp8_list_weight_casts();
    int unified = 0; /* kernels read and write the pinned buffers by their host addresses (copy_words) */
    CUDA_CHECK(cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, dist_device()));
    if (!unified) die_io("the CUDA engine needs a GPU with unified addressing (a 64-bit process on a GPU of compute capability 2.0 or later)");
    CUDA_CHECK(cudaMallocHost((void**)&E.tok_host, 2 * (size_t)E.N * sizeof(int)));
    CUDA_CHECK(cudaMallocHost((void**)&E.io_host, sizeof(StepIO)));
    memset(E.io_host, 0, sizeof(StepIO));
    if (E.slots > 0) {
        CUDA_CHECK(cudaMallocHost((void**)&E.dec_io_host, 3 * (size_t)E.slots * sizeof(int)));
        CUDA_CHECK(cudaMallocHost((void**)&E.dec_logits_host, (size_t)E.slots * E.V * sizeof(float)));
        memset(E.dec_io_host, 0, 3 * (size_t)E.slots * sizeof(int));
        E.decode_graph = (cudaGraphExec_t*)xcalloc((size_t)E.slots, sizeof(cudaGraphExec_t), "decode graphs");
    }
    cublas_init(E.cublas_ws, CUBLAS_WORKSPACE_BYTES);
    if (strcmp(prec, "tf32") == 0) gemm_set_tf32();
    if (E.use_side_stream) {
        side_stream_init(E.side_ws, CUBLAS_WORKSPACE_BYTES);
        if (side_stream_sm_target()) /* docs/DESIGN.md §9 */
            info("side stream's products: planned for %d of %d multiprocessors", side_stream_sm_target(), lt_sm_count());
        else
            info("side stream's products: planned for the whole GPU (the fixed table's algorithms)");
    }
    if (E.training) ahead_stream_init();
    if (E.training) warm_up(); /* the device memory of a training run must not grow after its first step */
    return total;
}

static void engine_set_state(const float* params, const float* m, const float* v, float loss_scale) {
    size_t bytes = E.P * sizeof(float), lo = E.shard.lo, shard_bytes = (E.shard.hi - lo) * sizeof(float);
    CUDA_CHECK(cudaMemcpy(E.params, params, bytes, cudaMemcpyHostToDevice));
    if (m) CUDA_CHECK(cudaMemcpy(E.m, m + lo, shard_bytes, cudaMemcpyHostToDevice));
    if (v) CUDA_CHECK(cudaMemcpy(E.v, v + lo, shard_bytes, cudaMemcpyHostToDevice));
    if (E.prec == PREC_FP16) E.loss_scale = loss_scale > 0.0f ? loss_scale : LOSS_SCALE_DEFAULT;
    else E.loss_scale = 1.0f;
    FOR_ACT_TYPE(refresh_lowp_weights_t)();
    E.grads_pending = 0;
    CUDA_CHECK(cudaDeviceSynchronize());
}

static void engine_get_state(float* params, float* m, float* v, float* loss_scale) {
    size_t bytes = E.P * sizeof(float), lo = E.shard.lo, shard_bytes = (E.shard.hi - lo) * sizeof(float);
    CUDA_CHECK(cudaMemcpy(params, E.params, bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(m + lo, E.m, shard_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(v + lo, E.v, shard_bytes, cudaMemcpyDeviceToHost));
    dist_gather_parts(m, sizeof(float), E.P, DIST_CUDA_UNIT); /* rank 0 gets the whole state (§17) */
    dist_gather_parts(v, sizeof(float), E.P, DIST_CUDA_UNIT);
    *loss_scale = E.loss_scale;
}

static int engine_fp8_history_count(void) { return E.fp8_delayed ? FP8_DELAYED_PER_LAYER * E.L : 0; }
static void engine_get_fp8_history(Fp8History* h) {
    if (E.fp8_delayed) CUDA_CHECK(cudaMemcpy(h, E.fp8_hist, engine_fp8_history_count() * sizeof(Fp8History),
                                             cudaMemcpyDeviceToHost));
}
static void engine_set_fp8_history(const Fp8History* h) {
    if (!E.fp8_delayed) return;
    CUDA_CHECK(cudaMemcpy(E.fp8_hist, h, engine_fp8_history_count() * sizeof(Fp8History), cudaMemcpyHostToDevice));
    E.fp8_hist_filled = 1; /* every training micro-batch pushes every history; the fused path needs all */
    for (int i = 0; i < engine_fp8_history_count(); i++) E.fp8_hist_filled = E.fp8_hist_filled && h[i].count > 0;
}

static void engine_forward_backward(const int* inputs, const int* targets) {
    FOR_ACT_TYPE(forward_backward_t)(inputs, targets);
}

static float engine_micro_loss(void) {
    micro_batch_settle();
    return E.micro_loss;
}

static float engine_forward_loss(const int* inputs, const int* targets) {
    return FOR_ACT_TYPE(forward_loss_t)(inputs, targets);
}

static void engine_prefill(int slot, const int* tokens, int len, float* logits) {
    if (len < 1 || len > E.T || slot < 0 || slot >= E.slots)
        die_io("internal: engine_prefill of %d tokens into slot %d (1..%d tokens, %d slots)", len, slot, E.T, E.slots);
    FOR_ACT_TYPE(prefill_t)(slot, tokens, len, logits);
}

static void engine_decode(int n, const int* slots, const int* tokens, const int* positions, float* logits) {
    if (n < 1 || n > E.slots) die_io("internal: engine_decode of %d sequences (1..%d)", n, E.slots);
    for (int i = 0; i < n; i++)
        if (positions[i] < 0 || positions[i] >= E.T || slots[i] < 0 || slots[i] >= E.slots)
            die_io("internal: engine_decode at position %d of slot %d", positions[i], slots[i]);
    FOR_ACT_TYPE(decode_t)(n, slots, tokens, positions, logits);
}

static UpdateResult engine_update(float lr, int t, const Config* cfg) {
    UpdateResult r;
    double unscale = 1.0 / ((double)cfg->train.grad_accum * g_dist.world);
    int is_fp16 = E.prec == PREC_FP16;
    if (is_fp16) unscale /= E.loss_scale;
    E.io_host->uctl = update_ctl(lr, t, cfg->train.beta1, cfg->train.beta2, unscale, cfg->train.grad_clip, is_fp16);
    if (g_dist.world > 1) FOR_ACT_TYPE(update_sharded)(); /* ZeRO-1 over NCCL (§17) */
    else run_graph(&E.update_graph, FOR_ACT_TYPE(record_update));
    micro_batch_done(); /* both waited for the stream, the micro-batch queued before them included */
    if (g_dist.world == 1 && E.use_fp8) E.lowp_stale = 1; /* adamw_all left the fp8 weights' 16-bit copy */
    E.grads_pending = 0; /* also after a skipped fp16 step: its non-finite gradients are overwritten */
    r.grad_norm = E.io_host->norm;
    r.skipped = is_fp16 && !isfinite(r.grad_norm);
    if (r.skipped) {
        /* overflow somewhere in the scaled backward: the kernels dropped this step's gradients */
        if (E.loss_scale > 1.0f) E.loss_scale *= 0.5f;
        info("step %d: fp16 gradient overflow, step skipped, loss scale now %g", t, E.loss_scale);
    } else if (is_fp16 && t % LOSS_SCALE_GROW_EVERY == 0 && E.loss_scale < LOSS_SCALE_MAX) {
        E.loss_scale *= 2.0f;
    }
    r.loss_scale = E.loss_scale;
    return r;
}

static void engine_get_grads(float* grads) {
    size_t i;
    CUDA_CHECK(cudaMemcpy(grads, E.grads, E.P * sizeof(float), cudaMemcpyDeviceToHost));
    if (E.prec == PREC_FP16) /* the backward ran on loss-scaled gradients */
        for (i = 0; i < E.P; i++) grads[i] /= E.loss_scale;
}

static size_t engine_device_bytes_in_use(void) {
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return total_b - free_b;
}

static void engine_shutdown(void) {
    int g;
    CUDA_CHECK(cudaDeviceSynchronize());
    fp8_plans_clear();
    side_stream_shutdown();
    ahead_stream_shutdown();
    cublas_shutdown();
    for (int i = 0; i < 2; i++)
        if (E.fb_graph[i]) CUDA_CHECK(cudaGraphExecDestroy(E.fb_graph[i]));
    if (E.update_graph) CUDA_CHECK(cudaGraphExecDestroy(E.update_graph));
    for (int i = 0; i < E.slots; i++)
        if (E.decode_graph[i]) CUDA_CHECK(cudaGraphExecDestroy(E.decode_graph[i]));
    free(E.decode_graph);
    for (g = 0; g < N_GROUPS; g++)
        if (E.group_base[g]) CUDA_CHECK(cudaFree(E.group_base[g]));
    if (E.tok_host) CUDA_CHECK(cudaFreeHost(E.tok_host));
    if (E.io_host) CUDA_CHECK(cudaFreeHost(E.io_host));
    if (E.dec_io_host) CUDA_CHECK(cudaFreeHost(E.dec_io_host));
    if (E.dec_logits_host) CUDA_CHECK(cudaFreeHost(E.dec_logits_host));
    if (g_stream) CUDA_CHECK(cudaStreamDestroy(g_stream));
    g_stream = 0;
    param_layout_free(&E.layout);
    dist_cuda_shutdown();
    memset(&E, 0, sizeof E);
}

int main(int argc, char** argv) { return engine_main(argc, argv); }
