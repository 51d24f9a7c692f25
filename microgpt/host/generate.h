/* generate.h: using a trained model (docs/DESIGN.md §5a), the host side both engines share:
 *   the sampler (temperature, top-k, top-p; the training samples use it too),
 *   the model flags read from a checkpoint's sidecar (--generate and --evaluate),
 *   --generate: JSON request lines on stdin, decoded with the engine's KV cache (engine.h:
 *   engine_prefill / engine_decode), JSON lines out, flushed as they are made.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_GENERATE_H
#define MICROGPT_HOST_GENERATE_H

#include "checkpoint.h"
#include "config.h"
#include "engine.h"
#include "params.h"
#include "rng.h"
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---------------------------------------------------------------------------------------------- */
/* Sampling */

typedef struct {
    float value;
    int id;
} Candidate;

/* Scratch for one draw over a vocabulary of V tokens, allocated once. */
typedef struct {
    int V;
    Candidate* cand; /* [V] */
    double* weight;  /* [V] */
} Sampler;

static void sampler_init(Sampler* s, int V) {
    s->V = V;
    s->cand = (Candidate*)xmalloc((size_t)V * sizeof(Candidate), "sampler candidates");
    s->weight = (double*)xmalloc((size_t)V * sizeof(double), "sampler weights");
}

static void sampler_free(Sampler* s) {
    free(s->cand);
    free(s->weight);
}

/* Higher logit first, lower id first among equals: a total order, so every sort agrees. */
static int candidate_before(const Candidate* a, const Candidate* b) {
    return a->value > b->value || (a->value == b->value && a->id < b->id);
}

static int candidate_cmp(const void* a, const void* b) {
    return candidate_before((const Candidate*)a, (const Candidate*)b) ? -1
           : candidate_before((const Candidate*)b, (const Candidate*)a) ? 1 : 0;
}

#define SAMPLER_INSERTION_MAX 256 /* top-k up to this: insertion into a short list; beyond: one sort */

/* The best k candidates of logits[0:V], in candidate order, NaN never among them; returns how many. */
static int sampler_top(Sampler* s, const float* logits, int k) {
    int n = 0, i, j;
    if (k > SAMPLER_INSERTION_MAX) {
        for (i = 0; i < s->V; i++)
            if (logits[i] == logits[i]) {
                s->cand[n].value = logits[i];
                s->cand[n++].id = i;
            }
        qsort(s->cand, (size_t)n, sizeof(Candidate), candidate_cmp);
        return n < k ? n : k;
    }
    for (i = 0; i < s->V; i++) {
        Candidate x;
        x.value = logits[i];
        x.id = i;
        if (x.value != x.value) continue;
        if (n == k && !candidate_before(&x, &s->cand[n - 1])) continue;
        j = n < k ? n++ : n - 1;
        for (; j > 0 && candidate_before(&x, &s->cand[j - 1]); j--) s->cand[j] = s->cand[j - 1];
        s->cand[j] = x;
    }
    return n;
}

/* softmax(logits / temperature) over the whole vocabulary inverted at u, in id order: no sort
 * (it would cost more than a GPU decode step). NaN logits have no weight. A logit equal to the
 * largest weighs 1, exp(0), also where that is an infinity (a logit that overflowed a diverged
 * model's forward): inf - inf would be NaN and every weight's sum NaN, and no token's share would
 * be its softmax's. */
static int sample_full(Sampler* s, const float* logits, double temperature, double u) {
    double max = -INFINITY, total = 0.0, acc = 0.0;
    int i, last = 0;
    for (i = 0; i < s->V; i++)
        if (logits[i] > max) max = logits[i];
    for (i = 0; i < s->V; i++) {
        s->weight[i] = logits[i] != logits[i] ? 0.0
                       : logits[i] == max     ? 1.0
                                              : exp(((double)logits[i] - max) / temperature);
        total += s->weight[i];
    }
    for (i = 0; i < s->V; i++) {
        if (s->weight[i] == 0.0) continue;
        acc += s->weight[i];
        last = i;
        if (u * total < acc) return i;
    }
    return last;
}

/* A token from logits over the real vocabulary (padded rows are never passed in): greedy (the
 * highest logit, lowest id among equals) when temperature is 0; otherwise softmax(logits /
 * temperature) over the top_k best (0: all), cut to the smallest head whose probability reaches
 * top_p (1: no cut), inverted at the uniform draw u in [0, 1): over the candidates in order of
 * their logits, or over the whole vocabulary in id order when neither cut applies. */
