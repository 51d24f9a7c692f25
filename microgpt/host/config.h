/* config.h: the Config struct and the one flag table that drives parsing, defaults, --help and
 * validation. Every flag is the dotted path of its key in the experiment JSON (docs/DESIGN.md), so
 * `{"train": {"lr": 6e-4}}` becomes `--train.lr 6e-4`. Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_CONFIG_H
#define MICROGPT_HOST_CONFIG_H

#include "../cpu/fp8.h"
#include "output.h"
#include <ctype.h>
#include <errno.h>
#include <limits.h>

#define CFG_PATH_MAX 1024
#define CFG_MAX_PROMPTS 64
#define CFG_MAX_SOURCES 32
#define CFG_MAX_LAYERS 1024
#define CFG_NAME_MAX 64
/* train.precision's values: the flag's choices, and what a checkpoint's sidecar may name (generate.h) */
#define CFG_PRECISIONS "fp32|tf32|bf16|fp16|fp8"
/* train.fp8_classifier's values: the flag's choices, and what a sidecar may record (checkpoint.h) */
#define CFG_FP8_CLASSIFIERS "off|logits|all"

/* One data source of a mixture (docs/FIREHOSE-BANDIT.md): --data.sources.N.{name,train,val,weight}. */
typedef struct {
    char name[CFG_NAME_MAX];
    char train[CFG_PATH_MAX], val[CFG_PATH_MAX]; /* globs; val "" = none */
    float weight;                                /* prior weight >= 0; 0: evaluated, never trained on */
} SourceConfig;

#define CFG_MAX_STOP 16

/* ChatML's special tokens in the ANDREA vocabulary (microgpt/tokenizer.py IM_START, IM_END). */
#define TOKEN_IM_START 50257
#define TOKEN_IM_END 50258

typedef struct {
    char name[128];
    struct {
        int n_layer, d_model, n_head, d_ff, seq_len, vocab_size, padded_vocab_size;
    } model;
    struct {
        int batch_size, grad_accum, steps, seed, warmup_steps;
        char precision[8]; /* fp32 | tf32 | bf16 | fp16 | fp8 */
        char fp8_classifier[8]; /* off | logits | all: config_fp8_classifier */
        float lr, min_lr, weight_decay, grad_clip, beta1, beta2, eps;
        char schedule[16]; /* cosine | wsd | constant */
        float decay_frac;  /* WSD: fraction of steps spent decaying */
    } train;
    struct {
        char train[CFG_PATH_MAX], val[CFG_PATH_MAX]; /* globs; train "" = data.sources given; val "" = none */
        int n_sources;                               /* derived: highest --data.sources.N.* index + 1 */
        SourceConfig sources[CFG_MAX_SOURCES];
    } data;
    struct {
        int enabled; /* derived: --bandit.every given */
        int every, probe_batches;
        float gamma, eta, reward_decay; /* eta 0: sqrt(ln K / (K * rounds)) */
    } bandit;
    struct {
        int every, batches;
    } eval;
    struct {
        int every, tokens, top_k;
        float temperature;
        /* prompt i is prompt_tokens[prompt_start[i] .. prompt_start[i+1]) */
        int n_prompts;
        int prompt_start[CFG_MAX_PROMPTS + 1];
        int* prompt_tokens;
        /* "auto": ChatML prompts (holding <|im_start|>) stop at <|im_end|> when the vocabulary has
         * it; "none"; or comma-separated ids that end every sample (parsed into stop_ids) */
        char stop[128];
        int n_stop;
        int stop_ids[CFG_MAX_STOP];
    } sample;
    struct {
        int enabled;   /* --generate: serve generation requests (docs/DESIGN.md §5a) */
        int max_batch; /* requests decoded together (KV-cache slots) */
    } generate;
    struct {
        int every;
        char path[CFG_PATH_MAX]; /* --checkpoint; "" = never write */
    } checkpoint;
    struct {
        int enabled;    /* derived: --polish.start_step given */
        int start_step; /* step index from which polish data + constant polish LR apply */
        char train[CFG_PATH_MAX];
        float lr;
    } polish;
    int resume;
    int layout_json; /* --layout-json: print the parameter layout (params.h) and exit */
    char dump_grads[CFG_PATH_MAX]; /* "" = off */
    int evaluate; /* --evaluate (docs/DESIGN.md §5a); neither it nor --generate: training */
} Config;

/* ---------------------------------------------------------------------------------------------- */
/* The flag table */

/* Text flags (F_STR, F_PATH, F_GLOB) parse alike; the kind tells the proxy what a value means
 * (a path or glob resolves against the repository root). F_PROMPT is the repeatable token-id list. */
typedef enum { F_INT, F_FLOAT, F_STR, F_PATH, F_GLOB, F_PROMPT, F_BOOL } FlagType;
static const char* const FLAG_TYPE_NAMES[] = {"int", "float", "str", "path", "glob", "prompt", "bool"};

/* REQ_IN_SECTION: required as soon as any flag of the same section ("polish." ...) is given, so a
 * section is all there or all absent. */
enum { REQ_NO = 0, REQ_YES = 1, REQ_IN_SECTION = 2 };

typedef struct {
    const char* name;    /* without the leading "--" */
    FlagType type;
    void* ptr;           /* into the Config being parsed */
    size_t cap;          /* text flags: buffer size */
    const char* def;     /* default as text; NULL: required, derived (see help) or none */
    int required;        /* REQ_* */
    const char* choices; /* text flags: "a|b|c" allowed values, or NULL for any */
    double min, max;     /* F_INT / F_FLOAT: allowed closed range */
    const char* help;
    int items;           /* list-item flag "list.N.key" (N = 0 .. items-1), or 0 for a plain flag */
    size_t stride;       /* list-item flags: bytes from item N's value to item N+1's */
    const char* one_of;  /* "a|b": config keys of which exactly one must be given, or NULL */
} Flag;

#define CFG_N_FLAGS_MAX 64

/* Fills `f` with the table bound to `c`; returns the number of flags. One list, used for
 * everything, so a flag can't be parsed but missing from --help or the other way round. */
