/* train_loop.h: train_main(), the whole training loop, shared by both engines. The engine file
 * defines the engine_* functions of engine.h, includes this header and calls train_main from main.
 * Order of business: parse and validate every input (flags, shards, checkpoint header) before any
 * large allocation; allocate everything once; then run steps, reacting to signals between steps.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_TRAIN_LOOP_H
#define MICROGPT_HOST_TRAIN_LOOP_H

#include "checkpoint.h"
#include "config.h"
#include "data.h"
#include "dist.h"
#include "engine.h"
#include "files.h"
#include "fp8_history.h"
#include "generate.h"
#include "mixture.h"
#include "output.h"
#include "params.h"
#include "rng.h"
#include "schedule.h"
#include "signals.h"
#include <time.h>

/* Everything the loop needs, allocated once in run_setup. */
typedef struct {
    Config cfg;
    ParamLayout layout;
    Mixture mix;                     /* the train sources and their mixer */
    Dataset val, polish;
    int start_step;                  /* completed steps at start (checkpoint step on resume) */
    int saved_step;                  /* step of the newest checkpoint on disk, -1: none */
    float *params, *m, *v;           /* host copies for checkpoints [n_params] each */
    float loss_scale;
    int *inputs, *targets;           /* one micro-batch [B*T] */
    int* arms;                       /* the source of every micro-batch of the step, all ranks [world·grad_accum] */
    double* micro_losses;            /* this rank's micro-batch losses of a step [grad_accum] (§17) */
    int* sample_tokens;              /* [sample.tokens] */
    float* logits;                   /* [vocab_size] */
    Sampler sampler;
    Sidecar sidecar;                 /* the checkpoint's, read once at start-up (resume, evaluate) */
    CkptChecked resumed;             /* the checkpoint ckpt_check accepted (resume, evaluate); fd -1: none */
    uint32_t data_crc;               /* training_data_fingerprint, kept in the sidecar */
    Fp8HistoryMember resumed_fp8;    /* the checkpoint's fp8 histories (resume, fp8 training) */
    Fp8History* fp8_hist;            /* a copy of the engine's fp8 histories [n_fp8_hist] (§18) */
    int n_fp8_hist;                  /* engine_fp8_history_count(): 0 unless it trains in fp8 */
} Run;

/* ---------------------------------------------------------------------------------------------- */
/* Sampling */

/* The ids that end prompt p's samples: --sample.stop's, or with "auto" <|im_end|> for a ChatML
 * prompt (one holding <|im_start|>) when the vocabulary has it, so a sample is the assistant's
 * answer and not the next turns it would invent. */
static int sample_stop_ids(const Config* c, const int* prompt, int n, const int** ids) {
    static const int im_end = TOKEN_IM_END;
    *ids = c->sample.stop_ids;
    if (strcmp(c->sample.stop, "auto") != 0) return c->sample.n_stop;
    *ids = &im_end;
    return c->model.vocab_size > TOKEN_IM_END && id_in(TOKEN_IM_START, prompt, n);
}

/* Continues every prompt by up to sample.tokens tokens with the KV cache (slot 0), ending early at
 * a stop id (kept as the last token) or when prompt and sample fill the window of seq_len
 * positions (no sliding), and emits one "sample" line each. Draw i of prompt p after `done` steps
 * uses counter (done·n_prompts + p)·tokens + i of STREAM_SAMPLE. */
