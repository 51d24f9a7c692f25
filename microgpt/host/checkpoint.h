/* checkpoint.h: checkpoint files (SPEC §3), exactly
 *   [int32 step][int32 n_params][n_params f32 weights][n_params f32 m][n_params f32 v]
 * little-endian (the host byte order of every machine we target), and the JSON sidecar PATH.json
 * holding what exact resume needs beyond that (loss scale) plus a config fingerprint.
 * Both files are written to a temporary file, flushed, fsynced and renamed, so a crash or a full
 * disk leaves the previous good checkpoint in place, never a torn one.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_CHECKPOINT_H
#define MICROGPT_HOST_CHECKPOINT_H

#include "config.h"
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#define CKPT_HEADER_BYTES 8

static size_t ckpt_expected_bytes(size_t n_params) { return CKPT_HEADER_BYTES + 3 * 4 * n_params; }

/* ---------------------------------------------------------------------------------------------- */
/* Writing */

/* Raw file descriptors rather than stdio: no hidden buffer allocation inside the training loop, and
 * every short write or error is seen. Returns 1 when all bytes were written. */
static int write_all(int fd, const void* p, size_t bytes) {
    const char* c = (const char*)p;
    while (bytes > 0) {
        size_t chunk = bytes < ((size_t)1 << 30) ? bytes : ((size_t)1 << 30);
        ssize_t w = write(fd, c, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0;
        c += w;
        bytes -= (size_t)w;
    }
    return 1;
}

/* fsync + close of a temporary file; 0 on success. */
static int close_durably(int fd) {
    int ok = fsync(fd) == 0;
    ok = (close(fd) == 0) && ok;
    return ok ? 0 : -1;
}

/* The directory holding `path` ("." for a bare file name, "/" for a file in the root). */
static void parent_dir(const char* path, char* dir, size_t cap) {
    char* slash;
    snprintf(dir, cap, "%s", path);
    slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, cap, ".");
    else if (slash == dir) dir[1] = '\0';
    else *slash = '\0';
}

