/* mixture.h: the data mixture and its adaptive mixer, the FIREHOSE bandit (docs/FIREHOSE-BANDIT.md).
 * Which source each micro-batch comes from is a pure function of (config, seed, step, bandit
 * state): micro-batch j of step index s draws u = rng(seed, STREAM_MIXTURE, s·grad_accum + j) and
 * takes the source where u falls in the cumulative probabilities p as they stood at the start of
 * step s. Without a bandit p is the prior weights; with one, p moves after every probe step, and
 * the state it moves by is written in the checkpoint's sidecar, so a resumed run draws exactly
 * what an unstopped one draws. Host code only (no engine calls): both engines share it.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_MIXTURE_H
#define MICROGPT_HOST_MIXTURE_H

#include "checkpoint.h"
#include "config.h"
#include "data.h"
#include "rng.h"
#include "schedule.h"

/* A normalised reward is clipped to this many standard deviations: one freak probe (a loss spike)
 * must not decide the mixture. */
#define BANDIT_Z_CLIP 3.0

typedef struct {
    int n;      /* sources: those of data.sources, or one for a plain data.train */
    int listed; /* data.sources was given: records carry the arms and per-source losses */
    const char* names[CFG_MAX_SOURCES];
    Dataset train[CFG_MAX_SOURCES];
    Dataset val[CFG_MAX_SOURCES];  /* n_shards 0: the source has no val glob */
    double prior[CFG_MAX_SOURCES]; /* weights / their sum */
    double p[CFG_MAX_SOURCES];     /* what the next step draws from */
    int n_active;                  /* sources with prior > 0: the bandit's arms */
    double eta;                    /* the bandit's learning rate, resolved */
    /* bandit state, kept in the sidecar */
    double gain[CFG_MAX_SOURCES];  /* G_i: importance-weighted sum of normalised rewards */
    double reward_mean, reward_var; /* running (exponentially decayed) statistics of raw rewards */
    int rounds;                     /* probe steps so far */
    uint32_t probe_crc; /* dataset_fingerprint of data.val, which the probes measure (the engine sets it) */
    /* probe loss at the start of step index probe_step (-1: none). A cache, not state: after a
     * resume it is measured again, on the same weights, to the same bits. */
    int probe_step;
    double probe_loss;
} Mixture;

/* Steps that train on the mixture (the polish phase trains on the polish shards alone). */
static int mixture_steps(const Config* c) { return c->polish.enabled ? c->polish.start_step : c->train.steps; }

/* p from the bandit state: (1-γ)·softmax(η·G + log prior) + γ/K over the K arms; the prior without
 * a bandit. Sources of weight 0 are never drawn. */
static void mixture_update_p(Mixture* m, const Config* c) {
    double top = -INFINITY, total = 0.0, gamma = c->bandit.gamma;
    int i;
    if (!c->bandit.enabled) {
        for (i = 0; i < m->n; i++) m->p[i] = m->prior[i];
        return;
    }
    for (i = 0; i < m->n; i++)
        if (m->prior[i] > 0.0 && m->eta * m->gain[i] + log(m->prior[i]) > top) top = m->eta * m->gain[i] + log(m->prior[i]);
    for (i = 0; i < m->n; i++) {
        m->p[i] = m->prior[i] > 0.0 ? exp(m->eta * m->gain[i] + log(m->prior[i]) - top) : 0.0;
        total += m->p[i];
    }
    for (i = 0; i < m->n; i++)
        m->p[i] = m->prior[i] > 0.0 ? (1.0 - gamma) * m->p[i] / total + gamma / m->n_active : 0.0;
}

static void mixture_reset_bandit(Mixture* m, const Config* c) {
    int i;
    for (i = 0; i < m->n; i++) m->gain[i] = 0.0;
    m->reward_mean = m->reward_var = 0.0;
    m->rounds = 0;
    m->probe_step = -1;
    mixture_update_p(m, c);
}

