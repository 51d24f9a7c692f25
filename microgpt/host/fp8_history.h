/* fp8_history.h: the amax histories of delayed fp8 scaling (docs/DESIGN.md §18) in the checkpoint
 * sidecar, and across the ranks of a data-parallel run (§17). They are training state: a run
 * resumed without them casts its next forwards at other scales, so they travel with the checkpoint
 * to keep resume bit-exact. One sidecar member, ",\"fp8_history\":{\"len\":16,\"exp\":[[...],...]}", one array per
 * history (layer-major, the engine's order), oldest exponent first. */
#ifndef MICROGPT_HOST_FP8_HISTORY_H
#define MICROGPT_HOST_FP8_HISTORY_H

#include "../cpu/fp8.h"
#include "checkpoint.h"
#include "dist.h"

/* The sidecar member for the n histories h (n = 0: ""). */
static void fp8_history_sidecar_json(const Fp8History* h, int n, char* out, size_t cap) {
    size_t len = 0;
    int t, i;
    out[0] = '\0';
    if (n == 0) return;
    len += (size_t)snprintf(out, cap, ",\"fp8_history\":{\"len\":%d,\"exp\":[", FP8_HISTORY_LEN);
    for (t = 0; t < n; t++) {
        len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, "%s[", t ? "," : "");
        for (i = 0; i < h[t].count; i++)
            len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, "%s%d", i ? "," : "", h[t].exp[i]);
        len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, "]");
    }
    if (len < cap) len += (size_t)snprintf(out + len, cap - len, "]}");
    if (len >= cap) die_io("internal: the fp8 histories do not fit the sidecar buffer");
}

/* What a sidecar holds of the histories: no member (a checkpoint of current scaling, or written
 * before they existed), another length (a build with another FP8_HISTORY_LEN: well-formed, but not
 * this build's), histories of this length, or a member that is not well-formed (damage). */
enum { FP8_HISTORY_ABSENT, FP8_HISTORY_OTHER_SHAPE, FP8_HISTORY_FOUND, FP8_HISTORY_DAMAGED };

/* One more history at h[t] of an array of *cap, which grows (doubling) to hold it. */
static Fp8History* fp8_history_grow(Fp8History* h, int t, int* cap) {
    if (t < *cap) return h;
    *cap = *cap ? 2 * *cap : 64;
    if (!(h = (Fp8History*)realloc(h, (size_t)*cap * sizeof(Fp8History))))
        die_io("out of memory for the checkpoint's fp8 histories");
    return h;
}

/* Parses the member of `text` (any JSON whitespace between its tokens) in one pass: its histories
 * into *h (allocated as they come; NULL when there are none; free() it whatever is returned),
 * their count into *n. */
static int fp8_history_parse(const char* text, Fp8History** h, int* n) {
    const char* p = json_find_member(text, "fp8_history");
    double len;
    char* end;
    int t, count, cap = 0;
    *n = 0;
    *h = NULL;
    if (!p) return FP8_HISTORY_ABSENT;
    if (!json_find_number(p, "len", &len) || !(len >= 1) || len != floor(len) || !(p = json_find_member(p, "exp")))
        return FP8_HISTORY_DAMAGED;
    if (*(p = json_skip_space(p)) != '[') return FP8_HISTORY_DAMAGED;
    for (p++, t = 0; *(p = json_skip_space(p)) != ']'; t++) {
        if (t && *p++ != ',') return FP8_HISTORY_DAMAGED;
        if (*(p = json_skip_space(p)) != '[') return FP8_HISTORY_DAMAGED;
        *h = fp8_history_grow(*h, t, &cap);
        for (p++, count = 0; *(p = json_skip_space(p)) != ']'; count++) {
            long e;
            if (count && *p++ != ',') return FP8_HISTORY_DAMAGED;
            p = json_skip_space(p);
            if (*p != '-' && (*p < '0' || *p > '9')) return FP8_HISTORY_DAMAGED; /* strtol would take "+1", " 1" */
            e = strtol(p, &end, 10);
            if (end == p || count >= len || e < -FP8_SCALE_EXP_LIMIT ||
                (e > FP8_SCALE_EXP_LIMIT && e != FP8_HISTORY_NONE))
                return FP8_HISTORY_DAMAGED;
            if (count < FP8_HISTORY_LEN) (*h)[t].exp[count] = (signed char)e;
            p = end;
        }
        (*h)[t].count = count < FP8_HISTORY_LEN ? count : FP8_HISTORY_LEN;
        p++;
    }
    *n = t;
    return len == FP8_HISTORY_LEN ? FP8_HISTORY_FOUND : FP8_HISTORY_OTHER_SHAPE;
}