static int config_flags(Config* c, Flag* f) {
    int n = 0;
    /* AdamW moves every weight by about lr per step whatever the gradient's size: at lr 1 a weight
     * initialised at std 0.02 moves 50 times its size each step. Beyond that no run trains. */
    const double BIG = 2147483647.0, FBIG = 1e30, LR_MAX = 1.0;
#define FLAG(NAME, TYPE, PTR, CAP, DEF, REQ, CHOICES, MIN, MAX, HELP)                          \
    do {                                                                                         \
        if (n == CFG_N_FLAGS_MAX) die_io("internal: more than CFG_N_FLAGS_MAX flags in config_flags"); \
        f[n].name = NAME; f[n].type = TYPE; f[n].ptr = (void*)(PTR); f[n].cap = CAP;             \
        f[n].def = DEF; f[n].required = REQ; f[n].choices = CHOICES; f[n].min = MIN;             \
        f[n].max = MAX; f[n].help = HELP; f[n].items = 0; f[n].stride = 0; f[n].one_of = NULL; n++; \
    } while (0)
    /* A field of each item of the data.sources list: --data.sources.N.KEY; REQ_YES means required
     * in every item given. */
#define SOURCE_FLAG(KEY, TYPE, MEMBER, CAP, DEF, REQ, MIN, MAX, HELP)                              \
    do {                                                                                         \
        FLAG("data.sources.N." KEY, TYPE, &c->data.sources[0].MEMBER, CAP, DEF, REQ, NULL, MIN, MAX, HELP); \
        f[n - 1].items = CFG_MAX_SOURCES; f[n - 1].stride = sizeof(SourceConfig);                \
    } while (0)
    FLAG("name", F_STR, c->name, sizeof c->name, "run", 0, NULL, 0, 0, "run name (reported only)");
    FLAG("model.n_layer", F_INT, &c->model.n_layer, 0, NULL, 1, NULL, 1, CFG_MAX_LAYERS, "transformer layers");
    FLAG("model.d_model", F_INT, &c->model.d_model, 0, NULL, 1, NULL, 1, 65536, "embedding width");
    FLAG("model.n_head", F_INT, &c->model.n_head, 0, NULL, 1, NULL, 1, 65536, "attention heads (must divide d_model)");
    FLAG("model.d_ff", F_INT, &c->model.d_ff, 0, NULL, 0, NULL, 1, 1 << 20, "MLP width (default 4*d_model)");
    FLAG("model.seq_len", F_INT, &c->model.seq_len, 0, NULL, 1, NULL, 1, 1 << 20, "context length T");
    FLAG("model.vocab_size", F_INT, &c->model.vocab_size, 0, "50259", 0, NULL, 2, 1 << 24, "real vocabulary size");
    FLAG("model.padded_vocab_size", F_INT, &c->model.padded_vocab_size, 0, NULL, 0, NULL, 2, 1 << 24,
         "embedding rows (default vocab_size rounded up to 64)");
    FLAG("train.batch_size", F_INT, &c->train.batch_size, 0, "8", 0, NULL, 1, 1 << 20, "sequences per micro-batch B");
    FLAG("train.grad_accum", F_INT, &c->train.grad_accum, 0, "1", 0, NULL, 1, 1 << 20, "micro-batches per optimizer step");
    FLAG("train.steps", F_INT, &c->train.steps, 0, NULL, 1, NULL, 1, BIG, "optimizer steps in the whole run");
    FLAG("train.seed", F_INT, &c->train.seed, 0, "1337", 0, NULL, 0, BIG, "seed for init, batches and sampling");
    FLAG("train.warmup_steps", F_INT, &c->train.warmup_steps, 0, "0", 0, NULL, 0, BIG, "linear LR warmup steps");
    FLAG("train.precision", F_STR, c->train.precision, sizeof c->train.precision, "fp32", 0, CFG_PRECISIONS, 0,
         0, "compute precision: tf32 is fp32 with TF32 tensor-core products (the CPU engine always computes fp32)");
    FLAG("train.fp8_classifier", F_STR, c->train.fp8_classifier, sizeof c->train.fp8_classifier, "all", 0,
         CFG_FP8_CLASSIFIERS, 0, 0, "precision fp8, where that pays (model.d_model >= 512): all three of the tied "
         "classifier's products in FP8 (all, dlogits rounded stochastically), the logits product alone (logits), or "
         "none (off)");
    FLAG("train.lr", F_FLOAT, &c->train.lr, 0, "6e-4", 0, NULL, 0, LR_MAX, "peak learning rate");
    FLAG("train.min_lr", F_FLOAT, &c->train.min_lr, 0, "0", 0, NULL, 0, LR_MAX, "final learning rate of the decay");
    FLAG("train.weight_decay", F_FLOAT, &c->train.weight_decay, 0, "0.1", 0, NULL, 0, FBIG, "AdamW decoupled weight decay (2-D tensors only); times the highest lr, below 1");
    FLAG("train.grad_clip", F_FLOAT, &c->train.grad_clip, 0, "1.0", 0, NULL, 0, FBIG, "clip global grad L2 norm to this (0: off)");
    FLAG("train.beta1", F_FLOAT, &c->train.beta1, 0, "0.9", 0, NULL, 0, 0.999999, "AdamW beta1");
    /* beta2 is held as a float: 0.99999997 and up round to 1.0f, whose bias correction 1 - beta2^t is 0
     * (the first step's update 0/0, a divergence); 0.99999994 is the float just below 1 */
    FLAG("train.beta2", F_FLOAT, &c->train.beta2, 0, "0.95", 0, NULL, 0, 0.99999994, "AdamW beta2");
    FLAG("train.eps", F_FLOAT, &c->train.eps, 0, "1e-8", 0, NULL, 1e-30, 1, "AdamW epsilon");
    FLAG("train.schedule", F_STR, c->train.schedule, sizeof c->train.schedule, "cosine", 0, "cosine|wsd|constant", 0, 0,
         "LR schedule after warmup");
    FLAG("train.decay_frac", F_FLOAT, &c->train.decay_frac, 0, "0.2", 0, NULL, 0, 1, "WSD: fraction of steps spent decaying");
    FLAG("data.train", F_GLOB, c->data.train, sizeof c->data.train, "", 0, NULL, 0, 0,
         "glob of llm.c train shards (one source; or give data.sources)");
    f[n - 1].one_of = "data.train|data.sources";
    FLAG("data.val", F_GLOB, c->data.val, sizeof c->data.val, "", 0, NULL, 0, 0, "glob of llm.c validation shards");
    SOURCE_FLAG("name", F_STR, name, CFG_NAME_MAX, NULL, REQ_YES, 0, 0,
                "name of data source N = 0, 1, ... (letters, digits, . _ -); every source has one");
    SOURCE_FLAG("train", F_GLOB, train, CFG_PATH_MAX, NULL, REQ_YES, 0, 0, "glob of source N's train shards; every source has one");
    SOURCE_FLAG("val", F_GLOB, val, CFG_PATH_MAX, "", REQ_NO, 0, 0, "glob of source N's validation shards (val_loss_by_source)");
    SOURCE_FLAG("weight", F_FLOAT, weight, 0, "1", REQ_NO, 0, FBIG,
                "source N's prior weight (static mixture: its share; 0: evaluated only)");
    FLAG("bandit.every", F_INT, &c->bandit.every, 0, NULL, REQ_IN_SECTION, NULL, 1, BIG,
         "adaptive mixture: a probe step every N steps (docs/FIREHOSE-BANDIT.md)");
    FLAG("bandit.gamma", F_FLOAT, &c->bandit.gamma, 0, "0.1", 0, NULL, 0, 1, "bandit exploration: share spread evenly over the sources");
    FLAG("bandit.eta", F_FLOAT, &c->bandit.eta, 0, "0", 0, NULL, 0, FBIG,
         "bandit learning rate (0: sqrt(ln K / (K * probe steps)))");
    FLAG("bandit.probe_batches", F_INT, &c->bandit.probe_batches, 0, "2", 0, NULL, 1, 1 << 20,
         "validation batches of the probe that scores a source");
    FLAG("bandit.reward_decay", F_FLOAT, &c->bandit.reward_decay, 0, "0.9", 0, NULL, 0, 0.999999,
         "decay of the running mean and variance that normalise rewards");
    FLAG("eval.every", F_INT, &c->eval.every, 0, "0", 0, NULL, 0, BIG, "validate every N steps (0: off)");
    FLAG("eval.batches", F_INT, &c->eval.batches, 0, "20", 0, NULL, 0, BIG,
         "validation batches per evaluation (0: every whole non-overlapping window of the shards, in order)");
    FLAG("sample.every", F_INT, &c->sample.every, 0, "0", 0, NULL, 0, BIG, "sample every N steps (0: off)");
    FLAG("sample.tokens", F_INT, &c->sample.tokens, 0, "64", 0, NULL, 1, 1 << 20, "tokens generated per prompt");
    FLAG("sample.top_k", F_INT, &c->sample.top_k, 0, "40", 0, NULL, 0, 1 << 24, "top-k sampling (0: whole vocabulary)");
    FLAG("sample.temperature", F_FLOAT, &c->sample.temperature, 0, "1.0", 0, NULL, 0, FBIG, "sampling temperature (0: greedy)");
    FLAG("sample.prompt", F_PROMPT, &c->sample, 0, NULL, 0, NULL, 0, 0, "comma-separated token ids of one prompt (repeatable)");
    FLAG("sample.stop", F_STR, c->sample.stop, sizeof c->sample.stop, "auto", 0, NULL, 0, 0,
         "token ids that end a sample (comma-separated), none, or auto: <|im_end|> for prompts holding <|im_start|>");
    FLAG("generate.max_batch", F_INT, &c->generate.max_batch, 0, "8", 0, NULL, 1, 1024,
         "--generate: most requests decoded together (KV-cache slots)");
    FLAG("checkpoint.every", F_INT, &c->checkpoint.every, 0, "0", 0, NULL, 0, BIG, "checkpoint every N steps (0: only on signal/finish)");
    FLAG("checkpoint", F_PATH, c->checkpoint.path, sizeof c->checkpoint.path, "", 0, NULL, 0, 0,
         "checkpoint path (sidecar PATH.json)");
    FLAG("polish.start_step", F_INT, &c->polish.start_step, 0, NULL, REQ_IN_SECTION, NULL, 0, BIG,
         "step index from which polish data and constant polish LR apply");
    FLAG("polish.train", F_GLOB, c->polish.train, sizeof c->polish.train, "", REQ_IN_SECTION, NULL, 0, 0, "glob of polish train shards");
    FLAG("polish.lr", F_FLOAT, &c->polish.lr, 0, NULL, REQ_IN_SECTION, NULL, 0, LR_MAX, "constant learning rate of the polish phase");
    FLAG("resume", F_BOOL, &c->resume, 0, "0", 0, NULL, 0, 0, "continue from --checkpoint (must exist)");
    FLAG("dump-grads", F_PATH, c->dump_grads, sizeof c->dump_grads, "", 0, NULL, 0, 0,
         "debug: write [f32 loss][f32 grads] of step 0, micro-batch 0, to PATH and exit");
    FLAG("generate", F_BOOL, &c->generate.enabled, 0, "0", 0, NULL, 0, 0,
         "serve generation requests (JSON lines on stdin) from --checkpoint; model flags default to its sidecar");
    FLAG("evaluate", F_BOOL, &c->evaluate, 0, "0", 0, NULL, 0, 0,
         "print the loss of --checkpoint on --data.val as one JSON line; model flags default to its sidecar");
#undef SOURCE_FLAG
#undef FLAG
    return n;
}