static int sample_token(Sampler* s, const float* logits, double temperature, int top_k, double top_p, double u) {
    int k = (top_k <= 0 || top_k > s->V) ? s->V : top_k, n, i;
    double total = 0.0, acc = 0.0, max;
    if (temperature == 0.0) k = 1;
    else if (k == s->V && top_p >= 1.0) return sample_full(s, logits, temperature, u);
    n = sampler_top(s, logits, k);
    if (n == 0) return 0; /* every logit NaN */
    if (n == 1) return s->cand[0].id;
    max = s->cand[0].value;
    for (i = 0; i < n; i++) {
        /* the largest weighs 1 also where it is an infinity, as in sample_full */
        s->weight[i] = s->cand[i].value == max ? 1.0 : exp(((double)s->cand[i].value - max) / temperature);
        total += s->weight[i];
    }
    if (top_p < 1.0) {
        double head = 0.0;
        for (i = 0; i < n; i++) {
            head += s->weight[i];
            if (head >= top_p * total) break;
        }
        n = i < n ? i + 1 : n;
        total = head;
    }
    for (i = 0; i < n; i++) {
        acc += s->weight[i];
        if (u * total < acc) return s->cand[i].id;
    }
    return s->cand[n - 1].id;
}

static int id_in(int id, const int* ids, int n) {
    int i;
    for (i = 0; i < n; i++)
        if (ids[i] == id) return 1;
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* Model flags from the checkpoint's sidecar */

/* One error line for --checkpoint path whose sidecar side_path holds a member no run writes so
 * (`what`: "whose seed is no number"): the sidecar's damage, not a flag the command line gave. */
static void refuse_sidecar_member(const char* path, const char* side_path, const char* what) {
    CkptFiles f;
    char text[CFG_PATH_MAX + 160];
    ckpt_files(path, &f);
    snprintf(text, sizeof text, "has a sidecar %s %s (damaged or edited)", side_path, what);
    ckpt_refuse_damaged(&f, text);
}

/* --generate / --evaluate: the sidecar of --checkpoint, read into *side (once: ckpt_check takes
 * it), supplies the model shape and the seed, batch size and precision the model was trained with
 * (a member of another type is the sidecar's damage, refused); flags on the command line come after
 * them, so they win. Then the usual parse and validation (config_parse). */
static void config_parse_for_checkpoint(Config* c, int argc, char** argv, Sidecar* side) {
    static const char* const keys[][2] = {
        {"model.n_layer", "n_layer"}, {"model.d_model", "d_model"}, {"model.n_head", "n_head"},
        {"model.d_ff", "d_ff"}, {"model.seq_len", "seq_len"}, {"model.vocab_size", "vocab_size"},
        {"model.padded_vocab_size", "padded_vocab_size"}, {"train.seed", "seed"},
        {"train.batch_size", "batch_size"}};
    enum { N_KEYS = sizeof keys / sizeof keys[0] };
    static char values[N_KEYS + 1][40], flags[N_KEYS + 1][40];
    char side_path[CFG_PATH_MAX + 8], what[96];
    const char* text;
    const char* path = argv_flag_value(argc, argv, "checkpoint");
    char** args = (char**)xmalloc((size_t)(argc + 2 * N_KEYS + 2) * sizeof(char*), "command line");
    int n = 0, i;
    double x;
    args[n++] = argv[0];
    snprintf(side_path, sizeof side_path, "%s.json", path ? path : "");
    /* the model, so its layers, is yet to learn; a path too long is config_parse's error (a cut
     * one would name another file), and so is an empty one (--checkpoint ''), whose sidecar would
     * be the file ".json" of the working directory */
    if (path && path[0] && strlen(path) < CFG_PATH_MAX) sidecar_load(path, CFG_MAX_LAYERS, side);
    if ((text = side->text)) {
        CkptFiles files;
        static Config scratch; /* the flag table's ranges: nothing is parsed into it */
        Flag table[CFG_N_FLAGS_MAX];
        int n_flags = config_flags(&scratch, table), k, item;
        for (i = 0; i < N_KEYS; i++)
            if (json_find_number(text, keys[i][1], &x)) {
                if (!(x == floor(x) && fabs(x) <= INT_MAX)) { /* "%.0f" would round 4.5 to 4, print inf */
                    snprintf(what, sizeof what, "whose %s, %.17g, is no int", keys[i][1], x);
                    refuse_sidecar_member(path, side_path, what);
                }
                /* outside the flag's range: no run writes one, and config_parse would name a flag never given */
                k = find_flag(table, n_flags, keys[i][0], strlen(keys[i][0]), &item);
                if (k >= 0 && (x < table[k].min || x > table[k].max)) {
                    snprintf(what, sizeof what, "whose %s, %.0f, is outside [%.0f, %.0f]", keys[i][1], x, table[k].min,
                             table[k].max);
                    refuse_sidecar_member(path, side_path, what);
                }
                snprintf(flags[i], sizeof flags[i], "--%s", keys[i][0]);
                snprintf(values[i], sizeof values[i], "%.0f", x);
                args[n++] = flags[i];
                args[n++] = values[i];
            } else if (json_has_member(text, keys[i][1])) { /* not missing: the flag's default would run */
                snprintf(what, sizeof what, "whose %s is no number", keys[i][1]);
                refuse_sidecar_member(path, side_path, what);
            }
        if (json_find_string(text, "precision", values[N_KEYS], sizeof values[N_KEYS])) {
            if (!choice_ok(CFG_PRECISIONS, values[N_KEYS])) { /* not the flag's error: none was given */
                snprintf(what, sizeof what, "whose precision '%.31s' is not one of %s", values[N_KEYS],
                         CFG_PRECISIONS);
                refuse_sidecar_member(path, side_path, what);
            }
            snprintf(flags[N_KEYS], sizeof flags[N_KEYS], "--train.precision");
            args[n++] = flags[N_KEYS];
            args[n++] = values[N_KEYS];
        } else if (json_has_member(text, "precision")) {
            refuse_sidecar_member(path, side_path, "whose precision is no string");
        }
        /* then the values' own checksum, before config_parse judges them as flags: an edited value
         * that is a valid flag alone ("d_model":33 beside "n_head":4) is the sidecar's damage, with
         * the way back to the previous slot, not the error of a flag the command line never gave */
        ckpt_files(path, &files);
        sidecar_refuse_bad_values(&files, text);
    } else if (side->loaded) {
        info("note: %s cannot be read; the model flags must be given", side_path);
    }
    for (i = 1; i < argc; i++) args[n++] = argv[i];
    config_parse(c, n, args);
    free(args);
    if (!file_exists(c->checkpoint.path)) die_input("checkpoint %s does not exist", c->checkpoint.path);
}

/* The weights of --checkpoint (`checked`: as ckpt_check accepted it) into the engine (set up
 * already). */
static void load_weights(const Config* c, size_t n_params, CkptChecked* checked) {
    float* params = (float*)xmalloc(n_params * sizeof(float), "host weights");
    ckpt_load(checked, c->checkpoint.path, n_params, params, NULL, NULL);
    engine_set_state(params, NULL, NULL, 0.0f);
    free(params);
}

/* ---------------------------------------------------------------------------------------------- */
/* Requests: a small JSON reader for exactly what a request line may hold */

#define GEN_ID_MAX 256  /* bytes of an id's JSON text */
#define GEN_MAX_STOP 64 /* stop ids per request */
#define GEN_ID_KEY_MAX (GEN_ID_MAX + 8) /* gen_id_key: a type byte and a decoded string or a double */

/* The most bytes a request line may hold (its '\n' not counted), so that no line is held in
 * memory whole before it is judged (a client's runaway line would take all of it): what the
 * longest valid line needs, generously. A request holds at most seq_len prompt ids and
 * GEN_MAX_STOP stop ids, each GEN_LINE_ID_BYTES at most (its digits, a comma, blanks), and
 * GEN_LINE_REQUEST_BYTES for the rest (the id, under GEN_ID_MAX, the other keys and their values,
 * more blanks); a line holds max_batch requests; and never less than GEN_LINE_FLOOR, room for any
 * formatting a small model's requests come in. docs/DESIGN.md §16. */
#define GEN_LINE_ID_BYTES 32
#define GEN_LINE_REQUEST_BYTES 4096
#define GEN_LINE_FLOOR ((size_t)1 << 20)

static size_t gen_line_max(const Config* c) {
    size_t request = GEN_LINE_REQUEST_BYTES + ((size_t)c->model.seq_len + GEN_MAX_STOP) * GEN_LINE_ID_BYTES;
    size_t line = (size_t)c->generate.max_batch * request;
    return line > GEN_LINE_FLOOR ? line : GEN_LINE_FLOOR;
}

typedef struct {
    /* as asked */
    char id[GEN_ID_MAX]; /* the id's JSON text, echoed verbatim; "null" when absent or refused */
    int* prompt;         /* [seq_len] */
    int n_prompt;
    int max_tokens, top_k, n_stop;
    int want_logits; /* 0; 1: the prompt's last position's logits; 2: those of every token drawn */
    double temperature, top_p;
    uint64_t seed;
    int stop[GEN_MAX_STOP];
    char error[200]; /* "" = a good request */
    char id_key[GEN_ID_KEY_MAX]; /* the id as JSON readers read it (gen_id_key), id_key_len bytes */
    size_t id_key_len;
    /* as decoded */
    int* out; /* [seq_len] generated tokens */
    int n_out;
    const float* logits; /* [vocab_size] for the next token */
    const char* reason;  /* NULL while decoding */
} Request;

typedef struct {
    const char* p;
    const char* syntax_error; /* the line is not JSON of the expected form */
} JsonIn;

static void js_ws(JsonIn* j) {
    while (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r') j->p++;
}

static int js_fail(JsonIn* j, const char* why) {
    if (!j->syntax_error) j->syntax_error = why;
    return 0;
}

/* A JSON string starting at j->p (RFC 8259: escapes, UTF-8; json_skip_string); its content
 * (escapes kept as written, at most cap - 1 bytes) into out when out != NULL. An id is echoed as
 * written, so a string that is no JSON string would make the reply no JSON line. */
static int js_string(JsonIn* j, char* out, size_t cap) {
    const char* end;
    size_t n;
    if (*j->p != '"') return js_fail(j, "expected a string");
    if (!(end = json_skip_string(j->p)))
        return js_fail(j, "a malformed string (a bad escape, a control character, invalid UTF-8 or no closing quote)");
    if (out) {
        n = (size_t)(end - j->p) - 2;
        if (n > cap - 1) n = cap - 1;
        memcpy(out, j->p + 1, n);
        out[n] = '\0';
    }
    j->p = end;
    return 1;
}

/* Whether the JSON string at p (a valid one: json_skip_string) holds a \u escape of a UTF-16
 * surrogate that is not half of a pair (a high one, D800-DBFF, right before a low one,
 * DC00-DFFF). RFC 8259's grammar lets such a string through, but it names no Unicode text: no
 * UTF-8 reader can turn it into a string it can write out again. */
static int json_string_has_lone_surrogate(const char* p) {
    unsigned u;
    int len;
    for (p++; *p != '"';) {
        if (*p != '\\') {
            p++; /* a UTF-8 sequence's bytes are never a backslash or a quote */
            continue;
        }
        if (p[1] != 'u') {
            p += 2;
            continue;
        }
        u = json_u_escape(p, &len);
        if (u >= 0xD800 && u <= 0xDFFF) return 1;
        p += len;
    }
    return 0;
}

/* A JSON number (json_skip_number's), converted by strtod. */
static int js_number(JsonIn* j, double* x) {
    const char* q = json_skip_number(j->p);
    if (!q) {
        const char* d = j->p + (*j->p == '-'); /* no digit after the sign: no number at all */
        return js_fail(j, *d >= '0' && *d <= '9' ? "malformed number" : "expected a number");
    }
    *x = strtod(j->p, NULL);
    j->p = q;
    return 1;
}

static int js_literal(JsonIn* j, const char* word) {
    size_t n = strlen(word);
    if (strncmp(j->p, word, n) != 0) return js_fail(j, "unexpected character");
    j->p += n;
    return 1;
}

/* Skips any JSON value (nesting at most 64 deep). */
static int js_skip(JsonIn* j, int depth) {
    double x;
    js_ws(j);
    if (depth > 64) return js_fail(j, "nested too deeply");
    if (*j->p == '"') return js_string(j, NULL, 0);
    if (*j->p == 't') return js_literal(j, "true");
    if (*j->p == 'f') return js_literal(j, "false");
    if (*j->p == 'n') return js_literal(j, "null");
    if (*j->p == '[' || *j->p == '{') {
        char close = *j->p == '[' ? ']' : '}';
        int object = close == '}';
        j->p++;
        js_ws(j);
        if (*j->p == close) {
            j->p++;
            return 1;
        }
        for (;;) {
            js_ws(j);
            if (object) {
                if (!js_string(j, NULL, 0)) return 0;
                js_ws(j);
                if (*j->p != ':') return js_fail(j, "expected ':'");
                j->p++;
            }
            if (!js_skip(j, depth + 1)) return 0;
            js_ws(j);
            if (*j->p == ',') j->p++;
            else if (*j->p == close) {
                j->p++;
                return 1;
            } else return js_fail(j, "expected ',' or a closing bracket");
        }
    }
    return js_number(j, &x);
}

/* An integer in [lo, hi] (a JSON number with no fraction); else the request's error, and *out is
 * lo: the caller converts it to an int or uint64_t, and a value past the type (1e300, inf) would
 * make that conversion undefined behaviour even though the request is never served. */
static int js_int_field(JsonIn* j, Request* r, const char* key, double lo, double hi, double* out) {
    if (!js_number(j, out)) return 0;
    if (*out != floor(*out) || *out < lo || *out > hi) {
        if (!r->error[0]) snprintf(r->error, sizeof r->error, "%s must be an integer in [%.0f, %.0f]", key, lo, hi);
        *out = lo;
    }
    return 1;
}

/* A list of token ids [0, V) into ids (at most cap kept, all counted in *n). */
static int js_id_list(JsonIn* j, Request* r, const char* key, int V, int* ids, int cap, int* n) {
    *n = 0;
    js_ws(j);
    if (*j->p != '[') {
        if (!r->error[0]) snprintf(r->error, sizeof r->error, "%s must be a list of token ids", key);
        return js_skip(j, 0);
    }
    j->p++;
    js_ws(j);
    if (*j->p == ']') {
        j->p++;
        return 1;
    }
    for (;;) {
        double x;
        js_ws(j);
        if (!js_number(j, &x)) return 0;
        if (x != floor(x) || x < 0 || x >= V) {
            if (!r->error[0])
                snprintf(r->error, sizeof r->error, "%s: %.9g is not a token id of this model (0 .. %d)", key, x,
                         V - 1);
            x = 0; /* (int)1e300 would be undefined behaviour, as in js_int_field */
        }
        if (*n < cap) ids[*n] = (int)x;
        (*n)++;
        js_ws(j);
        if (*j->p == ',') j->p++;
        else if (*j->p == ']') {
            j->p++;
            return 1;
        } else return js_fail(j, "expected ',' or ']'");
    }
}

/* Keys a request's object remembers to find one given twice; more keys than this are either given
 * twice or unknown, errors already. */
#define GEN_KEYS_MAX 16

/* One request object; returns 0 on a syntax error (j->syntax_error), else 1 with r->error set
 * when a field is wrong. Unknown keys are errors: a misspelt key must not be silently ignored. So
 * is a key given twice: JSON readers disagree on which value counts (Python's json keeps the last,
 * the engines' sidecar reader the first), so which one the client meant is unknown. */
static int parse_request(JsonIn* j, Request* r, const Config* c) {
    int T = c->model.seq_len, V = c->model.vocab_size, n_keys = 0;
    char keys[GEN_KEYS_MAX][32];
    strcpy(r->id, "null");
    r->n_prompt = -1;
    r->max_tokens = 64;
    r->temperature = 1.0;
    r->top_k = 0;
    r->top_p = 1.0;
    r->seed = 0;
    r->n_stop = 0;
    r->want_logits = 0;
    r->error[0] = '\0';
    js_ws(j);
    if (*j->p != '{') return js_fail(j, "a request must be a JSON object"); /* never past the line's end */
    j->p++;
    js_ws(j);
    if (*j->p == '}') {
        j->p++;
        snprintf(r->error, sizeof r->error, "no prompt");
        return 1;
    }
    for (;;) {
        char key[32];
        double x = 0.0;
        int ok = 1, k;
        js_ws(j);
        if (!js_string(j, key, sizeof key)) return 0;
        js_ws(j);
        if (*j->p != ':') return js_fail(j, "expected ':'");
        j->p++;
        js_ws(j);
        k = 0;
        while (k < n_keys && strcmp(keys[k], key) != 0) k++;
        if (k < n_keys && !r->error[0]) snprintf(r->error, sizeof r->error, "the key \"%.40s\" appears twice", key);
        else if (k == n_keys && n_keys < GEN_KEYS_MAX) strcpy(keys[n_keys++], key);
        if (strcmp(key, "id") == 0) {
            const char* start = j->p;
            if (*j->p == '[' || *j->p == '{') {
                if (!r->error[0]) snprintf(r->error, sizeof r->error, "id must be a string, number, boolean or null");
                ok = js_skip(j, 0);
            } else if ((ok = js_skip(j, 0))) {
                size_t n = (size_t)(j->p - start);
                if (*start == '"' && json_string_has_lone_surrogate(start)) { /* echoed, no reader could use it */
                    if (!r->error[0])
                        snprintf(r->error, sizeof r->error, "id holds a lone surrogate (a \\u escape in "
                                 "D800-DFFF not in a pair): no Unicode text, so it cannot be echoed");
                } else if (n >= sizeof r->id) {
                    if (!r->error[0]) snprintf(r->error, sizeof r->error, "id is longer than %d bytes", GEN_ID_MAX - 1);
                } else {
                    memcpy(r->id, start, n);
                    r->id[n] = '\0';
                }
            }
        } else if (strcmp(key, "prompt") == 0) {
            ok = js_id_list(j, r, "prompt", V, r->prompt, T, &r->n_prompt);
        } else if (strcmp(key, "stop") == 0) {
            ok = js_id_list(j, r, "stop", V, r->stop, GEN_MAX_STOP, &r->n_stop);
            if (ok && r->n_stop > GEN_MAX_STOP && !r->error[0])
                snprintf(r->error, sizeof r->error, "stop: at most %d token ids", GEN_MAX_STOP);
        } else if (strcmp(key, "max_tokens") == 0) {
            ok = js_int_field(j, r, key, 0, INT_MAX, &x);
            r->max_tokens = (int)x;
        } else if (strcmp(key, "top_k") == 0) {
            ok = js_int_field(j, r, key, 0, INT_MAX, &x);
            r->top_k = (int)x;
        } else if (strcmp(key, "seed") == 0) {
            /* below 2^53, where a double holds every integer: 2^53 + 1 would read as 2^53 */
            ok = js_int_field(j, r, key, 0, 9007199254740991.0, &x);
            r->seed = (uint64_t)x;
        } else if (strcmp(key, "temperature") == 0) {
            ok = js_number(j, &r->temperature);
            if (ok && !(r->temperature >= 0 && r->temperature <= 1e30) && !r->error[0])
                snprintf(r->error, sizeof r->error, "temperature must be a number >= 0 (0: greedy)");
        } else if (strcmp(key, "top_p") == 0) {
            ok = js_number(j, &r->top_p);
            if (ok && !(r->top_p > 0 && r->top_p <= 1) && !r->error[0])
                snprintf(r->error, sizeof r->error, "top_p must be in (0, 1] (1: off)");
        } else if (strcmp(key, "logits") == 0) { /* true, false, or "all": before every token */
            r->want_logits = *j->p == 't' ? 1 : *j->p == '"' ? 2 : 0;
            ok = r->want_logits == 2 ? js_literal(j, "\"all\"") : js_literal(j, r->want_logits ? "true" : "false");
        } else {
            if (!r->error[0]) snprintf(r->error, sizeof r->error, "unknown key \"%.40s\"", key);
            ok = js_skip(j, 0);
        }
        if (!ok) return 0;
        js_ws(j);
        if (*j->p == ',') j->p++;
        else if (*j->p == '}') {
            j->p++;
            break;
        } else return js_fail(j, "expected ',' or '}'");
    }
    if (r->error[0]) return 1;
    if (r->n_prompt < 0) snprintf(r->error, sizeof r->error, "no prompt");
    else if (r->n_prompt == 0) snprintf(r->error, sizeof r->error, "the prompt is empty");
    else if (r->n_prompt > T)
        snprintf(r->error, sizeof r->error, "the prompt has %d tokens, more than the context window (model.seq_len %d)",
                 r->n_prompt, T);
    return 1;
}

/* The value of an id's JSON text (a valid one: parse_request) as JSON readers read it, into key
 * (GEN_ID_KEY_MAX bytes), its length returned: two ids with one key are one id to some reader. A
 * string by its decoded text ("a" = "\u0061"); a number by its double (1 = 1.0 = 1e0, -0 = 0, and
 * integers a double cannot tell apart); true and false as 1 and 0 (Python's json reads True == 1,
 * so a client keyed by id would take one request's lines for the other's); null alone. */
static size_t gen_id_key(const char* id, char* key) {
    double x;
    int has_nul;
    if (*id == '"') {
        key[0] = 's';
        return 1 + json_decode_string(id, key + 1, GEN_ID_KEY_MAX - 1, &has_nul); /* never longer than the text */
    }
    if (*id == 'n') {
        key[0] = 'z';
        return 1;
    }
    x = *id == 't' ? 1.0 : *id == 'f' ? 0.0 : strtod(id, NULL) + 0.0; /* + 0.0: -0 is 0 */
    key[0] = 'n';
    memcpy(key + 1, &x, sizeof x);
    return 1 + sizeof x;
}

/* Requests of one batch that share an id (gen_id_key) are each refused: their lines, streamed
 * together, would carry one id, and which answer is whose could not be told. A request with an
 * error of its own keeps it (it too is answered by one error line). Lines are served in turn, so ids
 * repeat freely across lines. docs/DESIGN.md §16. */
static void refuse_shared_ids(Request* req, int n) {
    int i, k;
    for (i = 0; i < n; i++) req[i].id_key_len = gen_id_key(req[i].id, req[i].id_key);
    for (i = 0; i < n; i++)
        for (k = 0; k < n; k++) {
            if (k == i || req[k].id_key_len != req[i].id_key_len ||
                memcmp(req[k].id_key, req[i].id_key, req[i].id_key_len) != 0)
                continue;
            if (!req[i].error[0])
                snprintf(req[i].error, sizeof req[i].error, "request %d of this batch has this id too (as JSON readers "
                         "read ids): the lines of requests decoded together are told apart by their ids alone, so no "
                         "request with this id is served", k);
            break;
        }
}

/* ---------------------------------------------------------------------------------------------- */
/* Output lines */

static void gen_line_start(const char* id) {
    fputs("{\"id\":", stdout);
    fputs(id, stdout);
}

static void emit_gen_error(const char* id, const char* message) {
    gen_line_start(id);
    fputs(",\"error\":", stdout);
    json_put_string(stdout, message);
    answer_line_end();
}

static void emit_gen_token(const Request* r, int token) {
    gen_line_start(r->id);
    fprintf(stdout, ",\"token\":%d", token);
    answer_line_end();
}

static void emit_gen_logits(const Request* r, int V) {
    char b[32];
    int v;
    gen_line_start(r->id);
    fputs(",\"logits\":[", stdout);
    for (v = 0; v < V; v++) {
        if (v) fputc(',', stdout);
        fputs(json_num(b, sizeof b, r->logits[v]), stdout);
    }
    fputc(']', stdout);
    answer_line_end();
}

static void emit_gen_done(const Request* r, double ms) {
    char b[32];
    gen_line_start(r->id);
    fprintf(stdout, ",\"done\":true,\"reason\":\"%s\",\"tokens\":", r->reason);
    emit_int_array(r->out, r->n_out);
    fprintf(stdout, ",\"prompt_tokens\":%d,\"ms\":%s", r->n_prompt, json_num(b, sizeof b, ms));
    answer_line_end();
}

/* ---------------------------------------------------------------------------------------------- */
/* Serving */

typedef struct {
    const Config* cfg;
    int V, T, max_batch;
    Request* req;            /* [max_batch]; request i of a line decodes in KV-cache slot i */
    float *prefill_logits;   /* [max_batch][V] */
    float *step_logits;      /* [max_batch][V]: row j = the j-th sequence of the last decode step */
    int *slots, *tokens, *positions; /* [max_batch]: one decode step's sequences */
    Sampler sampler;
    char* line;      /* the request line read last, NUL-terminated: grown as lines need, up to line_max */
    size_t line_cap, line_max;
} Server;

static void server_init(Server* s, const Config* c) {
    int i;
    memset(s, 0, sizeof *s);
    s->cfg = c;
    s->V = c->model.vocab_size;
    s->T = c->model.seq_len;
    s->max_batch = c->generate.max_batch;
    s->req = (Request*)xcalloc((size_t)s->max_batch, sizeof(Request), "requests");
    for (i = 0; i < s->max_batch; i++) {
        s->req[i].prompt = (int*)xmalloc((size_t)s->T * sizeof(int), "prompt");
        s->req[i].out = (int*)xmalloc((size_t)s->T * sizeof(int), "generated tokens");
    }
    s->prefill_logits = (float*)xmalloc((size_t)s->max_batch * s->V * sizeof(float), "logits");
    s->step_logits = (float*)xmalloc((size_t)s->max_batch * s->V * sizeof(float), "logits");
    s->slots = (int*)xmalloc((size_t)s->max_batch * sizeof(int), "decode slots");
    s->tokens = (int*)xmalloc((size_t)s->max_batch * sizeof(int), "decode tokens");
    s->positions = (int*)xmalloc((size_t)s->max_batch * sizeof(int), "decode positions");
    sampler_init(&s->sampler, s->V);
    s->line_max = gen_line_max(c);
    s->line_cap = 4096;
    s->line = (char*)xmalloc(s->line_cap, "request line");
}

static void server_free(Server* s) {
    int i;
    for (i = 0; i < s->max_batch; i++) {
        free(s->req[i].prompt);
        free(s->req[i].out);
    }
    free(s->req); free(s->prefill_logits); free(s->step_logits); free(s->slots); free(s->tokens); free(s->positions);
    sampler_free(&s->sampler);
    free(s->line);
}

/* Draws request r's next token and says whether it ended the request. Draw i of a request uses
 * counter i of STREAM_GENERATE under the request's seed: what it is batched with changes nothing. */
static void next_token(Server* s, Request* r, double t0) {
    double u = rng_uniform(r->seed, STREAM_GENERATE, (uint64_t)r->n_out);
    int tok;
    if (r->want_logits == 2 && r->n_out > 0) emit_gen_logits(r, s->V); /* the prompt's: serve_batch */
    tok = sample_token(&s->sampler, r->logits, r->temperature, r->top_k, r->top_p, u);
    r->out[r->n_out++] = tok;
    emit_gen_token(r, tok);
    if (id_in(tok, r->stop, r->n_stop)) r->reason = "stop";
    else if (r->n_out >= r->max_tokens) r->reason = "length";
    else if (r->n_prompt + r->n_out >= s->T) r->reason = "context"; /* the window is full */
    if (r->reason) emit_gen_done(r, now_ms() - t0);
}

/* Decodes the good requests among req[0:n] together: each prompt is prefilled into its slot, then
 * every step draws one token per unfinished request and runs one engine_decode for all of them. */
static void serve_batch(Server* s, int n) {
    double t0 = now_ms();
    int i, active;
    for (i = 0; i < n; i++) {
        Request* r = &s->req[i];
        if (r->error[0]) continue;
        r->n_out = 0;
        r->reason = NULL;
        r->logits = s->prefill_logits + (size_t)i * s->V;
        engine_prefill(i, r->prompt, r->n_prompt, s->prefill_logits + (size_t)i * s->V);
        if (r->want_logits) emit_gen_logits(r, s->V);
        if (r->max_tokens == 0 || r->n_prompt == s->T) {
            r->reason = r->max_tokens == 0 ? "length" : "context";
            emit_gen_done(r, now_ms() - t0);
        }
    }
    for (;;) {
        for (i = 0, active = 0; i < n; i++) {
            Request* r = &s->req[i];
            if (r->error[0] || r->reason) continue;
            next_token(s, r, t0);
            if (r->reason) continue;
            s->slots[active] = i;
            s->tokens[active] = r->out[r->n_out - 1];
            s->positions[active] = r->n_prompt + r->n_out - 1;
            active++;
        }
        if (active == 0) return;
        engine_decode(active, s->slots, s->tokens, s->positions, s->step_logits);
        for (i = 0; i < active; i++) s->req[s->slots[i]].logits = s->step_logits + (size_t)i * s->V;
    }
}

/* The next line of stdin (its '\n' dropped) into s->line, NUL-terminated: at most s->line_max bytes
 * are kept, the rest of a longer line is read and dropped (*too_long), never held. Returns the
 * bytes kept, or -1 at the end of the requests or when a read failed (ferror). */
static ssize_t read_request_line(Server* s, int* too_long) {
    size_t n = 0;
    int ch;
    *too_long = 0;
    while ((ch = getc_unlocked(stdin)) != EOF && ch != '\n') {
        if (n == s->line_max) {
            *too_long = 1;
            continue;
        }
        if (n + 1 == s->line_cap) { /* room for the NUL, always */
            char* bigger;
            s->line_cap = s->line_cap <= s->line_max / 2 ? 2 * s->line_cap : s->line_max + 1;
            if (!(bigger = (char*)realloc(s->line, s->line_cap))) die_io("out of memory for a request line");
            s->line = bigger;
        }
        s->line[n++] = (char)ch;
    }
    if (ferror(stdin) || (ch == EOF && n == 0 && !*too_long)) return -1;
    s->line[n] = '\0';
    return (ssize_t)n;
}

/* One stdin line: a request object or an array of them. A line that is not JSON of that form, or
 * a batch larger than max_batch, is one error event (id null, or a lone request's id when it was
 * read before the fault); a bad request in a batch, and each of the batch's requests that share an
 * id (refuse_shared_ids), is an error event of its own and the others are served. A line longer
 * than s->line_max (too_long: line is its first line_max bytes) is one error event too, with the id
 * of a lone request read before the cut. */
static void serve_line(Server* s, const char* line, size_t len, int too_long) {
    JsonIn j;
    int n = 0, i, batch;
    if (!too_long && strlen(line) != len) { /* read as a C string, the bytes past it would be dropped unseen */
        char msg[80];
        snprintf(msg, sizeof msg, "not a request line (a NUL byte at byte %d)", (int)strlen(line));
        emit_gen_error("null", msg);
        return;
    }
    j.p = line;
    j.syntax_error = NULL;
    js_ws(&j);
    if (!*j.p && !too_long) return; /* blank line */
    batch = *j.p == '[';
    strcpy(s->req[0].id, "null");
    if (batch) {
        j.p++;
        js_ws(&j);
        if (*j.p == ']') {
            j.p++;
        } else {
            for (;;) {
                Request scratch, *r = n < s->max_batch ? &s->req[n] : &scratch;
                if (r == &scratch) { /* count the rest, parse nothing into the slots */
                    if (!js_skip(&j, 0)) break;
                } else if (!parse_request(&j, r, s->cfg)) {
                    break;
                }
                n++;
                js_ws(&j);
                if (*j.p == ',') j.p++;
                else if (*j.p == ']') {
                    j.p++;
                    break;
                } else {
                    js_fail(&j, "expected ',' or ']'");
                    break;
                }
            }
        }
    } else if (parse_request(&j, &s->req[0], s->cfg)) {
        n = 1;
    }
    if (too_long) {
        char msg[160];
        snprintf(msg, sizeof msg, "the request line is longer than %zu bytes, the most a request line may hold "
                 "here; the rest of it was skipped", s->line_max);
        emit_gen_error(batch ? "null" : s->req[0].id, msg);
        return;
    }
    js_ws(&j);
    if (!j.syntax_error && *j.p) js_fail(&j, "text after the request");
    if (j.syntax_error) {
        char msg[160];
        snprintf(msg, sizeof msg, "not a request line (%s at byte %d)", j.syntax_error, (int)(j.p - line));
        emit_gen_error(batch ? "null" : s->req[0].id, msg); /* a lone request's id, if read before */
        return;
    }
    if (n == 0) {
        emit_gen_error("null", "an empty batch");
        return;
    }
    if (n > s->max_batch) {
        char msg[160];
        snprintf(msg, sizeof msg, "a batch of %d requests; at most --generate.max_batch %d decode together", n,
                 s->max_batch);
        emit_gen_error("null", msg);
        return;
    }
    refuse_shared_ids(s->req, n);
    for (i = 0; i < n; i++)
        if (s->req[i].error[0]) emit_gen_error(s->req[i].id, s->req[i].error);
    serve_batch(s, n);
}

/* --generate: set the engine up for generation, then serve stdin until EOF (exit 0). */
static int generate_main(int argc, char** argv) {
    static Config cfg; /* static: Config holds paths */
    Config* c = &cfg;
    ParamLayout layout;
    Sidecar side = {0, NULL, 0};
    Server server;
    ssize_t len;
    CkptChecked checked;
    int too_long;
    config_parse_for_checkpoint(c, argc, argv, &side);
    param_layout_init(&layout, c);
    param_layout_check(c, &layout);
    /* before any large allocation; a model flag on the command line that gives another shape of as many
     * parameters (--model.n_head 2 for 4) is refused there: the weights would be read as another
     * model's, its answers wrong */
    checked = ckpt_check(c, layout.n_params, &side);
    sidecar_free(&side);
    c->train.batch_size = 1; /* the prefill's forward buffers: one window */
    g_quiet_events = 1;      /* stdout is the protocol's; the memory plan goes to stderr */
    engine_setup(c);
    load_weights(c, layout.n_params, &checked);
    info("%s engine, %s (computing in %s): %s at step %d; reading requests on stdin", engine_name(),
         c->train.precision, engine_compute_precision(c), c->checkpoint.path, checked.step);
    server_init(&server, c);
    while ((len = read_request_line(&server, &too_long)) >= 0) serve_line(&server, server.line, (size_t)len, too_long);
    /* not the end of the requests: a read that failed (stdin a directory, closed) */
    if (ferror(stdin)) die_io("cannot read the requests on standard input (%s)", strerror(errno));
    server_free(&server);
    engine_shutdown();
    param_layout_free(&layout);
    return 0;
}

#endif