static void run_samples(Run* r, int done) {
    const Config* c = &r->cfg;
    int p, T = c->model.seq_len, slot = 0;
    for (p = 0; p < c->sample.n_prompts; p++) {
        const int* prompt = c->sample.prompt_tokens + c->sample.prompt_start[p];
        const int* stop;
        int n0 = c->sample.prompt_start[p + 1] - c->sample.prompt_start[p];
        int n_stop = sample_stop_ids(c, prompt, n0, &stop), n = 0;
        engine_prefill(slot, prompt, n0, r->logits);
        while (n0 + n < T) {
            uint64_t counter = ((uint64_t)done * (uint64_t)c->sample.n_prompts + (uint64_t)p) * (uint64_t)c->sample.tokens + (uint64_t)n;
            int tok = sample_token(&r->sampler, r->logits, c->sample.temperature, c->sample.top_k, 1.0,
                                   rng_uniform((uint64_t)c->train.seed, STREAM_SAMPLE, counter));
            int pos = n0 + n; /* of tok */
            r->sample_tokens[n++] = tok;
            if (n == c->sample.tokens || id_in(tok, stop, n_stop) || pos + 1 == T) break;
            engine_decode(1, &slot, &tok, &pos, r->logits);
        }
        emit_sample(done, p, prompt, n0, r->sample_tokens, n);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Evaluation, checkpoints */

/* Mean loss over validation batches 0 .. batches-1 of `stream` from ds. */
static double mean_val_loss(Run* r, const Dataset* ds, int stream, int batches) {
    const Config* c = &r->cfg;
    double sum = 0.0;
    int i;
    for (i = 0; i < batches; i++) {
        fill_val_batch(ds, (uint64_t)c->train.seed, stream, i, c->train.batch_size, c->model.seq_len, r->inputs, r->targets);
        sum += engine_forward_loss(r->inputs, r->targets);
    }
    return sum / batches;
}

/* An evaluation after `done` steps: data.val's loss, and each source's that has val shards. Without
 * data.val the overall loss is the sources' mean by prior weight (every source then has a val). */
static void run_eval(Run* r, int done) {
    const Config* c = &r->cfg;
    const Mixture* m = &r->mix;
    double by_source[CFG_MAX_SOURCES], overall = 0.0;
    int i;
    for (i = 0; i < m->n; i++) {
        by_source[i] = m->val[i].n_shards ? mean_val_loss(r, &m->val[i], STREAM_VAL, c->eval.batches) : NAN;
        overall += m->val[i].n_shards ? m->prior[i] * by_source[i] : 0.0;
    }
    if (r->val.n_shards) overall = mean_val_loss(r, &r->val, STREAM_VAL, c->eval.batches);
    emit_val(done, overall, m->names, by_source, m->listed ? m->n : 0);
}

/* The bandit's probe loss at the start of step index s: data.val's loss on probe_batches windows of
 * STREAM_PROBE (not the evaluation's windows, so the reported val_loss is not what the bandit
 * optimises). Measured once per state of the weights, by rank 0. */
static double probe_loss(Run* r, int s) {
    if (r->mix.probe_step != s) {
        double loss = g_dist.rank == 0 ? mean_val_loss(r, &r->val, STREAM_PROBE, r->cfg.bandit.probe_batches) : 0.0;
        dist_broadcast(&loss, sizeof loss); /* dist (§17): every rank learns from rank 0's probe, the same bits */
        r->mix.probe_loss = loss;
        r->mix.probe_step = s;
    }
    return r->mix.probe_loss;
}

/* Ends a run whose training went non-finite after `done` steps: an exit event, one error line,
 * exit code EXIT_DIVERGED. Nothing of the non-finite state is written: the newest checkpoint on
 * disk (and the one before it, PATH.prev) stays the last good state. */
static void stop_diverged(const Run* r, int done, const char* what) {
    char kept[CFG_PATH_MAX + 64];
    if (r->saved_step >= 0)
        snprintf(kept, sizeof kept, "the last good checkpoint %s (step %d) is kept", r->cfg.checkpoint.path,
                 r->saved_step);
    else
        snprintf(kept, sizeof kept, "no checkpoint was written");
    emit_exit(done, "diverged");
    die_code(EXIT_DIVERGED, "training diverged at step %d: %s; stopped without saving this state, %s "
             "(a lower train.lr, or train.grad_clip, may help)", done, what, kept);
}

/* dist (§17): after a step every rank holds the same fp8 histories, so that rank 0's checkpoint
 * resumes every rank exactly (docs/DESIGN.md §18). One rank: nothing to do. */
static void agree_fp8_histories(Run* r) {
    if (g_dist.world == 1 || r->n_fp8_hist == 0) return;
    engine_get_fp8_history(r->fp8_hist);
    fp8_history_min_over_ranks(r->fp8_hist, r->n_fp8_hist);
    engine_set_fp8_history(r->fp8_hist);
}

/* The sidecar's members beyond its own (checkpoint.h): the training data's fingerprint, the bandit
 * state, then the fp8 histories (validate_sidecar_room). */
#define SIDECAR_EXTRA_MAX (CKPT_SIDECAR_MAX - CKPT_SIDECAR_OWN_MAX)

static void save_checkpoint(Run* r, int done, const char* reason) {
    const float* parts[3];
    const char* names[3] = {"weight", "AdamW m", "AdamW v"};
    size_t n = r->layout.n_params, bad, len;
    char what[96], bandit_json[MIXTURE_SIDECAR_MAX], extra[SIDECAR_EXTRA_MAX];
    int k, written = 1;
    engine_get_state(r->params, r->m, r->v, &r->loss_scale); /* gathers the ranks' AdamW shards (§17) */
    if (g_dist.rank != 0) { /* rank 0 alone checks and writes */
        /* and says it did: after the last step (or a stop) nothing else would tell the others
         * that rank 0 failed here (a full disk, non-finite moments), and they would exit 0 */
        dist_broadcast(&written, sizeof written);
        return;
    }
    parts[0] = r->params; parts[1] = r->m; parts[2] = r->v;
    for (k = 0; k < 3; k++)
        if ((bad = first_non_finite(parts[k], n)) < n) {
            snprintf(what, sizeof what, "%s %zu of %zu is not finite", names[k], bad, n);
            stop_diverged(r, done, what);
        }
    mixture_sidecar_json(&r->mix, &r->cfg, bandit_json, sizeof bandit_json);
    engine_get_fp8_history(r->fp8_hist);
    len = (size_t)snprintf(extra, sizeof extra, ",\"data_crc32c\":%lu%s", (unsigned long)r->data_crc, bandit_json);
    fp8_history_sidecar_json(r->fp8_hist, r->n_fp8_hist, extra + len, sizeof extra - len);
    ckpt_write(r->cfg.checkpoint.path, done, r->params, r->m, r->v, n, r->loss_scale, &r->cfg, extra);
    dist_broadcast(&written, sizeof written);
    r->saved_step = done;
    emit_checkpoint(done, r->cfg.checkpoint.path, reason);
}

/* Micro-batches of step index s in all: grad_accum on each rank (dist, §17). */
static int global_accum(const Config* c) { return c->train.grad_accum * g_dist.world; }

/* The source of every micro-batch of step index s, on every rank, into r->arms: each rank draws
 * them all (pure functions of the bandit's state, which every rank holds), so rank 0 can report
 * them without asking the others. */
static void draw_step_arms(Run* r, int s) {
    int g;
    for (g = 0; g < global_accum(&r->cfg); g++) r->arms[g] = mixture_arm(&r->mix, &r->cfg, s, g, global_accum(&r->cfg));
}

/* Micro-batch g (of global_accum, §17) of step index s into r->inputs/targets: from its source
 * r->arms[g] (draw_step_arms), or the polish shards in the polish phase. */
static void fill_step_batch(Run* r, int s, int g) {
    const Config* c = &r->cfg;
    const Dataset* ds = in_polish(c, s) ? &r->polish : &r->mix.train[r->arms[g]];
    fill_train_batch(ds, (uint64_t)c->train.seed, s, g, global_accum(c), c->train.batch_size, c->model.seq_len,
                     r->inputs, r->targets);
}

/* ---------------------------------------------------------------------------------------------- */
/* Start-up */

/* A run that checkpoints fp8 training keeps FP8_DELAYED_PER_LAYER histories a layer in the
 * sidecar (docs/DESIGN.md §18), which holds at most CKPT_SIDECAR_MAX bytes: a model with more
 * layers than their longest writing fits is refused here, not at its first checkpoint. */
static void validate_sidecar_room(const Config* c) {
    int most = c->model.n_layer;
    if (!c->checkpoint.path[0] || c->dump_grads[0] || !config_keeps_fp8_histories(c)) return; /* writes none */
    while (most > 0 && sidecar_longest((size_t)most) >= CKPT_SIDECAR_MAX) most--;
    if (most < c->model.n_layer)
        die_input("train.precision fp8 with --checkpoint takes at most %d layers (model.n_layer %d): the checkpoint "
                  "sidecar (at most %d bytes) keeps %d fp8 scale histories a layer", most, c->model.n_layer,
                  CKPT_SIDECAR_MAX, FP8_DELAYED_PER_LAYER);
}

/* Whether `path` names the file st (the same device and inode, links followed). */
static int names_file(const char* path, const struct stat* st) {
    struct stat other;
    return stat(path, &other) == 0 && other.st_dev == st->st_dev && other.st_ino == st->st_ino;
}

/* Whether st is one of the run's inputs: a checkpoint slot, its sidecar, a shard. */
static int is_run_input(const Run* r, const struct stat* st) {
    const Dataset* sets[CFG_MAX_SOURCES + 2];
    CkptFiles f;
    int n = 0, k, i;
    if (r->cfg.checkpoint.path[0]) {
        ckpt_files(r->cfg.checkpoint.path, &f);
        if (names_file(f.ckpt, st) || names_file(f.side, st) || names_file(f.prev, st) || names_file(f.prev_side, st))
            return 1;
    }
    for (k = 0; k < r->mix.n; k++) sets[n++] = &r->mix.train[k];
    sets[n++] = &r->val;
    sets[n++] = &r->polish;
    for (k = 0; k < n; k++)
        for (i = 0; i < sets[k]->n_shards; i++)
            if (names_file(sets[k]->paths[i], st)) return 1;
    return 0;
}

/* --dump-grads PATH: a file to create or replace, in a directory that exists, refused up front
 * (found only after the forward and backward, it would cost them); a FIFO there would block the
 * write's open() until some reader came, deaf to SIGTERM. The run's own inputs are refused too:
 * the dump truncated a checkpoint it was given as its path. */
static void dump_grads_check_path(const Run* r, const char* path) {
    char dir[CFG_PATH_MAX];
    struct stat st;
    if (stat(path, &st) == 0) {
        if (!S_ISREG(st.st_mode)) die_input("--dump-grads %s is %s, not a regular file", path, file_kind(st.st_mode));
        if (is_run_input(r, &st))
            die_input("--dump-grads %s is one of the run's inputs (a checkpoint or a shard); it would be overwritten",
                      path);
    }
    parent_dir(path, dir, sizeof dir);
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) die_input("--dump-grads: directory %s does not exist", dir);
}

/* Whether this process writes the run's checkpoints and so holds PATH.lock: rank 0 alone writes
 * them (§17), and --dump-grads writes none. */
static int run_locks_checkpoint(const Config* c) {
    return c->checkpoint.path[0] && !c->dump_grads[0] && env_int("RANK", 0) == 0;
}

/* What the training steps draw from, the mixture's sources in order, then the polish shards, as one
 * CRC-32C (dataset_fingerprint): the sidecar keeps it, and a resume whose data differ says so. */
static uint32_t training_data_fingerprint(const Run* r) {
    uint32_t crc = 0;
    int i;
    for (i = 0; i < r->mix.n; i++) crc = dataset_fingerprint(&r->mix.train[i], crc);
    return r->polish.n_shards ? dataset_fingerprint(&r->polish, crc) : crc;
}

/* A resume on other training data than the checkpoint's (`make data` run again in between, a glob
 * that now matches more shards) goes on, as a run may be continued on new data on purpose; but
 * its batches are no longer those of the run it continues, so it says so. A sidecar written before
 * sidecars held the fingerprint says nothing; one whose fingerprint is no number (no checksum
 * covers it: edited or damaged) says it cannot tell, where taken as absent it said nothing. */
static void warn_if_data_changed(const Run* r) {
    double x;
    int found = r->sidecar.text ? json_optional_number(r->sidecar.text, "data_crc32c", &x) : 0;
    if (found > 0 && x != (double)r->data_crc)
        warn("the training data differ from those %s was written with (shards added or removed, or of other lengths "
             "or contents): the run goes on from step %d, no longer as the run it continues would have",
             r->cfg.checkpoint.path, r->start_step);
    else if (found < 0)
        warn("checkpoint sidecar %s.json holds a data_crc32c that is no number (damaged or edited): whether the "
             "training data are those it was written with is unknown; the run goes on from step %d",
             r->cfg.checkpoint.path, r->start_step);
}

/* Everything that can be wrong with the input is found here, before any large allocation. */
static void run_validate_inputs(Run* r, int argc, char** argv) {
    Config* c = &r->cfg;
    int V, T;
    r->resumed.fd = -1;
    config_parse(c, argc, argv);
    V = c->model.vocab_size;
    T = c->model.seq_len;
    param_layout_init(&r->layout, c);
    param_layout_check(c, &r->layout);
    validate_sidecar_room(c);
    mixture_open(&r->mix, c);
    if (c->data.val[0]) dataset_open(&r->val, c->data.val, "data.val", V, T);
    if (c->polish.enabled) dataset_open(&r->polish, c->polish.train, "polish.train", V, T);
    r->data_crc = training_data_fingerprint(r);
    r->mix.probe_crc = dataset_fingerprint(&r->val, 0);
    r->start_step = 0;
    r->saved_step = -1;
    if (c->checkpoint.path[0])
        ckpt_check_paths(c->checkpoint.path, !c->resume && !c->dump_grads[0], r->layout.n_params,
                         (size_t)c->model.n_layer);
    if (c->dump_grads[0]) dump_grads_check_path(r, c->dump_grads);
    if (c->resume) {
        if (run_locks_checkpoint(c)) ckpt_lock_existing(c->checkpoint.path); /* before the read */
        r->resumed = ckpt_check(c, r->layout.n_params, &r->sidecar);
        r->start_step = r->saved_step = r->resumed.step;
        warn_if_data_changed(r);
        /* before the start event, which reports p */
        mixture_resume(&r->mix, c, c->checkpoint.path, &r->sidecar, r->start_step);
        if (config_keeps_fp8_histories(c)) fp8_history_read(c->checkpoint.path, &r->sidecar, &r->resumed_fp8);
    }
}

static void run_allocate(Run* r) {
    const Config* c = &r->cfg;
    size_t n = r->layout.n_params, bt = (size_t)c->train.batch_size * c->model.seq_len;
    r->params = (float*)xmalloc(n * sizeof(float), "host weights");
    r->m = (float*)xcalloc(n, sizeof(float), "host AdamW m");
    r->v = (float*)xcalloc(n, sizeof(float), "host AdamW v");
    r->inputs = (int*)xmalloc(bt * sizeof(int), "batch inputs");
    r->targets = (int*)xmalloc(bt * sizeof(int), "batch targets");
    r->arms = (int*)xcalloc((size_t)global_accum(c), sizeof(int), "micro-batch sources");
    r->sample_tokens = (int*)xmalloc((size_t)c->sample.tokens * sizeof(int), "sample tokens");
    r->logits = (float*)xmalloc((size_t)c->model.vocab_size * sizeof(float), "sample logits");
    r->micro_losses = (double*)xmalloc((size_t)c->train.grad_accum * sizeof(double), "micro-batch losses");
    sampler_init(&r->sampler, c->model.vocab_size);
}

static void run_free(Run* r) {
    free(r->params); free(r->m); free(r->v); free(r->inputs); free(r->targets); free(r->arms);
    free(r->sample_tokens); free(r->logits); free(r->micro_losses);
    free(r->fp8_hist); free(r->resumed_fp8.h);
    if (r->resumed.fd >= 0) close(r->resumed.fd); /* checked but never loaded: a finished run's resume */
    sidecar_free(&r->sidecar);
    sampler_free(&r->sampler);
    free(r->cfg.sample.prompt_tokens);
    mixture_close(&r->mix);
    if (r->val.n_shards) dataset_close(&r->val);
    if (r->polish.n_shards) dataset_close(&r->polish);
    param_layout_free(&r->layout);
}

/* dist (§17): every rank's batches count */
static long long global_tokens_per_step(const Config* c) { return config_tokens_per_step(c) * g_dist.world; }

static void emit_start(const Run* r) {
    const Config* c = &r->cfg;
    fputs("{\"event\":\"start\",\"engine\":", stdout);
    json_put_string(stdout, engine_name());
    fputs(",\"name\":", stdout);
    json_put_string(stdout, c->name);
    fprintf(stdout, ",\"n_params\":%zu,\"step\":%d,\"steps\":%d,\"precision\":\"%s\",\"compute_precision\":\"%s\","
                    "\"tokens_per_step\":%lld",
            r->layout.n_params, r->start_step, c->train.steps, c->train.precision, engine_compute_precision(c),
            global_tokens_per_step(c));
    emit_mixture_fields(&r->mix);
    jline_end();
}

/* --dump-grads: one forward/backward of micro-batch 0 of step 0, written as [f32 loss][grads]. */
static int run_dump_grads(Run* r) {
    const Config* c = &r->cfg;
    size_t n = r->layout.n_params;
    float loss;
    float* grads = (float*)xmalloc(n * sizeof(float), "gradient dump");
    struct stat st;
    int fd, ok;
    draw_step_arms(r, 0);
    fill_step_batch(r, 0, 0);
    engine_forward_backward(r->inputs, r->targets);
    loss = engine_micro_loss();
    engine_get_grads(grads);
    /* O_NONBLOCK: a FIFO put there since the start fails the open instead of blocking it */
    fd = open(c->dump_grads, O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK, 0644);
    if (fd < 0) die_io("cannot create %s: %s", c->dump_grads, strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) die_io("--dump-grads %s is not a regular file", c->dump_grads);
    ok = write_all(fd, &loss, sizeof loss) && write_all(fd, grads, n * sizeof(float));
    if (close(fd) != 0 || !ok) die_io("writing %s failed: %s", c->dump_grads, strerror(errno));
    info("wrote loss %.6f and %zu gradients to %s", loss, n, c->dump_grads);
    free(grads);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* The loop */

/* One optimizer step: grad_accum micro-batches, then the update. Returns the mean micro-batch loss
 * over every rank. dist (§17): rank r's micro-batch j is micro-batch r·accum + j of world·accum, and
 * the losses are summed in that global order (with one rank: j = 0, 1, ... as always). */
static double run_step(Run* r, int s, UpdateResult* res, double lr) {
    const Config* c = &r->cfg;
    int j, accum = c->train.grad_accum;
    draw_step_arms(r, s);
    for (j = 0; j < accum; j++) {
        fill_step_batch(r, s, g_dist.rank * accum + j);
        engine_forward_backward(r->inputs, r->targets);
        if (j < accum - 1) r->micro_losses[j] = engine_micro_loss();
    }
    agree_fp8_histories(r);
    *res = engine_update((float)lr, s + 1, c); /* queued right behind the last micro-batch */
    r->micro_losses[accum - 1] = engine_micro_loss();
    return dist_sum_in_rank_order(r->micro_losses, accum) / (accum * g_dist.world);
}

/* Which checkpoint (if any) is due after `done` completed steps, by priority. `stop`: a stopping
 * signal's number, or 0. */
static const char* checkpoint_reason(const Run* r, int done, int usr1, int stop) {
    const Config* c = &r->cfg;
    if (done == c->train.steps) return "final";
    if (stop) return "signal";
    if (usr1) return "usr1";
    if (c->checkpoint.every > 0 && done % c->checkpoint.every == 0) return "periodic";
    return NULL;
}

/* Start-up after validation: allocate once, load or initialise the state, hand it to the engine. */
static void run_start(Run* r) {
    const Config* c = &r->cfg;
    emit_start(r);
    run_allocate(r);
    engine_setup(c);
    r->n_fp8_hist = engine_fp8_history_count();
    r->fp8_hist = (Fp8History*)xcalloc(r->n_fp8_hist ? (size_t)r->n_fp8_hist : 1, sizeof(Fp8History), "fp8 histories");
    if (c->resume) {
        ckpt_load(&r->resumed, c->checkpoint.path, r->layout.n_params, r->params, r->m, r->v);
        r->loss_scale = sidecar_loss_scale(c->checkpoint.path, r->start_step, c, &r->sidecar);
        info("resumed from %s at step %d", c->checkpoint.path, r->start_step);
    } else {
        params_init(r->params, &r->layout, c);
        r->loss_scale = 0.0f; /* engine default */
    }
    engine_set_state(r->params, r->m, r->v, r->loss_scale);
    if (c->resume && r->n_fp8_hist > 0) {
        const Fp8History* h = fp8_history_resumed(&r->resumed_fp8, c->checkpoint.path, r->n_fp8_hist);
        if (h) engine_set_fp8_history(h);
    }
    if (strcmp(engine_compute_precision(c), c->train.precision) != 0)
        info("note: the %s engine computes in %s (train.precision %s was asked for)", engine_name(),
             engine_compute_precision(c), c->train.precision);
}

/* Step index s, its record, and what is due after it (eval, samples, checkpoint). Returns the
 * number of a stopping signal that asked the run to end after this step (its checkpoint written),
 * else 0. */
static int run_one_step(Run* r, int s) {
    const Config* c = &r->cfg;
    long long tokens_per_step = global_tokens_per_step(c);
    int done = s + 1, usr1, stop, flags[2], probe = bandit_is_probe_step(c, s);
    double lr = lr_at(c, s), t0, ms, loss;
    UpdateResult res;
    BanditRound probe_round = {0, 0.0, 0.0, 0.0, 0.0, {0.0}};
    const char* reason;
    if (c->polish.enabled && s == c->polish.start_step) {
        emit_polish(s);
        /* the state at the switch, before the first polish step: what the polish archive keeps */
        if (c->checkpoint.path[0]) save_checkpoint(r, s, "polish");
    }
    t0 = now_ms(); /* a step's time includes its probes: they are what the bandit costs */
    if (probe) probe_round.loss_before = probe_loss(r, s);
    loss = run_step(r, s, &res, lr);
    if (probe && !res.skipped) probe_round.loss_after = probe_loss(r, done);
    ms = now_ms() - t0;
    emit_step(done, loss, lr, res.grad_norm, ms, (double)tokens_per_step / (ms > 0 ? ms * 1e-3 : 1e-9),
              (long long)done * tokens_per_step, in_polish(c, s) ? "polish" : "pretrain", res.skipped, res.loss_scale,
              config_is_fp16(c), r->arms, r->mix.listed && !in_polish(c, s) ? global_accum(c) : 0);
    /* an fp16 overflow is a skipped step (the loss scale handles it), not a divergence */
    if (!isfinite(loss) || (!res.skipped && !isfinite(res.grad_norm))) {
        char what[96];
        snprintf(what, sizeof what, "loss %g, gradient norm %g", loss, (double)res.grad_norm);
        stop_diverged(r, done, what);
    }
    if (probe && !res.skipped) { /* an fp16 overflow step changed nothing: nothing to learn from it */
        probe_round.arm = r->arms[0];
        bandit_learn(&r->mix, c, &probe_round);
        emit_bandit(done, &r->mix, &probe_round);
    }
    if (s == r->start_step || done == c->train.steps) { /* the query only where it is reported */
        size_t in_use = engine_device_bytes_in_use();
        if (in_use > 0) emit_device_memory(done, in_use);
    }
    if (g_dist.rank == 0) { /* dist (§17): the weights are the same on every rank; rank 0 reports */
        if (c->eval.every > 0 && (done % c->eval.every == 0 || done == c->train.steps)) run_eval(r, done);
        if (c->sample.every > 0 && done % c->sample.every == 0) run_samples(r, done);
    }
    /* read the flags once, and consume SIGUSR1's, before acting on them: a signal arriving from here
     * on is seen after the next step, never half-handled (a stop without its checkpoint) */
    flags[0] = g_ckpt_requested;
    g_ckpt_requested = 0;
    flags[1] = g_stop_signal;
    dist_max_flags(flags, 2); /* dist (§17): a signal to any rank, acted on by all after this step */
    usr1 = flags[0];
    stop = flags[1];
    reason = checkpoint_reason(r, done, usr1, stop);
    if (reason && c->checkpoint.path[0]) save_checkpoint(r, done, reason);
    else if (stop || usr1) warn("no --checkpoint given: nothing saved");
    return stop;
}

static void run_finish(Run* r, int step, const char* reason) {
    emit_exit(step, reason);
    engine_shutdown();
    dist_shutdown();
    run_free(r);
}

/* A stopping signal that came before the first step (during start-up, or pending from a launcher
 * that spawned the engine with it blocked, see signals.h): nothing was trained, so nothing is saved
 * (a resumed run's checkpoint already holds this state); exit 0 like any stop by signal. */
static int stop_before_first_step(Run* r, int engine_started) {
    info("stopped by signal %d before the first step: nothing to save", (int)g_stop_signal);
    emit_exit(r->start_step, "signal");
    if (engine_started) engine_shutdown();
    run_free(r);
    return 0;
}

/* What a resumed run starts from, the checkpoint's bytes and its sidecar, as one CRC-32C that the
 * ranks compare (0: a fresh start). */
static uint32_t resumed_state_crc(const Run* r) {
    uint32_t crc;
    if (!r->cfg.resume) return 0;
    crc = crc32c_update(0, &r->resumed.crc, sizeof r->resumed.crc);
    return r->sidecar.text ? crc32c_update(crc, r->sidecar.text, r->sidecar.bytes) : crc;
}

/* dist (§17): connect the ranks; only rank 0's events reach stdout. Returns 1 where a stop signal
 * came before they were connected. */
static int dist_start(const Run* r, int argc, char** argv) {
    int stopped;
    /* before dist_init: refused after it, a lone process (WORLD_SIZE left in the shell) waited
     * ANDREA_DIST_TIMEOUT_S for ranks nobody starts, then reported a lost rank instead */
    if (r->cfg.dump_grads[0] && env_int("WORLD_SIZE", 1) > 1)
        die_input("--dump-grads is one process: unset WORLD_SIZE");
    stopped = dist_init(argc, argv, resumed_state_crc(r), r->data_crc, engine_name());
    if (g_dist.world == 1) return 0;
    if (g_dist.rank != 0 && !freopen("/dev/null", "w", stdout)) die_io("rank %d: cannot silence stdout", g_dist.rank);
    if (stopped) return 1;
    info("rank %d of %d (local rank %d): %d windows of %d tokens per step in all", g_dist.rank, g_dist.world,
         g_dist.local_rank, g_dist.world * r->cfg.train.grad_accum * r->cfg.train.batch_size, r->cfg.model.seq_len + 1);
    return 0;
}

/* A stopping signal seen by any rank (dist, §17): every rank takes the same way out. */
static int agreed_stop(void) {
    int stop = g_stop_signal;
    dist_max_flags(&stop, 1);
    if (stop && !g_stop_signal) g_stop_signal = stop;
    return stop;
}

static int train_main(int argc, char** argv) {
    static Run run; /* static: big enough (Config holds paths) that it shouldn't live on the stack */
    Run* r = &run;
    int s, stop;

    signals_install();
    std_fds_fill();
    fd_make_blocking(STDOUT_FILENO);
    run_validate_inputs(r, argc, argv);
    /* locked once the inputs are found good, so a refused start leaves nothing behind (a resume
     * took the lock already where PATH.lock existed) */
    if (run_locks_checkpoint(&r->cfg)) ckpt_lock(r->cfg.checkpoint.path);
    if (dist_start(r, argc, argv)) { /* dist (§17): no-op unless WORLD_SIZE > 1 */
        emit_start(r);
        return stop_before_first_step(r, 0);
    }
    if (r->start_step >= r->cfg.train.steps && !r->cfg.dump_grads[0]) {
        emit_start(r);
        info("checkpoint %s is at step %d of %d: the run is already finished", r->cfg.checkpoint.path, r->start_step,
             r->cfg.train.steps);
        emit_exit(r->start_step, "already_finished");
        run_free(r);
        return 0;
    }
    if (agreed_stop()) { /* before the slow part of start-up (device set-up) */
        emit_start(r);
        return stop_before_first_step(r, 0);
    }
    run_start(r);
    if (r->cfg.dump_grads[0]) {
        run_dump_grads(r);
        engine_shutdown();
        run_free(r);
        return 0;
    }
    if (agreed_stop()) return stop_before_first_step(r, 1);
    g_dist.starting = 0; /* from here a stop is agreed after a step and checkpointed (§17) */
    for (s = r->start_step, stop = 0; s < r->cfg.train.steps && !stop; s++) stop = run_one_step(r, s);
    if (s < r->cfg.train.steps) {
        info("stopped by signal %d after step %d", stop, s);
        run_finish(r, s, "signal");
        return 0;
    }
    run_finish(r, r->cfg.train.steps, "finished");
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* --evaluate (docs/DESIGN.md §5a) */

/* The mean loss over every whole non-overlapping window of the validation shards, in order, one
 * window per forward (the engine is set up with batch size 1). */
static double eval_all_windows(Run* r, uint64_t* windows) {
    const Config* c = &r->cfg;
    double sum = 0.0;
    uint64_t w;
    *windows = dataset_sequential_windows(&r->val, c->model.seq_len);
    if (*windows == 0)
        die_input("data.val: no shard holds a whole window of %d tokens (model.seq_len + 1)", c->model.seq_len + 1);
    for (w = 0; w < *windows; w++) {
        fill_sequential_window(&r->val, w, c->model.seq_len, r->inputs, r->targets);
        sum += engine_forward_loss(r->inputs, r->targets);
    }
    return sum / (double)*windows;
}

/* --evaluate: the loss of --checkpoint on --data.val as one JSON line
 * {"loss":L,"tokens":N,"batches":n,"checkpoint_step":s}. With eval.batches n > 0 it is run_eval's
 * data.val figure: the training loop's val_loss on the same batches (seed, batch size and
 * precision from the sidecar), bit for bit on the same engine; with 0 it is the mean over every
 * whole window (eval_all_windows). */
static int evaluate_main(int argc, char** argv) {
    static Run run; /* static: Config holds paths */
    Run* r = &run;
    Config* c = &r->cfg;
    uint64_t batches;
    double loss;
    char b[32];
    config_parse_for_checkpoint(c, argc, argv, &r->sidecar);
    param_layout_init(&r->layout, c);
    param_layout_check(c, &r->layout);
    /* before any large allocation */
    r->resumed = ckpt_check(c, r->layout.n_params, &r->sidecar);
    if (c->eval.batches == 0) c->train.batch_size = 1;
    dataset_open(&r->val, c->data.val, "data.val", c->model.vocab_size, c->model.seq_len);
    r->inputs = (int*)xmalloc((size_t)c->train.batch_size * c->model.seq_len * sizeof(int), "batch inputs");
    r->targets = (int*)xmalloc((size_t)c->train.batch_size * c->model.seq_len * sizeof(int), "batch targets");
    g_quiet_events = 1; /* stdout is the one result line */
    engine_setup(c);
    load_weights(c, r->layout.n_params, &r->resumed);
    if (strcmp(engine_compute_precision(c), c->train.precision) != 0)
        info("note: the %s engine computes in %s (train.precision %s was asked for)", engine_name(),
             engine_compute_precision(c), c->train.precision);
    if (c->eval.batches > 0) {
        loss = mean_val_loss(r, &r->val, STREAM_VAL, c->eval.batches);
        batches = (uint64_t)c->eval.batches;
    } else {
        loss = eval_all_windows(r, &batches);
    }
    /* the step of the checkpoint scored: a run still training may have replaced the file since its
     * caller read the sidecar, and the loss is this one's (not "step": no training step record) */
    fprintf(stdout, "{\"loss\":%s,\"tokens\":%llu,\"batches\":%llu,\"checkpoint_step\":%d",
            json_num(b, sizeof b, loss),
            (unsigned long long)(batches * (uint64_t)c->train.batch_size * (uint64_t)c->model.seq_len),
            (unsigned long long)batches, r->resumed.step);
    answer_line_end();
    engine_shutdown();
    run_free(r);
    return 0;
}

/* The mode flag of the command line, "generate" or "evaluate", or NULL (training), found where
 * config_parse finds flags: a flag's value that spells one (a run named "--generate", --name
 * --generate) is that flag's value, and the run trains. */
static const char* command_line_mode(int argc, char** argv) {
    if (argv_flag_value(argc, argv, "generate")) return "generate";
    return argv_flag_value(argc, argv, "evaluate") ? "evaluate" : NULL;
}

/* main() of both engines: --generate (generate.h), --evaluate, or training. */
static int engine_main(int argc, char** argv) {
    const char* mode = command_line_mode(argc, argv);
    if (!mode) {
        int rc = train_main(argc, argv);
        /* stdout that could not take the records (a log file on a full disk): the run went on and
         * saved its checkpoints, but exit 0 would say its losses and events were all written */
        if (rc == 0 && g_stdout_errno)
            die_io("the run's records could not all be written to standard output (%s): the run went on and its "
                   "checkpoints are saved, but its losses and events are lost in part", strerror(g_stdout_errno));
        return rc;
    }
    signals_unblock();
    signal(SIGPIPE, SIG_IGN); /* a reader gone is a failed write, one error line (answer_line_end) */
    /* SIGUSR1 asks for a checkpoint and never stops an engine (§3.6); these modes have none to
     * write, so they go on: its default action killed a --generate server without a word */
    signal(SIGUSR1, SIG_IGN);
    fd_make_blocking(STDIN_FILENO);
    fd_make_blocking(STDOUT_FILENO);
    if (strcmp(mode, "generate") == 0) return generate_main(argc, argv);
    signals_install_bus_error(); /* a validation shard truncated under the mapping: one line, not a silent death */
    return evaluate_main(argc, argv);
}

#endif