/* " [required]", " [default X]" or "" : the same facts --flags-json gives as fields. */
static void flag_help_note(FILE* out, const Flag* f) {
    const char* section_end = strchr(f->name, '.');
    if (f->required == REQ_YES) fputs(" [required]", out);
    else if (f->required == REQ_IN_SECTION)
        fprintf(out, " [required with any --%.*s.* flag]", (int)(section_end - f->name), f->name);
    else if (f->def && f->def[0] && f->type != F_BOOL) fprintf(out, " [default %s]", f->def);
}

static void config_help(FILE* out, const char* prog) {
    Config c;
    Flag f[CFG_N_FLAGS_MAX];
    int i, n = config_flags(&c, f);
    fprintf(out, "usage: %s --model.n_layer N --model.d_model N --model.n_head N --model.seq_len N "
                 "--train.steps N (--data.train GLOB | --data.sources.N.name S --data.sources.N.train GLOB ...) [flags]\n"
                 "Flags are the dotted keys of the experiment JSON; --x=v and --x v both work.\n\n", prog);
    for (i = 0; i < n; i++) {
        char left[64];
        snprintf(left, sizeof left, "--%s %s", f[i].name,
                 f[i].choices ? f[i].choices : f[i].type == F_BOOL ? "" : FLAG_TYPE_NAMES[f[i].type]);
        fprintf(out, "  %-36s %s", left, f[i].help);
        flag_help_note(out, &f[i]);
        fputc('\n', out);
    }
    fprintf(out, "  %-36s %s\n", "--flags-json", "print this table as one JSON document and exit");
    fprintf(out, "  %-36s %s\n", "--print-config", "print every flag's value, defaults applied, as JSON and exit");
    fprintf(out, "  %-36s %s\n", "--layout-json", "print the model's parameter tensors (names, shapes, offsets) as JSON and exit");
    fprintf(out, "  %-36s %s\n", "--help", "show this help and exit");
}