/* dist (§17): the n histories of every rank become one, entry by entry the smallest exponent (the
 * largest amax) over the ranks, on every rank. Called after every step: each rank pushes the same
 * number of entries (its micro-batches), so the entries line up, and then every rank holds rank 0's
 * histories, the ones its checkpoint keeps. A minimum of integers: the same in any order. */
static void fp8_history_min_over_ranks(Fp8History* h, int n) {
    size_t bytes = (size_t)n * sizeof(Fp8History);
    Fp8History* all;
    int r, t, i;
    if (g_dist.world == 1 || n == 0) return;
    all = (Fp8History*)dist_scratch((size_t)g_dist.world * bytes);
    dist_gather(h, bytes, all);
    if (g_dist.rank == 0)
        for (r = 1; r < g_dist.world; r++)
            for (t = 0; t < n; t++) {
                const Fp8History* o = &all[(size_t)r * n + t];
                if (o->count != h[t].count)
                    die_io("internal: rank %d keeps %d entries of fp8 history %d, rank 0 %d", r, o->count, t, h[t].count);
                for (i = 0; i < h[t].count; i++)
                    if (o->exp[i] < h[t].exp[i]) h[t].exp[i] = o->exp[i];
            }
    dist_broadcast(h, bytes);
}

/* The histories a resumed run found in its checkpoint's sidecar. */
typedef struct {
    int state;     /* FP8_HISTORY_ABSENT, _OTHER_SHAPE or _FOUND: a damaged member was refused */
    int n;         /* histories in the member */
    Fp8History* h; /* [n] when FP8_HISTORY_FOUND, else NULL; free() it */
} Fp8HistoryMember;

/* Reads the member of `side`, the sidecar of the checkpoint `ckpt_path` being resumed, which
 * ckpt_check accepted, before any large allocation: a member that is there but not well-formed
 * refuses the resume (one error, nothing changed: damage, not age, as the crc32c). Its shape is
 * checked only after the engine is set up (fp8_history_resumed): how many histories the engine
 * keeps (FP8_DELAYED_PER_LAYER a layer, which a build's macros change) is the engine's to say. */
static void fp8_history_read(const char* ckpt_path, const Sidecar* side, Fp8HistoryMember* m) {
    m->state = FP8_HISTORY_ABSENT;
    m->n = 0;
    m->h = NULL;
    if (!side->text) return;
    m->state = fp8_history_parse(side->text, &m->h, &m->n);
    if (m->state == FP8_HISTORY_DAMAGED) {
        CkptFiles f;
        ckpt_files(ckpt_path, &f);
        ckpt_refuse_damaged(&f, "has a sidecar whose fp8_history member is not well-formed (damaged or edited)");
    }
    if (m->state != FP8_HISTORY_FOUND) {
        free(m->h);
        m->h = NULL;
    }
}

/* The member's histories for an engine that keeps n (layer-major), or NULL with a warning when the
 * sidecar has none of this shape (none, or another build's count or length): the engine's
 * histories stay empty and the first forward scales by its own amax. */
static const Fp8History* fp8_history_resumed(const Fp8HistoryMember* m, const char* ckpt_path, int n) {
    if (m->state == FP8_HISTORY_FOUND && m->n == n) return m->h;
    warn("checkpoint sidecar %s.json holds no fp8 scale history for %d tensors of length %d: delayed scaling starts "
         "afresh (the resumed run is not bit-identical to an uninterrupted one)", ckpt_path, n, FP8_HISTORY_LEN);
    return NULL;
}

#endif