/* Opens every source's shards (errors name the flag) and sets the prior. */
static void mixture_open(Mixture* m, const Config* c) {
    int V = c->model.vocab_size, T = c->model.seq_len, i;
    double total = 0.0;
    char what[48];
    memset(m, 0, sizeof *m);
    m->listed = c->data.n_sources > 0;
    m->n = m->listed ? c->data.n_sources : 1;
    if (!m->listed) {
        m->names[0] = "train";
        dataset_open(&m->train[0], c->data.train, "data.train", V, T);
        m->prior[0] = 1.0;
    }
    for (i = 0; m->listed && i < m->n; i++) {
        const SourceConfig* s = &c->data.sources[i];
        m->names[i] = s->name;
        snprintf(what, sizeof what, "data.sources.%d.train", i);
        dataset_open(&m->train[i], s->train, what, V, T);
        snprintf(what, sizeof what, "data.sources.%d.val", i);
        if (s->val[0]) dataset_open(&m->val[i], s->val, what, V, T);
        m->prior[i] = s->weight;
        total += s->weight;
    }
    for (i = 0; m->listed && i < m->n; i++) m->prior[i] /= total;
    for (i = 0; i < m->n; i++) m->n_active += m->prior[i] > 0.0;
    m->eta = c->bandit.eta;
    if (c->bandit.enabled && m->eta == 0.0 && m->n_active > 1) { /* EXP3's rate for K arms over the run's probe steps */
        int rounds = mixture_steps(c) / c->bandit.every;
        m->eta = sqrt(log((double)m->n_active) / ((double)m->n_active * (rounds > 0 ? rounds : 1)));
    }
    mixture_reset_bandit(m, c);
}

static void mixture_close(Mixture* m) {
    int i;
    for (i = 0; i < m->n; i++) {
        if (m->train[i].n_shards) dataset_close(&m->train[i]);
        if (m->val[i].n_shards) dataset_close(&m->val[i]);
    }
}

/* Step index s is a probe step: the bandit scores the one source all its micro-batches come from. */
static int bandit_is_probe_step(const Config* c, int s) {
    return c->bandit.enabled && !in_polish(c, s) && (s + 1) % c->bandit.every == 0;
}

/* The source of micro-batch j of the `accum` of step index s (with several ranks, j and accum count
 * the micro-batches of all ranks: docs/DESIGN.md §17); on a probe step every micro-batch takes
 * j = 0's. */
static int mixture_arm(const Mixture* m, const Config* c, int s, int j, int accum) {
    uint64_t counter = (uint64_t)s * (uint64_t)accum + (uint64_t)(bandit_is_probe_step(c, s) ? 0 : j);
    double u = rng_uniform((uint64_t)c->train.seed, STREAM_MIXTURE, counter), acc = 0.0;
    int i, last = 0;
    for (i = 0; i < m->n; i++) {
        if (m->p[i] <= 0.0) continue;
        acc += m->p[i];
        last = i;
        if (u < acc) return i;
    }
    return last; /* u beyond a sum that rounding left just below 1 */
}

/* What one probe step taught the bandit (the "bandit" event). */
typedef struct {
    int arm;
    double loss_before, loss_after, drop, z;
    double reward[CFG_MAX_SOURCES]; /* importance-weighted estimate: z/p_arm for the arm, 0 for the others */
} BanditRound;

/* Probe steps that only measure, while the reward statistics settle: about the memory of their
 * decay, 1/(1 - reward_decay) (10 at the default 0.9), and at least 2. */
static int bandit_warmup_rounds(const Config* c) {
    int n = (int)ceil(1.0 / (1.0 - c->bandit.reward_decay) - 1e-9);
    return n < 2 ? 2 : n;
}

/* EXP3 update after a probe step that trained on source `arm`: the raw reward is the drop of the
 * probe loss over the step; it is normalised by the running mean and standard deviation of raw
 * rewards before this one (a common baseline: every arm is judged against the recent typical drop,
 * which removes the trend of the loss curve), clipped, and divided by p_arm (unbiased estimate). */
static void bandit_learn(Mixture* m, const Config* c, BanditRound* b) {
    double d = c->bandit.reward_decay, dev;
    int i;
    b->drop = b->loss_before - b->loss_after;
    b->z = 0.0;
    for (i = 0; i < m->n; i++) b->reward[i] = 0.0;
    /* a probe that overflowed says nothing about the source: no reward, and the statistics stay as
     * they were (taken as a drop of 0, it scored the arm (0 - mean)/sd, down to -3/p, and dragged
     * the baseline with it); the event shows the drop as null */
    if (!isfinite(b->drop)) return;
    dev = b->drop - m->reward_mean;
    if (m->rounds < bandit_warmup_rounds(c) || m->reward_var <= 0.0) b->z = 0.0; /* no scale yet: only measure */
    else b->z = dev / sqrt(m->reward_var);
    if (b->z > BANDIT_Z_CLIP) b->z = BANDIT_Z_CLIP;
    if (b->z < -BANDIT_Z_CLIP) b->z = -BANDIT_Z_CLIP;
    for (i = 0; i < m->n; i++) b->reward[i] = i == b->arm ? b->z / m->p[i] : 0.0;
    m->gain[b->arm] += b->reward[b->arm];
    if (m->rounds == 0) m->reward_mean = b->drop;
    else {
        m->reward_mean += (1.0 - d) * dev;
        m->reward_var = d * (m->reward_var + (1.0 - d) * dev * dev);
    }
    m->rounds++;
    mixture_update_p(m, c);
}