/* A flag's default (or range end) as a JSON value of its type; null when there is none. */
static void flag_json_value(FILE* out, const Flag* f, const char* text) {
    char b[32];
    if (!text || !text[0]) fputs("null", out); /* "" is a text flag's "none" */
    else if (f->type == F_INT) fprintf(out, "%lld", strtoll(text, NULL, 10));
    else if (f->type == F_FLOAT) fputs(json_num(b, sizeof b, strtod(text, NULL)), out);
    else if (f->type == F_BOOL) fputs(strcmp(text, "1") == 0 ? "true" : "false", out);
    else json_put_string(out, text);
}

static void flag_json_choices(FILE* out, const char* choices) {
    const char* p = choices;
    if (!choices) {
        fputs("null", out);
        return;
    }
    fputc('[', out);
    while (*p) {
        const char* bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        fprintf(out, "%s\"%.*s\"", p == choices ? "" : ",", (int)len, p);
        p += len + (bar != NULL);
    }
    fputc(']', out);
}

/* --flags-json: the flag table for programs (the proxy validates experiment configs against it),
 * {"flags":[{"name","type","default","required","choices","min","max","help"[,"items"][,"one_of"]}, ...]}.
 * required is true, false or "section" (REQ_IN_SECTION); min/max are null for non-numbers. A flag
 * "list.N.key" with "items":n is the field `key` of each item of the config list `list` (at most n
 * items; required: in every item); "one_of" lists config keys of which exactly one must be given. */
static void config_flags_json(FILE* out) {
    Config c;
    Flag f[CFG_N_FLAGS_MAX];
    int i, n = config_flags(&c, f);
    fputs("{\"flags\":[", out);
    for (i = 0; i < n; i++) {
        int numeric = f[i].type == F_INT || f[i].type == F_FLOAT;
        char lo[32], hi[32];
        fprintf(out, "%s\n{\"name\":", i ? "," : "");
        json_put_string(out, f[i].name);
        fprintf(out, ",\"type\":\"%s\",\"default\":", FLAG_TYPE_NAMES[f[i].type]);
        flag_json_value(out, &f[i], f[i].def);
        fprintf(out, ",\"required\":%s,\"choices\":",
                f[i].required == REQ_IN_SECTION ? "\"section\"" : f[i].required ? "true" : "false");
        flag_json_choices(out, f[i].choices);
        snprintf(lo, sizeof lo, "%.17g", f[i].min);
        snprintf(hi, sizeof hi, "%.17g", f[i].max);
        fputs(",\"min\":", out);
        flag_json_value(out, &f[i], numeric ? lo : NULL);
        fputs(",\"max\":", out);
        flag_json_value(out, &f[i], numeric ? hi : NULL);
        fputs(",\"help\":", out);
        json_put_string(out, f[i].help);
        if (f[i].items) fprintf(out, ",\"items\":%d", f[i].items);
        if (f[i].one_of) {
            fputs(",\"one_of\":", out);
            flag_json_choices(out, f[i].one_of);
        }
        fputc('}', out);
    }
    fputs("\n]}\n", out);
}

/* --print-config: every flag's value once the command line is parsed, defaults and derived defaults
 * applied (each value range-checked, but not yet the required flags and cross-flag rules), as one
 * JSON object keyed by flag name ({"model.d_ff":3072,"train.lr":0.000600000028,...};
 * floats as the engine holds them, prompts as lists of token ids, a list-item flag as the list of
 * its values, one per source given). Programs that need the engine's
 * settings (bench/) read them here instead of repeating its defaults. */
static void config_print_json(FILE* out, Config* c) {
    Flag f[CFG_N_FLAGS_MAX];
    int i, n = config_flags(c, f);
    char b[32];
    fputc('{', out);
    for (i = 0; i < n; i++) {
        int item;
        fputs(i ? ",\n" : "\n", out);
        json_put_string(out, f[i].name);
        fputc(':', out);
        if (f[i].items) { /* one value per source given */
            fputc('[', out);
            for (item = 0; item < c->data.n_sources; item++) {
                const void* p = (const char*)f[i].ptr + (size_t)item * f[i].stride;
                if (item) fputc(',', out);
                if (f[i].type == F_FLOAT) fputs(json_num(b, sizeof b, *(const float*)p), out);
                else json_put_string(out, (const char*)p);
            }
            fputc(']', out);
            continue;
        }
        switch (f[i].type) {
        case F_INT: fprintf(out, "%d", *(int*)f[i].ptr); break;
        case F_FLOAT: fputs(json_num(b, sizeof b, *(float*)f[i].ptr), out); break;
        case F_BOOL: fputs(*(int*)f[i].ptr ? "true" : "false", out); break;
        case F_STR:
        case F_PATH:
        case F_GLOB: json_put_string(out, (const char*)f[i].ptr); break;
        case F_PROMPT: {
            int p, k;
            fputc('[', out);
            for (p = 0; p < c->sample.n_prompts; p++) {
                fputs(p ? ",[" : "[", out);
                for (k = c->sample.prompt_start[p]; k < c->sample.prompt_start[p + 1]; k++)
                    fprintf(out, k > c->sample.prompt_start[p] ? ",%d" : "%d", c->sample.prompt_tokens[k]);
                fputc(']', out);
            }
            fputc(']', out);
            break;
        }
        }
    }
    fputs("\n}\n", out);
}

/* ---------------------------------------------------------------------------------------------- */
/* Parsing */

/* Whether a number's text starts as a decimal number does: strtoll and strtod would also take
 * leading blanks (" 5", while "5 " is refused) and strtod hexadecimal ("0x1p-3", while the integer
 * flags refuse "0x10"). */
static int decimal_start(const char* s) {
    const char* p = s + (*s == '-' || *s == '+');
    return (isdigit((unsigned char)*p) || (*p == '.' && isdigit((unsigned char)p[1]))) &&
           !(p[0] == '0' && (p[1] == 'x' || p[1] == 'X'));
}