/* The rename is only durable once the directory entry is on disk too. Best effort. */
static void fsync_parent_dir(const char* path) {
    char dir[CFG_PATH_MAX];
    int fd;
    parent_dir(path, dir, sizeof dir);
    fd = open(dir, O_RDONLY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

static void sidecar_text(char* buf, size_t cap, int step, size_t n_params, float loss_scale, const Config* c) {
    char ls[32];
    snprintf(buf, cap,
             "{\"step\":%d,\"n_params\":%zu,\"loss_scale\":%s,\"fingerprint\":{\"n_layer\":%d,\"d_model\":%d,"
             "\"n_head\":%d,\"d_ff\":%d,\"seq_len\":%d,\"vocab_size\":%d,\"padded_vocab_size\":%d,\"seed\":%d,"
             "\"batch_size\":%d,\"grad_accum\":%d,\"steps\":%d,\"precision\":\"%s\"}}\n",
             step, n_params, json_num(ls, sizeof ls, loss_scale), c->model.n_layer, c->model.d_model, c->model.n_head,
             c->model.d_ff, c->model.seq_len, c->model.vocab_size, c->model.padded_vocab_size, c->train.seed,
             c->train.batch_size, c->train.grad_accum, c->train.steps, c->train.precision);
}

/* Temporary files of a writer that was killed (PATH.tmpPID, PATH.json.tmpPID whose process no
 * longer exists) are removed before writing, so crashes never pile up checkpoint-sized leftovers
 * on the disk. Another live process's temporary files are left alone. */
static void ckpt_remove_stale_temps(const char* path) {
    char dir[CFG_PATH_MAX], victim[2 * CFG_PATH_MAX + 8];
    const char* base = strrchr(path, '/');
    const char* suffixes[2] = {".tmp", ".json.tmp"};
    size_t base_len;
    struct dirent* e;
    DIR* d;
    base = base ? base + 1 : path;
    base_len = strlen(base);
    parent_dir(path, dir, sizeof dir);
    if (!(d = opendir(dir))) return;
    while ((e = readdir(d)) != NULL) {
        int k;
        if (strncmp(e->d_name, base, base_len) != 0) continue;
        for (k = 0; k < 2; k++) {
            const char* rest = e->d_name + base_len;
            size_t sl = strlen(suffixes[k]);
            char* end;
            long pid;
            if (strncmp(rest, suffixes[k], sl) != 0 || !rest[sl]) continue;
            pid = strtol(rest + sl, &end, 10);
            if (*end || pid <= 0 || pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
            snprintf(victim, sizeof victim, "%s/%s", dir, e->d_name);
            if (unlink(victim) == 0) info("removed %s, left by a writer that no longer runs", victim);
        }
    }
    closedir(d);
}

/* Writes checkpoint + sidecar atomically. On any I/O failure the temporary files are removed, the
 * previous checkpoint is left untouched, and the process exits with an error (the caller can't
 * carry on believing it has a checkpoint it doesn't have). */
static void ckpt_write(const char* path, int step, const float* params, const float* m, const float* v, size_t n,
                       float loss_scale, const Config* c) {
    char tmp[CFG_PATH_MAX + 32], side[CFG_PATH_MAX + 8], side_tmp[CFG_PATH_MAX + 40], text[1024];
    int32_t header[2];
    int fd, ok, e;
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    snprintf(side, sizeof side, "%s.json", path);
    snprintf(side_tmp, sizeof side_tmp, "%s.json.tmp%d", path, (int)getpid());
    ckpt_remove_stale_temps(path);
    header[0] = step;
    header[1] = (int32_t)n;

    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) die_io("cannot create checkpoint %s: %s", tmp, strerror(errno));
    ok = write_all(fd, header, sizeof header) && write_all(fd, params, n * 4) && write_all(fd, m, n * 4) &&
         write_all(fd, v, n * 4);
    e = errno;
    if (close_durably(fd) != 0 || !ok) {
        if (ok) e = errno;
        unlink(tmp);
        die_io("writing checkpoint %s failed (%s); the previous checkpoint, if any, is untouched", path, strerror(e));
    }

    sidecar_text(text, sizeof text, step, n, loss_scale, c);
    fd = open(side_tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        e = errno;
        unlink(tmp);
        die_io("cannot create checkpoint sidecar %s: %s", side_tmp, strerror(e));
    }
    ok = write_all(fd, text, strlen(text));
    e = errno;
    if (close_durably(fd) != 0 || !ok) {
        if (ok) e = errno;
        unlink(tmp);
        unlink(side_tmp);
        die_io("writing checkpoint sidecar %s failed (%s); the previous checkpoint, if any, is untouched", side,
               strerror(e));
    }
    /* Checkpoint first, then sidecar. A crash in between leaves a sidecar whose step disagrees with
     * the checkpoint; the reader notices that and ignores the stale sidecar. */
    if (rename(tmp, path) != 0) {
        e = errno;
        unlink(tmp);
        unlink(side_tmp);
        die_io("renaming %s to %s failed: %s", tmp, path, strerror(e));
    }
    if (rename(side_tmp, side) != 0) {
        e = errno;
        unlink(side_tmp);
        die_io("renaming %s to %s failed: %s", side_tmp, side, strerror(e));
    }
    fsync_parent_dir(path);
}

/* ---------------------------------------------------------------------------------------------- */
/* Reading */

/* Validates header and size against the config's n_params without reading the weights (so it can
 * run before any large allocation). Returns the checkpoint's step. Dies on any mismatch; the file
 * is left as it is. */
static int ckpt_check(const char* path, size_t n_params) {
    struct stat st;
    int32_t header[2];
    FILE* f;
    if (stat(path, &st) != 0) die_input("checkpoint %s does not exist (drop --resume to start a fresh run)", path);
    f = fopen(path, "rb");
    if (!f) die_input("cannot open checkpoint %s: %s", path, strerror(errno));
    if (fread(header, 1, sizeof header, f) != sizeof header) {
        fclose(f);
        die_input("checkpoint %s is truncated: %lld bytes, shorter than its 8-byte header", path, (long long)st.st_size);
    }
    fclose(f);
    if (header[1] < 0 || (size_t)header[1] != n_params)
        die_input("checkpoint %s has n_params %d but this config needs %zu (different model shape?); "
                  "refusing to load or overwrite it", path, header[1], n_params);
    if ((size_t)st.st_size != ckpt_expected_bytes(n_params))
        die_input("checkpoint %s is %lld bytes, expected %zu for %zu parameters (truncated or corrupt); "
                  "refusing to load or overwrite it", path, (long long)st.st_size, ckpt_expected_bytes(n_params), n_params);
    if (header[0] < 0) die_input("checkpoint %s has a negative step %d", path, header[0]);
    return header[0];
}

/* Reads weights, m and v (n floats each) of a checkpoint that ckpt_check accepted; m and v NULL:
 * the weights only (--generate, --evaluate). */
static void ckpt_load(const char* path, size_t n, float* params, float* m, float* v) {
    FILE* f = fopen(path, "rb");
    int ok;
    if (!f) die_input("cannot open checkpoint %s: %s", path, strerror(errno));
    ok = fseek(f, CKPT_HEADER_BYTES, SEEK_SET) == 0 && fread(params, 4, n, f) == n &&
         (!m || (fread(m, 4, n, f) == n && fread(v, 4, n, f) == n));
    fclose(f);
    if (!ok) die_input("reading checkpoint %s failed (changed while reading?)", path);
}

/* Tiny JSON lookup for the sidecar: the number after "key": anywhere in text (sidecar keys are
 * unique, so no nesting logic is needed). Returns 1 if found. */
static int json_find_number(const char* text, const char* key, double* out) {
    char pat[64];
    const char* p;
    char* end;
    snprintf(pat, sizeof pat, "\"%s\"", key);
    p = strstr(text, pat);
    if (!p) return 0;
    p += strlen(pat);
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    if (*p++ != ':') return 0;
    *out = strtod(p, &end);
    return end != p;
}

/* Reads PATH.json. Returns the loss scale to resume with (0: engine default). A missing, malformed
 * or stale sidecar is a warning, not an error: only the loss scale depends on it. Fingerprint
 * differences (e.g. resuming a bf16 run in fp32) are reported and allowed. */
static float sidecar_read(const char* path, int ckpt_step, const Config* c) {
    char side[CFG_PATH_MAX + 8], text[4096];
    size_t len;
    double x;
    float loss_scale = 0.0f;
    int i;
    FILE* f;
    struct { const char* key; int value; } fp[10];
    snprintf(side, sizeof side, "%s.json", path);
    f = fopen(side, "rb");
    if (!f) {
        warn("checkpoint sidecar %s is missing; the loss scale starts from its default", side);
        return 0.0f;
    }
    len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = '\0';
    if (!json_find_number(text, "step", &x) || (int)x != ckpt_step) {
        warn("checkpoint sidecar %s does not belong to step %d of %s; ignoring it", side, ckpt_step, path);
        return 0.0f;
    }
    if (json_find_number(text, "loss_scale", &x)) loss_scale = (float)x;
    fp[0].key = "n_layer"; fp[0].value = c->model.n_layer;
    fp[1].key = "d_model"; fp[1].value = c->model.d_model;
    fp[2].key = "n_head"; fp[2].value = c->model.n_head;
    fp[3].key = "d_ff"; fp[3].value = c->model.d_ff;
    fp[4].key = "seq_len"; fp[4].value = c->model.seq_len;
    fp[5].key = "vocab_size"; fp[5].value = c->model.vocab_size;
    fp[6].key = "padded_vocab_size"; fp[6].value = c->model.padded_vocab_size;
    fp[7].key = "seed"; fp[7].value = c->train.seed;
    fp[8].key = "batch_size"; fp[8].value = c->train.batch_size;
    fp[9].key = "grad_accum"; fp[9].value = c->train.grad_accum;
    for (i = 0; i < (int)(sizeof fp / sizeof fp[0]); i++)
        if (json_find_number(text, fp[i].key, &x) && (int)x != fp[i].value)
            warn("resuming with %s = %d, the checkpoint was written with %d", fp[i].key, fp[i].value, (int)x);
    {
        /* A loss scale belongs to the precision whose run produced it (non-fp16 runs record 1):
         * resuming in another precision starts from the engine's default scale. */
        char saved[16] = "";
        const char* p = strstr(text, "\"precision\":\"");
        size_t k = 0;
        if (p)
            for (p += 13; p[k] && p[k] != '"' && k + 1 < sizeof saved; k++) saved[k] = p[k];
        saved[k] = '\0';
        if (p && strcmp(saved, c->train.precision) != 0) {
            warn("resuming in precision %s, the checkpoint was written in %s; the loss scale starts from its default",
                 c->train.precision, saved);
            loss_scale = 0.0f;
        }
    }
    return loss_scale;
}

#endif