/* ---------------------------------------------------------------------------------------------- */
/* State in the sidecar, exact: doubles as %.17g, which strtod reads back to the same bits */

static void put_double(char* buf, size_t cap, double x) { snprintf(buf, cap, isfinite(x) ? "%.17g" : "null", x); }

/* The CRC-32C of the source names in order, each with its terminating NUL ("ab","c" is not "a","bc"):
 * the gains belong to sources by name, so a resume must know they are the same sources in the same
 * order. A number, not the names: a name written as a JSON string could read as a member name
 * ("step", "crc32c") to the readers that find members by name. */
static uint32_t mixture_names_crc(const Mixture* m) {
    uint32_t crc = 0;
    int i;
    for (i = 0; i < m->n; i++) crc = crc32c_update(crc, m->names[i], strlen(m->names[i]) + 1);
    return crc;
}

/* The sidecar members of the bandit state, ",\"bandit\":{...}", or "" without a bandit. */
static void mixture_sidecar_json(const Mixture* m, const Config* c, char* out, size_t cap) {
    char x[40];
    size_t len;
    int k, i;
    out[0] = '\0';
    if (!c->bandit.enabled) return;
    len = (size_t)snprintf(out, cap, ",\"bandit\":{\"rounds\":%d,\"reward_mean\":", m->rounds);
    put_double(x, sizeof x, m->reward_mean);
    len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, "%s,\"reward_var\":", x);
    put_double(x, sizeof x, m->reward_var);
    len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, "%s", x);
    for (k = 0; k < 2; k++) { /* the gains (the state) and p (for people: derived from the gains) */
        len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, k ? "],\"p\":[" : ",\"gain\":[");
        for (i = 0; i < m->n; i++) {
            put_double(x, sizeof x, k ? m->p[i] : m->gain[i]);
            len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, "%s%s", i ? "," : "", x);
        }
    }
    len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, "],\"probe_crc32c\":%lu,\"sources_crc32c\":%lu}",
                            (unsigned long)m->probe_crc, (unsigned long)mixture_names_crc(m));
    if (len >= cap) die_io("internal: the bandit state does not fit the sidecar buffer");
}

/* The finite numbers of the JSON array after "key": in text (any JSON whitespace between its
 * tokens), at most max; returns how many, -1 if absent, not such an array, or longer. */
static int json_find_array(const char* text, const char* key, double* out, int max) {
    const char* p = json_find_member(text, key);
    char* end;
    int n = 0;
    if (!p || *(p = json_skip_space(p)) != '[') return -1;
    for (p++; *(p = json_skip_space(p)) != ']'; n++) {
        double x;
        if (n && *p++ != ',') return -1;
        p = json_skip_space(p);
        x = strtod(p, &end);
        if (end == p || n == max || !isfinite(x)) return -1; /* strtod takes "nan" and "inf": JSON has neither */
        out[n] = x;
        p = end;
    }
    return n;
}

/* The largest raw reward a run can leave: a probe loss is a float (engine_forward_loss) and not
 * negative, so no drop exceeds FLT_MAX in size, nor does their running mean (an average of drops);
 * a deviation from it stays within 2·FLT_MAX, so the running variance stays below (2·FLT_MAX)². */
#define BANDIT_REWARD_MAX ((double)FLT_MAX)

/* Restores the bandit state from `text`, the sidecar `side` of the checkpoint being resumed
 * (mixture_resume). A sidecar without it
 * (the checkpoint of a run without a bandit), with another number of sources or other names (or
 * order: the gains belong to sources by name), or with a state no
 * run leaves (a gain that is no finite number, a mean or variance beyond what drops of float
 * losses give (BANDIT_REWARD_MAX: a mean of 1e308 overflowed the next round's variance to inf,
 * which silenced every later reward and wrote "reward_var":null), a negative variance, a count of
 * rounds that is no int or more than the `done` steps before the checkpoint (at most one probe a
 * step: so the count cannot overflow however long the run goes on), gains whose probabilities
 * overflow; the bandit state has no checksum of its own) starts the bandit afresh, with a warning:
 * drawing from probabilities that are no numbers would pick the sources by accident. A state
 * restored from probes of other data.val shards (probe_crc32c) goes on, with a warning. */