static long long parse_int_or_die(const char* flag, const char* s) {
    char* end;
    long long v;
    errno = 0;
    v = strtoll(s, &end, 10);
    if (errno || end == s || *end || !decimal_start(s)) die_input("--%s: '%s' is not an integer", flag, s);
    return v;
}

static double parse_float_or_die(const char* flag, const char* s) {
    char* end;
    double v;
    errno = 0;
    v = strtod(s, &end);
    if (errno == ERANGE && fabs(v) > 1.0) die_input("--%s: '%s' is out of range", flag, s);
    /* underflow: strtod gives 0 for a number that is not (0 means "off" to several flags) */
    if (errno == ERANGE && v == 0.0)
        die_input("--%s: '%s' is too small for a double, which would hold it as 0", flag, s);
    if (end == s || *end || !isfinite(v) || !decimal_start(s)) die_input("--%s: '%s' is not a finite number", flag, s);
    return v;
}

/* Ids in "50257,882,198" (one more than its commas: the caller's capacity) into out; returns how
 * many. Ids are checked against vocab_size later, once all flags (in any order) are known. */
static int count_ids(const char* s) {
    int n = 1;
    for (; *s; s++) n += (*s == ',');
    return n;
}

static int parse_ids(const char* flag, const char* s, int* out) {
    const char* p = s;
    char* end;
    int n = 0;
    for (;;) {
        long v;
        errno = 0;
        v = strtol(p, &end, 10);
        if (errno || end == p || !isdigit((unsigned char)*p) || v > INT_MAX || (*end != ',' && *end != '\0'))
            die_input("--%s: '%s' is not a comma-separated list of token ids", flag, s);
        out[n++] = (int)v;
        if (*end == '\0') return n;
        p = end + 1;
    }
}

/* "--sample.prompt 50257,882,198": append one prompt. */
static void parse_prompt(Config* c, const char* s) {
    int k = c->sample.prompt_start[c->sample.n_prompts];
    if (c->sample.n_prompts >= CFG_MAX_PROMPTS) die_input("--sample.prompt: at most %d prompts", CFG_MAX_PROMPTS);
    c->sample.prompt_tokens = (int*)realloc(c->sample.prompt_tokens, (size_t)(k + count_ids(s)) * sizeof(int));
    if (!c->sample.prompt_tokens) die_io("out of memory parsing prompts");
    c->sample.n_prompts++;
    c->sample.prompt_start[c->sample.n_prompts] = k + parse_ids("sample.prompt", s, c->sample.prompt_tokens + k);
}

/* --sample.stop: "auto" and "none" keep n_stop 0 (auto is resolved per prompt: sample_stop_ids). */
static void parse_stop(Config* c) {
    const char* s = c->sample.stop;
    c->sample.n_stop = 0;
    if (strcmp(s, "auto") == 0 || strcmp(s, "none") == 0) return;
    if (count_ids(s) > CFG_MAX_STOP) die_input("--sample.stop: at most %d token ids", CFG_MAX_STOP);
    c->sample.n_stop = parse_ids("sample.stop", s, c->sample.stop_ids);
}

static int choice_ok(const char* choices, const char* v) {
    size_t len = strlen(v);
    const char* p = choices;
    while (*p) {
        const char* bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n == len && strncmp(p, v, n) == 0) return 1;
        if (!bar) break;
        p = bar + 1;
    }
    return 0;
}

/* Sets flag f (of list item `item`; 0 for a plain flag) from the text v. `name` is the flag as
 * given, for error messages ("data.sources.1.weight", not "data.sources.N.weight"). */
static void flag_set(Config* c, const Flag* f, const char* name, int item, const char* v) {
    void* ptr = (char*)f->ptr + (size_t)item * f->stride;
    switch (f->type) {
    case F_INT: {
        long long x = parse_int_or_die(name, v);
        if ((double)x < f->min || (double)x > f->max)
            die_input("--%s: %lld is outside [%.0f, %.0f]", name, x, f->min, f->max);
        *(int*)ptr = (int)x;
        break;
    }
    case F_FLOAT: {
        double x = parse_float_or_die(name, v);
        if (x < f->min || x > f->max) die_input("--%s: %g is outside [%g, %g]", name, x, f->min, f->max);
        /* 0 means something of its own to several flags (grad_clip, bandit.eta: off, derived) */
        if (x != 0.0 && (float)x == 0.0f)
            die_input("--%s: %g is too small for a float, which would hold it as 0", name, x);
        *(float*)ptr = (float)x;
        break;
    }
    case F_STR:
    case F_PATH:
    case F_GLOB:
        if (f->choices && !choice_ok(f->choices, v)) die_input("--%s: '%s' is not one of %s", name, v, f->choices);
        if (strlen(v) >= f->cap) die_input("--%s: value is longer than %zu characters", name, f->cap - 1);
        strcpy((char*)ptr, v);
        break;
    case F_BOOL:
        *(int*)ptr = (strcmp(v, "1") == 0);
        break;
    case F_PROMPT:
        parse_prompt(c, v);
        break;
    }
}

/* Whether name[0 .. len) is the list-item flag f with a decimal index ("data.sources.12.train" for
 * "data.sources.N.train"); the index goes to *item. */
static int item_flag_matches(const Flag* f, const char* name, size_t len, int* item) {
    const char* n_at = strstr(f->name, ".N.");
    size_t prefix = (size_t)(n_at - f->name) + 1, digits = 0, rest;
    const char* suffix = n_at + 2; /* ".key" */
    if (len <= prefix || strncmp(name, f->name, prefix) != 0) return 0;
    while (prefix + digits < len && name[prefix + digits] >= '0' && name[prefix + digits] <= '9') digits++;
    rest = len - prefix - digits;
    if (digits == 0 || digits > 6 || (digits > 1 && name[prefix] == '0')) return 0;
    if (rest != strlen(suffix) || strncmp(name + prefix + digits, suffix, rest) != 0) return 0;
    *item = atoi(name + prefix);
    return 1;
}

/* The table index of the flag called name[0 .. len), or -1; *item: its list index (0 for a plain
 * flag). */
static int find_flag(const Flag* f, int n, const char* name, size_t len, int* item) {
    int i;
    *item = 0;
    for (i = 0; i < n; i++) {
        if (f[i].items ? item_flag_matches(&f[i], name, len, item)
                       : strlen(f[i].name) == len && strncmp(f[i].name, name, len) == 0)
            return i;
    }
    return -1;
}

/* The value of the last --NAME on the command line (--NAME VALUE or --NAME=VALUE; "1" for a bare
 * bool flag), or NULL where it is not given, found where config_parse finds flags: a value that
 * spells a flag is that value (--name --checkpoint names the run "--checkpoint"). For what must be
 * known before config_parse runs: the mode (engine_main), --checkpoint's sidecar (generate.h). */
static const char* argv_flag_value(int argc, char** argv, const char* name) {
    static Config scratch; /* the table's pointers only: nothing is parsed into it */
    Flag f[CFG_N_FLAGS_MAX];
    int n = config_flags(&scratch, f), i, k, item;
    const char* value = NULL;
    for (i = 1; i < argc; i++) {
        const char *a, *eq;
        size_t len;
        int named;
        if (strncmp(argv[i], "--", 2) != 0) continue;
        a = argv[i] + 2;
        eq = strchr(a, '=');
        len = eq ? (size_t)(eq - a) : strlen(a);
        if ((k = find_flag(f, n, a, len, &item)) < 0) continue;
        named = len == strlen(name) && strncmp(a, name, len) == 0;
        if (f[k].type == F_BOOL) {
            if (named && !eq) value = "1"; /* --generate=1 is config_parse's error, no mode */
        } else if (eq || i + 1 < argc) {
            const char* v = eq ? eq + 1 : argv[++i]; /* its value, whatever it spells */
            if (named) value = v;
        }
    }
    return value;
}

/* Whether the flag called `name` was given on the command line. */
static int flag_seen(const Flag* f, int n, const int* seen, const char* name) {
    int item;
    return seen[find_flag(f, n, name, strlen(name), &item)];
}

/* Index of a given flag in the same dotted section as `name` ("polish.lr" -> "polish."), or -1. */
static int seen_in_section(const Flag* f, int n, const int* seen, const char* name) {
    size_t len = strchr(name, '.') - name + 1;
    int i;
    for (i = 0; i < n; i++)
        if (seen[i] && strncmp(f[i].name, name, len) == 0) return i;
    return -1;
}

static void config_validate(const Config* c, const int* seen, const Flag* f, int n);
static void config_validate_model(const Config* c);
static void config_validate_mode(const Config* c);

/* Parses argv into *c (defaults first), validates, and dies with one error line on bad input.
 * --help prints the table for people, --flags-json for programs, --print-config the parsed
 * configuration with its defaults; all three exit 0 once written (exit_once_written).
 * --layout-json returns with the model flags alone validated (and the mode's, config_validate_mode):
 * every mode's caller prints the parameter layout (param_layout_check) and exits the same way. */
static void config_parse(Config* c, int argc, char** argv) {
    Flag f[CFG_N_FLAGS_MAX];
    int seen[CFG_N_FLAGS_MAX];
    int n, i, print_config = 0;
    memset(c, 0, sizeof *c);
    n = config_flags(c, f);
    memset(seen, 0, sizeof seen);
    for (i = 0; i < n; i++) {
        int item;
        for (item = 0; f[i].def && item < (f[i].items ? f[i].items : 1); item++) flag_set(c, &f[i], f[i].name, item, f[i].def);
    }
    for (i = 1; i < argc; i++) {
        const char* a = argv[i];
        const char* eq;
        const char* val;
        char name[96];
        int k, item;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            config_help(stdout, argv[0]);
            exit_once_written();
        }
        if (strcmp(a, "--flags-json") == 0) {
            config_flags_json(stdout);
            exit_once_written();
        }
        if (strcmp(a, "--print-config") == 0) {
            print_config = 1;
            continue;
        }
        if (strcmp(a, "--layout-json") == 0) {
            c->layout_json = 1;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) die_input("unexpected argument '%s' (flags start with --; see --help)", a);
        a += 2;
        eq = strchr(a, '=');
        k = find_flag(f, n, a, eq ? (size_t)(eq - a) : strlen(a), &item);
        if (k < 0) die_input("unknown flag '%s' (see --help)", argv[i]);
        if (f[k].items && item >= f[k].items)
            die_input("--%.*s: at most %d data sources (indices 0 to %d)", (int)(eq ? eq - a : (long)strlen(a)), a,
                      f[k].items, f[k].items - 1);
        snprintf(name, sizeof name, "%.*s", (int)(eq ? eq - a : (long)strlen(a)), a);
        if (f[k].type == F_BOOL) {
            if (eq) die_input("--%s takes no value", f[k].name);
            val = "1";
        } else if (eq) {
            val = eq + 1;
        } else {
            if (i + 1 >= argc) die_input("--%s needs a value", f[k].name);
            val = argv[++i];
        }
        flag_set(c, &f[k], name, item, val);
        seen[k] = 1;
        if (f[k].items && item >= c->data.n_sources) c->data.n_sources = item + 1;
    }
    /* derived defaults */
    if (!flag_seen(f, n, seen, "model.d_ff")) c->model.d_ff = 4 * c->model.d_model;
    if (!flag_seen(f, n, seen, "model.padded_vocab_size"))
        c->model.padded_vocab_size = (c->model.vocab_size + 63) / 64 * 64;
    c->polish.enabled = flag_seen(f, n, seen, "polish.start_step");
    c->bandit.enabled = flag_seen(f, n, seen, "bandit.every");
    parse_stop(c);
    if (print_config) { /* before the required-flag and cross-flag checks: a partial config resolves too */
        config_print_json(stdout, c);
        exit_once_written();
    }
    if (c->layout_json) { /* the layout needs only the model's flags; the caller prints it */
        config_validate_mode(c);
        for (i = 0; i < n; i++)
            if (f[i].required == REQ_YES && !seen[i] && strncmp(f[i].name, "model.", 6) == 0)
                die_input("missing required flag --%s", f[i].name);
        config_validate_model(c);
        return;
    }
    config_validate(c, seen, f, n);
}

/* Whether every source of data.sources has a val glob (then the overall val_loss is their mean by
 * prior weight, docs/FIREHOSE-BANDIT.md). */
static int config_all_sources_have_val(const Config* c) {
    int i;
    for (i = 0; i < c->data.n_sources; i++)
        if (!c->data.sources[i].val[0]) return 0;
    return c->data.n_sources > 0;
}

/* data.train or data.sources, each source whole and named once, weights not all 0; the bandit's
 * needs (a validation set, a reward variance). */