static void mixture_restore(Mixture* m, const Config* c, const char* side, const char* text, int done) {
    double x, gain[CFG_MAX_SOURCES], mean, var;
    int n, i, finite_p, found;
    n = json_find_array(text, "gain", gain, CFG_MAX_SOURCES);
    if (n >= 0 && n != m->n) {
        warn("the bandit state in %s does not fit %d data sources: the bandit starts afresh", side, m->n);
        return;
    }
    if (n >= 0 && !(json_find_number(text, "sources_crc32c", &x) && x == (double)mixture_names_crc(m))) {
        char list[CFG_MAX_SOURCES * (CFG_NAME_MAX + 1)];
        size_t len = 0;
        for (i = 0; i < m->n; i++)
            len += (size_t)snprintf(list + len, sizeof list - len, "%s%s", i ? "," : "", m->names[i]);
        warn("the bandit state in %s is not that of the data sources %s in this order: the bandit starts afresh",
             side, list);
        return;
    }
    if (n < 0 || !json_find_number(text, "rounds", &x) || !(x >= 0 && x <= done && x == floor(x)) ||
        !json_find_number(text, "reward_mean", &mean) || !(fabs(mean) <= BANDIT_REWARD_MAX) ||
        !json_find_number(text, "reward_var", &var) || !(var >= 0 && var <= 4.0 * BANDIT_REWARD_MAX * BANDIT_REWARD_MAX)) {
        warn("the bandit state in %s is not well-formed (damaged or edited): the bandit starts afresh", side);
        return;
    }
    for (i = 0; i < n; i++) m->gain[i] = gain[i];
    m->reward_mean = mean;
    m->reward_var = var;
    m->rounds = (int)x;
    mixture_update_p(m, c);
    for (i = 0, finite_p = 1; i < m->n; i++) finite_p = finite_p && isfinite(m->p[i]);
    if (!finite_p) {
        warn("the bandit state in %s gives probabilities that are no numbers (damaged or edited): the bandit "
             "starts afresh", side);
        mixture_reset_bandit(m, c);
        return;
    }
    /* the probes decide the draws: on another data.val they score the sources otherwise, and
     * data_crc32c covers the training shards only (a sidecar from before the member says nothing;
     * one whose member is no number, which no checksum covers, says it cannot tell) */
    found = json_optional_number(text, "probe_crc32c", &x);
    if (found > 0 && x != (double)m->probe_crc)
        warn("the bandit state in %s was learned on other data.val shards than this run's, which its probes "
             "measure: the run goes on from it, no longer as the run it continues would have", side);
    else if (found < 0)
        warn("the bandit state in %s holds a probe_crc32c that is no number (damaged or edited): whether its probes "
             "measured this run's data.val shards is unknown; the run goes on from it", side);
}

/* The bandit state from `sidecar`, that of the checkpoint `ckpt_path` being resumed after `done` steps. */
static void mixture_resume(Mixture* m, const Config* c, const char* ckpt_path, const Sidecar* sidecar, int done) {
    char side[CFG_PATH_MAX + 8];
    if (!c->bandit.enabled) return;
    snprintf(side, sizeof side, "%s.json", ckpt_path);
    if (sidecar->text && json_has_member(sidecar->text, "bandit")) mixture_restore(m, c, side, sidecar->text, done);
    else warn("checkpoint %s holds no bandit state: the bandit starts afresh from the prior weights", ckpt_path);
}

/* ---------------------------------------------------------------------------------------------- */
/* Output */

static void emit_double_array(const double* xs, int n) {
    char b[32];
    int i;
    fputc('[', stdout);
    for (i = 0; i < n; i++) fprintf(stdout, "%s%s", i ? "," : "", json_num(b, sizeof b, xs[i]));
    fputc(']', stdout);
}

/* ,"sources":[names],"p":[...] for the start event of a run with data.sources. */
static void emit_mixture_fields(const Mixture* m) {
    int i;
    if (!m->listed) return;
    fputs(",\"sources\":[", stdout);
    for (i = 0; i < m->n; i++) {
        if (i) fputc(',', stdout);
        json_put_string(stdout, m->names[i]);
    }
    fputs("],\"p\":", stdout);
    emit_double_array(m->p, m->n);
}

/* {"event":"bandit","step":s,"arm":i,"probe_loss":L,"drop":d,"z":z,"reward":[...],"p":[...]}:
 * after probe step s (completed steps); p is what the following steps draw from. */
static void emit_bandit(int step, const Mixture* m, const BanditRound* b) {
    char b1[32], b2[32], b3[32];
    fprintf(stdout, "{\"event\":\"bandit\",\"step\":%d,\"arm\":%d,\"probe_loss\":%s,\"drop\":%s,\"z\":%s,\"reward\":",
            step, b->arm, json_num(b1, sizeof b1, b->loss_after), json_num(b2, sizeof b2, b->drop),
            json_num(b3, sizeof b3, b->z));
    emit_double_array(b->reward, m->n);
    fputs(",\"p\":", stdout);
    emit_double_array(m->p, m->n);
    jline_end();
}

#endif