static void config_validate_sources(const Config* c) {
    int i, j;
    double total = 0.0;
    if (c->data.train[0] && c->data.n_sources > 0)
        die_input("give --data.train or --data.sources.N.*, not both (data.train is one source)");
    if (!c->data.train[0] && c->data.n_sources == 0) die_input("missing required flag --data.train (or --data.sources.N.train)");
    for (i = 0; i < c->data.n_sources; i++) {
        const SourceConfig* s = &c->data.sources[i];
        const char* p;
        if (!s->name[0]) die_input("missing required flag --data.sources.%d.name (sources are numbered from 0)", i);
        if (!s->train[0]) die_input("missing required flag --data.sources.%d.train (sources are numbered from 0)", i);
        for (p = s->name; *p; p++) /* the byte, not the name: a newline or escape in it must not reach the error line */
            if (!(isalnum((unsigned char)*p) || *p == '.' || *p == '_' || *p == '-'))
                die_input("--data.sources.%d.name: byte 0x%02x at position %d; a name may hold only letters, digits, "
                          "'.', '_' and '-'", i, (unsigned char)*p, (int)(p - s->name));
        for (j = 0; j < i; j++)
            if (strcmp(c->data.sources[j].name, s->name) == 0)
                die_input("--data.sources.%d.name: '%s' is already the name of data.sources.%d", i, s->name, j);
        total += s->weight;
    }
    if (c->data.n_sources > 0 && !(total > 0.0))
        die_input("--data.sources.N.weight: every weight is 0; at least one source must be trained on");
    if (c->bandit.enabled && !c->data.val[0])
        die_input("bandit.every needs --data.val: the bandit's probes measure the loss on it");
    if (c->bandit.enabled && c->bandit.reward_decay == 0.0) /* the variance of one reward is 0: every z would be 0 */
        die_input("--bandit.reward_decay 0 keeps no variance of the rewards: the bandit would never learn (give > 0)");
}

/* Which of the classifier's products the engines run in FP8 (docs/DESIGN.md §18): in precision fp8,
 * where that pays (cpu/fp8.h's fp8_classifier_pays), all three (train.fp8_classifier all, the
 * default: dlogits rounded stochastically) or the logits' alone (logits: dlogits, dx and dwte stay
 * in the activation type); none otherwise, and never in generation. */
enum { FP8_CLASSIFIER_NONE, FP8_CLASSIFIER_LOGITS, FP8_CLASSIFIER_ALL };
static int config_fp8_classifier(const Config* c) {
    if (strcmp(c->train.precision, "fp8") != 0 || c->generate.enabled || !fp8_classifier_pays(c->model.d_model))
        return FP8_CLASSIFIER_NONE;
    if (strcmp(c->train.fp8_classifier, "all") == 0) return FP8_CLASSIFIER_ALL;
    return strcmp(c->train.fp8_classifier, "logits") == 0 ? FP8_CLASSIFIER_LOGITS : FP8_CLASSIFIER_NONE;
}

/* Precision fp8: which classifier the engine runs (config_fp8_classifier; else its products in
 * `dtype`), one startup info line (docs/DESIGN.md §18). */
static void info_fp8_classifier(const Config* c, const char* dtype) {
    if (strcmp(c->train.precision, "fp8") != 0 || c->generate.enabled) return;
    if (config_fp8_classifier(c) == FP8_CLASSIFIER_ALL)
        info("classifier: FP8 products, all three (model.d_model %d >= %d)", c->model.d_model,
             FP8_CLASSIFIER_MIN_D_MODEL);
    else if (config_fp8_classifier(c) == FP8_CLASSIFIER_LOGITS)
        info("classifier: FP8 products, the logits' (dx and dwte in %s; model.d_model %d >= %d)", dtype,
             c->model.d_model, FP8_CLASSIFIER_MIN_D_MODEL);
    else if (strcmp(c->train.fp8_classifier, "off") == 0)
        info("classifier: %s products (train.fp8_classifier off)", dtype);
    else
        info("classifier: %s products (model.d_model %d; FP8 pays from %d up)", dtype, c->model.d_model,
             FP8_CLASSIFIER_MIN_D_MODEL);
}

/* The model flags' rules among themselves, which --layout-json keeps too: a layout of a model no
 * engine builds (n_head not dividing d_model, fewer embedding rows than tokens) was printed with
 * exit 0, for programs to read as the engine's word. */
static void config_validate_model(const Config* c) {
    if (c->model.d_model % c->model.n_head != 0)
        die_input("model.n_head (%d) must divide model.d_model (%d)", c->model.n_head, c->model.d_model);
    if (c->model.padded_vocab_size < c->model.vocab_size)
        die_input("model.padded_vocab_size (%d) is smaller than model.vocab_size (%d)", c->model.padded_vocab_size,
                  c->model.vocab_size);
}

/* --generate and --evaluate: one of them, of the checkpoint they read (where their model flags come
 * from), and no training flag; --layout-json keeps it too (the layout is the checkpoint's model's). */
static void config_validate_mode(const Config* c) {
    const char* mode = c->generate.enabled ? "--generate" : "--evaluate";
    if (!c->generate.enabled && !c->evaluate) return;
    if (c->generate.enabled && c->evaluate) die_input("--generate and --evaluate are separate modes: give one");
    if (!c->checkpoint.path[0]) die_input("%s needs --checkpoint PATH", mode);
    if (c->resume || c->dump_grads[0]) die_input("%s does not train: drop --resume and --dump-grads", mode);
}

/* AdamW's decoupled decay multiplies each decayed weight by 1 - lr * weight_decay every step
 * (cpu/adamw.h): from lr * weight_decay = 1 on every weight is zeroed or flipped each step and
 * nothing trains. lr is the highest rate of the run: train.lr, the schedule's peak (schedule.h), or
 * polish.lr above it. Two floats' product is exact in double. */
static void config_validate_weight_decay(const Config* c) {
    int polish = c->polish.enabled && c->polish.lr > c->train.lr;
    double lr = polish ? c->polish.lr : c->train.lr;
    if (lr * (double)c->train.weight_decay >= 1.0)
        die_input("train.weight_decay (%g) times %s (%g) is %.9g, at least 1: AdamW's decay would multiply every "
                  "decayed weight by 1 - lr * weight_decay <= 0 each step; give a weight_decay below %.9g",
                  c->train.weight_decay, polish ? "polish.lr" : "train.lr", lr, lr * (double)c->train.weight_decay,
                  1.0 / lr);
}

static void config_validate(const Config* c, const int* seen, const Flag* f, int n) {
    int i;
    config_validate_mode(c);
    if (c->evaluate && !c->data.val[0]) die_input("--evaluate needs --data.val GLOB");
    for (i = 0; i < n; i++) {
        int j = f[i].required == REQ_IN_SECTION && !seen[i] ? seen_in_section(f, n, seen, f[i].name) : -1;
        /* --generate and --evaluate train nothing: of the required flags they need the model's */
        int needed = (!(c->generate.enabled || c->evaluate) || strncmp(f[i].name, "model.", 6) == 0) && !f[i].items;
        if (f[i].required == REQ_YES && !seen[i] && needed) die_input("missing required flag --%s", f[i].name);
        if (j >= 0) die_input("--%s needs --%s", f[j].name, f[i].name);
    }
    for (i = 0; i < c->sample.n_stop; i++)
        if (c->sample.stop_ids[i] >= c->model.vocab_size)
            die_input("--sample.stop: token id %d >= model.vocab_size (%d)", c->sample.stop_ids[i], c->model.vocab_size);
    if (!(c->generate.enabled || c->evaluate)) config_validate_sources(c);
    config_validate_model(c);
    /* layer functions count elements of one activation tensor in int */
    if ((double)c->train.batch_size * c->model.seq_len * (c->model.d_ff > c->model.d_model ? c->model.d_ff : c->model.d_model) > INT_MAX)
        die_input("train.batch_size * model.seq_len * model.d_ff is too large (at most %d elements per activation)", INT_MAX);
    /* FP8 products contract over d_model, d_ff and the B·T rows; generation runs without them
     * (docs/DESIGN.md §18). Both engines refuse alike: the CPU engine emulates the GPU's fp8. */
    if (strcmp(c->train.precision, "fp8") == 0 && !c->generate.enabled &&
        (c->model.d_model % 16 || c->model.d_ff % 16 || ((long long)c->train.batch_size * c->model.seq_len) % 16))
        die_input("train.precision fp8 needs model.d_model, model.d_ff and train.batch_size x model.seq_len to be "
                  "multiples of 16 (FP8 products contract over them); got %d, %d and %lld", c->model.d_model,
                  c->model.d_ff, (long long)c->train.batch_size * c->model.seq_len);
    /* the FP8 classifier (fp8_classifier_pays): the padded vocabulary is a dimension of its FP8
     * products (the logits' columns; the input gradient's contraction with train.fp8_classifier all) */
    if (config_fp8_classifier(c) && c->model.padded_vocab_size % 16)
        die_input("train.precision fp8 with the FP8 classifier (model.d_model >= %d) needs model.padded_vocab_size to "
                  "be a multiple of 16 (a dimension of its FP8 products); got %d", FP8_CLASSIFIER_MIN_D_MODEL,
                  c->model.padded_vocab_size);
    if (c->train.min_lr > c->train.lr) die_input("train.min_lr (%g) is above train.lr (%g)", c->train.min_lr, c->train.lr);
    config_validate_weight_decay(c);
    if (c->train.warmup_steps > c->train.steps)
        die_input("train.warmup_steps (%d) is more than train.steps (%d)", c->train.warmup_steps, c->train.steps);
    if (c->eval.every > 0 && !c->data.val[0] && !config_all_sources_have_val(c))
        die_input("eval.every > 0 needs --data.val (or a val glob for every one of data.sources)");
    if (c->eval.every > 0 && c->eval.batches == 0)
        die_input("eval.batches 0 (every window of the validation shards) is for --evaluate; give a batch count");
    if (c->sample.every > 0 && c->sample.n_prompts == 0) die_input("sample.every > 0 needs at least one --sample.prompt");
    for (i = 0; i < c->sample.n_prompts; i++) {
        int j;
        if (c->sample.prompt_start[i + 1] == c->sample.prompt_start[i]) die_input("--sample.prompt %d is empty", i);
        for (j = c->sample.prompt_start[i]; j < c->sample.prompt_start[i + 1]; j++)
            if (c->sample.prompt_tokens[j] >= c->model.vocab_size)
                die_input("--sample.prompt %d: token id %d >= model.vocab_size (%d)", i, c->sample.prompt_tokens[j],
                          c->model.vocab_size);
        /* samples continue the prompt in one window (KV cache, no sliding) */
        if (c->sample.prompt_start[i + 1] - c->sample.prompt_start[i] > c->model.seq_len)
            die_input("--sample.prompt %d has %d tokens, more than model.seq_len (%d)", i,
                      c->sample.prompt_start[i + 1] - c->sample.prompt_start[i], c->model.seq_len);
    }
    if (c->checkpoint.every > 0 && !c->checkpoint.path[0]) die_input("checkpoint.every > 0 needs --checkpoint PATH");
    if (c->resume && !c->checkpoint.path[0]) die_input("--resume needs --checkpoint PATH");
    if (c->polish.enabled && !c->polish.train[0]) die_input("--polish.train is empty");
    if (c->polish.enabled && c->polish.start_step > c->train.steps)
        die_input("polish.start_step (%d) is beyond train.steps (%d)", c->polish.start_step, c->train.steps);
}

static int config_is_fp16(const Config* c) { return strcmp(c->train.precision, "fp16") == 0; }

/* Whether the engine keeps the amax histories of delayed fp8 scaling (docs/DESIGN.md §18): when it
 * trains in fp8 (--generate and --evaluate train nothing: their casts scale by the current amax).
 * Both engines set up by it, and a resumed run reads its checkpoint's histories by it before they do. */
static int config_keeps_fp8_histories(const Config* c) {
    return strcmp(c->train.precision, "fp8") == 0 && !c->generate.enabled && !c->evaluate;
}

/* KV-cache slots an engine allocates (docs/DESIGN.md §5a): one per request decoded together in
 * --generate, one for the training samples, none otherwise. */
static int config_kv_slots(const Config* c) {
    if (c->generate.enabled) return c->generate.max_batch;
    return !c->evaluate && c->sample.every > 0 ? 1 : 0;
}

/* Tokens one optimizer step trains on: batch_size x seq_len x grad_accum. */
static long long config_tokens_per_step(const Config* c) {
    return (long long)c->train.batch_size * c->model.seq_len * c->train.grad_accum;
}

#endif
