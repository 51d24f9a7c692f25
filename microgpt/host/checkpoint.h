/* checkpoint.h: checkpoint files (docs/DESIGN.md §3), exactly
 *   [int32 step][int32 n_params][n_params f32 weights][n_params f32 m][n_params f32 v]
 * little-endian (the host byte order of every machine we target), and the JSON sidecar PATH.json
 * holding what exact resume needs beyond that (loss scale), the CRC-32C of the checkpoint's bytes,
 * a config fingerprint and the CRC-32C of its own values (sidecar_values_crc32c).
 * Two slots: before PATH is replaced, the checkpoint it holds gets a second name, PATH.prev (with
 * PATH.prev.json), so a damaged newest checkpoint never leaves only a bad file.
 * Every file is written to a temporary name, flushed, fsynced and renamed, in an order that keeps
 * at least one slot whole (checkpoint and its own sidecar) at every instant: a crash or a full disk
 * leaves a good checkpoint in place, never only a torn one.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_CHECKPOINT_H
#define MICROGPT_HOST_CHECKPOINT_H

#include "config.h"
#include "crc32c.h"
#include "files.h"
#include <dirent.h>
#include <fcntl.h>
#include <float.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define CKPT_HEADER_BYTES 8
#define CKPT_SIDECAR_MAX 65536 /* the writer's buffer: a run whose longest sidecar outgrows it is refused at start */
#define CKPT_SIDECAR_OWN_MAX 1024 /* sidecar_text's own members (~0.4 KB) */
#define SIDECAR_DATA_MAX 32 /* the training data's fingerprint: ,"data_crc32c":4294967295 (train_loop.h) */

/* The longest state mixture_sidecar_json (mixture.h) writes: CFG_MAX_SOURCES sources, every number
 * as wide as put_double writes one (sign, 17 digits, point, "e-308": 24 characters), the rest
 * (the probe set's and the names' CRCs among it) under 160. */
#define MIXTURE_SIDECAR_MAX (160 + (2 + 2 * CFG_MAX_SOURCES) * (24 + 1))

/* A reader takes a sidecar up to this many times the longest one the writer makes for the model:
 * a valid sidecar re-indented by hand or by a tool (json.dump(indent=4) turns a 5-byte fp8 history
 * entry "-126," into a 22-byte line) is still read, an absurd one is refused as damage. */
#define SIDECAR_SPACE_FACTOR 16

/* The longest member fp8_history_sidecar_json (fp8_history.h) writes for n histories: every entry
 * as wide as an exponent is written ("-126", -FP8_SCALE_EXP_LIMIT). */
static size_t fp8_history_member_max(size_t n) {
    size_t head = (size_t)snprintf(NULL, 0, ",\"fp8_history\":{\"len\":%d,\"exp\":[", FP8_HISTORY_LEN);
    size_t entry = (size_t)snprintf(NULL, 0, "%d", -FP8_SCALE_EXP_LIMIT);
    size_t history = 2 + FP8_HISTORY_LEN * entry + (FP8_HISTORY_LEN - 1); /* "[e,...,e]" */
    return n == 0 ? 0 : head + n * history + (n - 1) + 2;
}

/* The longest sidecar a run of n_layer layers writes: its own members, the training data's
 * fingerprint, the bandit state and the fp8 histories (FP8_DELAYED_PER_LAYER a layer), each at its
 * longest. The one place for the fact: train_loop.h refuses a run whose sidecar could outgrow
 * CKPT_SIDECAR_MAX, the readers take SIDECAR_SPACE_FACTOR times it (sidecar_load). */
static size_t sidecar_longest(size_t n_layer) {
    return CKPT_SIDECAR_OWN_MAX + SIDECAR_DATA_MAX + MIXTURE_SIDECAR_MAX +
           fp8_history_member_max(FP8_DELAYED_PER_LAYER * n_layer);
}

/* The most bytes a reader takes in the sidecar of a model of n_layer layers (CFG_MAX_LAYERS when the
 * sidecar is read to learn the model): no writer writes more than CKPT_SIDECAR_MAX. */
static size_t sidecar_read_max(size_t n_layer) {
    size_t longest = sidecar_longest(n_layer);
    return SIDECAR_SPACE_FACTOR * (longest < CKPT_SIDECAR_MAX ? longest : CKPT_SIDECAR_MAX);
}

static size_t ckpt_expected_bytes(size_t n_params) { return CKPT_HEADER_BYTES + 3 * 4 * n_params; }

/* The four files of a checkpoint at `path`: the newest slot and the previous one, each with its
 * sidecar. */
typedef struct {
    char ckpt[CFG_PATH_MAX], side[CFG_PATH_MAX + 8], prev[CFG_PATH_MAX + 8], prev_side[CFG_PATH_MAX + 16];
    char lock[CFG_PATH_MAX + 8]; /* ckpt_lock's */
} CkptFiles;

static void ckpt_files(const char* path, CkptFiles* f) {
    snprintf(f->ckpt, sizeof f->ckpt, "%s", path);
    snprintf(f->side, sizeof f->side, "%s.json", path);
    snprintf(f->prev, sizeof f->prev, "%s.prev", path);
    snprintf(f->prev_side, sizeof f->prev_side, "%s.prev.json", path);
    snprintf(f->lock, sizeof f->lock, "%s.lock", path);
}

/* Bounce buffer for streaming a checkpoint (checksum, copy): static, so no allocation happens
 * inside the training loop and none before validation. */
static char ckpt_io_buf[1 << 20];

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

/* A rename is only durable once the directory entry is on disk too. Best effort. */
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

static int json_find_number(const char* text, const char* key, double* out);
static int json_find_string(const char* text, const char* key, char* out, size_t cap);

/* The sidecar's values that nothing else checks (step and crc32c are checked against the
 * checkpoint's bytes), in the order of their canonical text (sidecar_values_crc32c). The Python
 * reader (microgpt/checkpoint.py: SIDECAR_VALUE_NAMES) names the same, in the same order. */
static const char* const sidecar_value_names[] = {
    "n_params", "loss_scale", "n_layer", "d_model", "n_head", "d_ff", "seq_len", "vocab_size",
    "padded_vocab_size", "seed", "batch_size", "grad_accum", "steps", "precision", "fp8_classifier"};

/* The sidecar's "values_crc32c" for its text: the CRC-32C of the canonical text of its values, each
 * of sidecar_value_names as the readers find it, "NAME=%.17g;" for a number (-0 as 0: Python's json
 * reads "-0" as the int 0), "NAME=\"TEXT\";" for a string (json_find_string's bytes), "NAME;" for a
 * member missing or of another type. Of the values, not of the bytes: a sidecar re-indented or
 * rewritten by Python's json keeps its checksum, an edited vocab_size or n_head (the checkpoint's
 * size does not change with them) fails it. */
static uint32_t sidecar_values_crc32c(const char* text) {
    char item[96], str[32];
    double x;
    uint32_t crc = 0;
    size_t i;
    for (i = 0; i < sizeof sidecar_value_names / sizeof sidecar_value_names[0]; i++) {
        const char* name = sidecar_value_names[i];
        if (json_find_number(text, name, &x)) snprintf(item, sizeof item, "%s=%.17g;", name, x + 0.0);
        else if (json_find_string(text, name, str, sizeof str)) snprintf(item, sizeof item, "%s=\"%s\";", name, str);
        else snprintf(item, sizeof item, "%s;", name);
        crc = crc32c_update(crc, item, strlen(item));
    }
    return crc;
}

/* text after the string in buf (cap bytes), cut to fit: train_loop.h refuses a run whose longest
 * sidecar would not fit (sidecar_longest). */
static void append_text(char* buf, size_t cap, const char* text) {
    size_t n = strlen(buf), k = strlen(text);
    if (k > cap - 1 - n) k = cap - 1 - n;
    memcpy(buf + n, text, k);
    buf[n + k] = '\0';
}

/* What a resume whose config differs from a sidecar's fingerprint setting does: refuse it (the
 * model's shape: ckpt_refuse_other_shape), warn (sidecar_loss_scale), or nothing (steps: a resumed
 * run may be lengthened). */
enum { SETTING_SHAPE, SETTING_WARN, SETTING_FREE };

/* The config's whole-number settings in the sidecar's fingerprint, in the order sidecar_text writes
 * them: the one list of them its readers check. */
static const struct {
    const char* key;
    size_t offset; /* of the int in Config */
    int on_resume; /* SETTING_* */
} sidecar_settings[] = {
    {"n_layer", offsetof(Config, model.n_layer), SETTING_SHAPE},
    {"d_model", offsetof(Config, model.d_model), SETTING_SHAPE},
    {"n_head", offsetof(Config, model.n_head), SETTING_SHAPE},
    {"d_ff", offsetof(Config, model.d_ff), SETTING_SHAPE},
    {"seq_len", offsetof(Config, model.seq_len), SETTING_SHAPE},
    {"vocab_size", offsetof(Config, model.vocab_size), SETTING_WARN},
    {"padded_vocab_size", offsetof(Config, model.padded_vocab_size), SETTING_SHAPE},
    {"seed", offsetof(Config, train.seed), SETTING_WARN},
    {"batch_size", offsetof(Config, train.batch_size), SETTING_WARN},
    {"grad_accum", offsetof(Config, train.grad_accum), SETTING_WARN},
    {"steps", offsetof(Config, train.steps), SETTING_FREE}};
#define SIDECAR_N_SETTINGS (sizeof sidecar_settings / sizeof sidecar_settings[0])

static int sidecar_setting(const Config* c, size_t i) {
    return *(const int*)((const char*)c + sidecar_settings[i].offset);
}

/* `extra`: further members of the sidecar object (",\"bandit\":{...}", mixture.h), or "". The
 * values' checksum is taken of the text it covers, as a reader takes it (sidecar_values_crc32c). */
static void sidecar_text(char* buf, size_t cap, int step, size_t n_params, uint32_t crc, float loss_scale,
                         const Config* c, const char* extra) {
    char ls[32], item[64], values[CKPT_SIDECAR_OWN_MAX];
    size_t i;
    snprintf(values, sizeof values, "\"n_params\":%zu,\"loss_scale\":%s,\"fingerprint\":{", n_params,
             json_num(ls, sizeof ls, loss_scale));
    for (i = 0; i < SIDECAR_N_SETTINGS; i++) {
        snprintf(item, sizeof item, "\"%s\":%d,", sidecar_settings[i].key, sidecar_setting(c, i));
        append_text(values, sizeof values, item);
    }
    snprintf(item, sizeof item, "\"precision\":\"%s\",\"fp8_classifier\":\"%s\"}", c->train.precision,
             c->train.fp8_classifier);
    append_text(values, sizeof values, item);
    snprintf(buf, cap, "{\"step\":%d,\"crc32c\":%lu,\"values_crc32c\":%lu,", step, (unsigned long)crc,
             (unsigned long)sidecar_values_crc32c(values));
    append_text(buf, cap, values);
    append_text(buf, cap, extra);
    append_text(buf, cap, "}\n");
}

/* Temporary files of a writer that was killed (PATH.tmpPID, PATH.json.tmpPID and those of the
 * previous slot, whose process no longer exists) are removed before writing, so crashes never pile
 * up checkpoint-sized leftovers on the disk. Another live process's temporary files are left alone. */
static void ckpt_remove_stale_temps(const char* path) {
    char dir[CFG_PATH_MAX], victim[2 * CFG_PATH_MAX + 8];
    const char* base = strrchr(path, '/');
    const char* suffixes[4] = {".tmp", ".json.tmp", ".prev.tmp", ".prev.json.tmp"};
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
        for (k = 0; k < 4; k++) {
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

/* Copies `from` to the new file `to` and fsyncs it; 0 on success. For file systems without hard
 * links only. */
static int copy_durably(const char* from, const char* to) {
    int in = open(from, O_RDONLY), out, ok = 1;
    ssize_t got;
    if (in < 0) return -1;
    out = open(to, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (out < 0) {
        close(in);
        return -1;
    }
    while (ok && (got = read(in, ckpt_io_buf, sizeof ckpt_io_buf)) != 0) {
        if (got < 0 && errno == EINTR) continue;
        ok = got > 0 && write_all(out, ckpt_io_buf, (size_t)got);
    }
    close(in);
    return close_durably(out) == 0 && ok ? 0 : -1;
}

/* Gives the bytes of `from` the name `to` as well, replacing `to` atomically: a hard link (no copy)
 * made under a temporary name and renamed over `to`; a durable copy where the file system has no
 * hard links. `from` is never touched. 0 on success. */
static int second_name(const char* from, const char* to) {
    char tmp[CFG_PATH_MAX + 48];
    snprintf(tmp, sizeof tmp, "%s.tmp%d", to, (int)getpid());
    unlink(tmp);
    if ((link(from, tmp) != 0 && copy_durably(from, tmp) != 0) || rename(tmp, to) != 0) {
        int e = errno;
        unlink(tmp);
        errno = e;
        return -1;
    }
    /* Where `to` was a name of `from` already (a writer killed between the renames of the two slots
     * leaves PATH.prev a second name of PATH), rename(2) does nothing and succeeds, leaving the
     * temporary name in place: it goes too. */
    unlink(tmp);
    return 0;
}

/* Before the newest slot is replaced, the checkpoint in it (written by this run, or verified when
 * it was resumed) becomes the previous slot: checkpoint first, then its sidecar, each by an atomic
 * rename, and all of it durable before the newest slot is touched. Until then the newest slot is
 * whole; from then on the previous one is. */
static int ckpt_keep_previous(const CkptFiles* f) {
    if (!file_exists(f->ckpt)) return 0;
    if (second_name(f->ckpt, f->prev) != 0) return -1;
    if (file_exists(f->side) ? second_name(f->side, f->prev_side) != 0 : unlink(f->prev_side) != 0 && errno != ENOENT)
        return -1;
    fsync_parent_dir(f->ckpt);
    return 0;
}

/* Writes the parts, in order, to the new file `tmp` and fsyncs it. 0 on success; on failure the
 * file is removed and the error number returned. The name is foreseeable (PATH.tmpPID): whatever
 * holds it is removed and the file created with O_EXCL, so a symbolic link planted there is never
 * written through. */
static int write_temp(const char* tmp, const void* const* parts, const size_t* bytes, int n_parts) {
    int fd, ok = 1, e, i;
    unlink(tmp);
    if ((fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644)) < 0) return errno;
    for (i = 0; i < n_parts && ok; i++) ok = write_all(fd, parts[i], bytes[i]);
    e = errno;
    if (close_durably(fd) != 0 || !ok) {
        if (ok) e = errno;
        unlink(tmp);
        return e ? e : EIO;
    }
    return 0;
}

/* Writes checkpoint + sidecar into the newest slot, the one it held kept as the previous slot. On
 * any I/O failure the temporary files are removed, both slots are left as they were, and the
 * process exits with an error (the caller can't carry on believing it has a checkpoint it doesn't
 * have). */
static void ckpt_write(const char* path, int step, const float* params, const float* m, const float* v, size_t n,
                       float loss_scale, const Config* c, const char* sidecar_extra) {
    char tmp[CFG_PATH_MAX + 32], side_tmp[CFG_PATH_MAX + 40], text[CKPT_SIDECAR_MAX];
    int32_t header[2];
    const void* parts[4];
    size_t bytes[4];
    uint32_t crc;
    int e, i, had_ckpt;
    CkptFiles f;
    ckpt_files(path, &f);
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    snprintf(side_tmp, sizeof side_tmp, "%s.json.tmp%d", path, (int)getpid());
    ckpt_remove_stale_temps(path);
    header[0] = step;
    header[1] = (int32_t)n;
    parts[0] = header; parts[1] = params; parts[2] = m; parts[3] = v;
    bytes[0] = sizeof header; bytes[1] = bytes[2] = bytes[3] = n * 4;
    for (crc = 0, i = 0; i < 4; i++) crc = crc32c_update(crc, parts[i], bytes[i]);

    if ((e = write_temp(tmp, parts, bytes, 4)) != 0)
        die_io("writing checkpoint %s failed (%s); the previous checkpoint, if any, is untouched", path, strerror(e));
    sidecar_text(text, sizeof text, step, n, crc, loss_scale, c, sidecar_extra);
    parts[0] = text;
    bytes[0] = strlen(text);
    if ((e = write_temp(side_tmp, parts, bytes, 1)) != 0) {
        unlink(tmp);
        die_io("writing checkpoint sidecar %s failed (%s); the previous checkpoint, if any, is untouched", f.side,
               strerror(e));
    }
    had_ckpt = file_exists(f.ckpt);
    if (ckpt_keep_previous(&f) != 0) {
        e = errno;
        unlink(tmp);
        unlink(side_tmp);
        die_io("keeping %s as %s failed (%s); %s itself is untouched", path, f.prev, strerror(e), path);
    }
    /* Sidecar first, then checkpoint. A crash in between leaves the new sidecar beside the old
     * checkpoint: the reader refuses that slot (step and checksum disagree), and the previous one
     * is whole; at the first write it leaves a sidecar without a checkpoint, i.e. no checkpoint. */
    if (rename(side_tmp, f.side) != 0) {
        e = errno;
        unlink(tmp);
        unlink(side_tmp);
        die_io("renaming %s to %s failed: %s", side_tmp, f.side, strerror(e));
    }
    if (rename(tmp, path) != 0) {
        /* The new sidecar is in place beside the old checkpoint, a pair a resume refuses. The old
         * sidecar, which PATH.prev.json names too now, takes its name back (where the slot had no
         * sidecar, or no checkpoint, the new one goes), so the newest slot is left as it was. */
        int restored;
        e = errno;
        restored = had_ckpt && file_exists(f.prev_side) ? second_name(f.prev_side, f.side) == 0 : unlink(f.side) == 0;
        unlink(tmp);
        if (restored) fsync_parent_dir(path);
        die_io("renaming %s to %s failed: %s; %s", tmp, path, strerror(e),
               restored ? "the newest checkpoint slot is left as it was"
                        : "the newest checkpoint slot is left with the new sidecar beside the old checkpoint");
    }
    fsync_parent_dir(path);
}

/* ---------------------------------------------------------------------------------------------- */
/* Checking and reading */

/* A checkpoint directory that cannot take a checkpoint (read-only, not ours, full) is refused up
 * front: found at the first save instead, it would cost every step trained until then. A probe
 * file with the longest name a save makes (the previous sidecar's temporary file, its pid at the
 * widest Linux gives) is made and removed, so a name too long for the file system is found too;
 * the free space must hold one more checkpoint and its sidecar (the previous slot is a hard link,
 * no copy), each in whole blocks, the sidecar at the longest this model's can be: asking for the
 * writer's whole buffer (CKPT_SIDECAR_MAX) refused the resume of a run whose next save fitted.
 * Space taken later by others is still the save's error. */
static void ckpt_check_writable(const char* path, const char* dir, size_t n_params, size_t n_layer) {
    char probe[CFG_PATH_MAX + 48];
    struct statvfs fs;
    unsigned long long free_bytes, need, block, side = sidecar_longest(n_layer);
    int fd;
    snprintf(probe, sizeof probe, "%s.prev.json.tmp%07d", path, (int)getpid());
    if ((fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0644)) < 0 && errno == ENAMETOOLONG)
        die_input("checkpoint name %s is too long: the files saved beside it (up to %s) exceed the file system's "
                  "limit on a name", path, probe);
    if (fd < 0)
        die_input("cannot create files in checkpoint directory %s (%s): no checkpoint could be saved", dir,
                  strerror(errno));
    close(fd);
    unlink(probe);
    if (side > CKPT_SIDECAR_MAX) side = CKPT_SIDECAR_MAX;
    if (statvfs(dir, &fs) != 0) return;
    block = fs.f_frsize ? fs.f_frsize : 1;
    need = ((ckpt_expected_bytes(n_params) + block - 1) / block + (side + block - 1) / block) * block;
    if ((free_bytes = (unsigned long long)fs.f_bavail * fs.f_frsize) < need)
        die_input("checkpoint directory %s has %llu bytes free; a checkpoint of this model needs %llu", dir,
                  free_bytes, need);
}

/* Refuses, before anything is done, checkpoint files that are not plain files (a directory; a FIFO,
 * on which every open would block; a device) or that lie in a directory that does not exist or
 * cannot take a checkpoint, and, for a fresh run (`fresh`), an existing checkpoint in either slot. */
static void ckpt_check_paths(const char* path, int fresh, size_t n_params, size_t n_layer) {
    CkptFiles f;
    const char* names[4];
    char dir[CFG_PATH_MAX];
    struct stat st;
    int i;
    ckpt_files(path, &f);
    names[0] = f.ckpt; names[1] = f.side; names[2] = f.prev; names[3] = f.prev_side;
    for (i = 0; i < 4; i++)
        if (stat(names[i], &st) == 0 && !S_ISREG(st.st_mode))
            die_input("checkpoint %s is %s, not a regular file", names[i], file_kind(st.st_mode));
    /* The lock is opened without following a link (ckpt_lock): a link or a directory there failed
     * that open after start-up, as an I/O error, and a FIFO was taken as the lock. */
    if (lstat(f.lock, &st) == 0 && !S_ISREG(st.st_mode))
        die_input("checkpoint lock %s is %s, not a regular file", f.lock, file_kind(st.st_mode));
    parent_dir(path, dir, sizeof dir);
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) die_input("checkpoint directory %s does not exist", dir);
    ckpt_check_writable(path, dir, n_params, n_layer);
    if (fresh && file_exists(f.ckpt))
        die_input("checkpoint %s already exists; pass --resume to continue that run, or remove it to start over", path);
    if (fresh && file_exists(f.prev)) /* the newest slot is gone: --resume alone would find nothing */
        die_input("previous checkpoint %s of an earlier run exists (and no %s); to continue that run from it, run "
                  "mv %s %s && mv %s %s, then run again (training: with --resume), or remove it to start over",
                  f.prev, f.ckpt, f.prev, f.ckpt, f.prev_side, f.side);
}

/* One engine writes a checkpoint path at a time: PATH.lock (made if missing, and left: removing it
 * would race a starting engine) is flock'ed for the life of the process, which the kernel releases
 * however it ends. A second engine given the same path (without the proxy, whose run directory has
 * its own lock) would otherwise train on beside the first, each replacing the other's checkpoints. */
static int g_ckpt_lock_fd = -1; /* PATH.lock while this process holds it */

static void ckpt_lock(const char* path) {
    CkptFiles f;
    int fd;
    if (g_ckpt_lock_fd >= 0) return; /* taken before the resume read (ckpt_lock_existing) */
    ckpt_files(path, &f);
    fd = open(f.lock, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    if (fd < 0) die_io("cannot open checkpoint lock %s: %s", f.lock, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK)
            die_input("checkpoint %s is in use: another engine holds %s (one engine a checkpoint path)", path, f.lock);
        die_io("cannot lock checkpoint lock %s: %s", f.lock, strerror(errno));
    }
    g_ckpt_lock_fd = fd; /* stays open: the lock lasts as long as this process */
}

/* ckpt_lock where PATH.lock exists already, so that nothing is left behind: a resume takes it before
 * it reads the checkpoint, which an engine holding it may be replacing. Read between that engine's
 * two renames, the checkpoint and its sidecar are of different steps, and a resume that read them
 * first called the pair damaged (and offered the way back to the previous slot) where the answer
 * is that the path is in use. Where PATH.lock is missing no engine holds it. */
static void ckpt_lock_existing(const char* path) {
    CkptFiles f;
    ckpt_files(path, &f);
    if (file_exists(f.lock)) ckpt_lock(path);
}

/* Step in the header of the checkpoint `path`, or -1 when it cannot be read. */
static int ckpt_header_step(const char* path) {
    int32_t header[2];
    int fd = open(path, O_RDONLY | O_NONBLOCK), ok;
    if (fd < 0) return -1;
    ok = read(fd, header, sizeof header) == (ssize_t)sizeof header;
    close(fd);
    return ok && header[0] >= 0 ? header[0] : -1;
}

/* Whether another process holds f's lock: an engine writing checkpoints there. --generate and
 * --evaluate take no lock (§15), so they may read between that engine's two renames, where the
 * checkpoint and its sidecar are of different steps; that pair is no damage to undo by hand. */
static int ckpt_lock_held_elsewhere(const CkptFiles* f) {
    const char* rank = getenv("RANK");
    int held, fd;
    /* ranks > 0 of a data-parallel run (§17) read the checkpoint while their own rank 0 holds it */
    if (g_ckpt_lock_fd >= 0 || (rank && atoi(rank) > 0)) return 0;
    fd = open(f->lock, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return 0;
    held = flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    close(fd);
    return held;
}

/* One error line for a damaged checkpoint: what is wrong, that nothing was changed, and how to
 * go back to the previous slot where there is one. The same words serve training (which then
 * resumes with --resume) and --generate / --evaluate (which refuse --resume: the same command
 * again). Where an engine is writing checkpoints there, no way back is offered: the pair read
 * may be one caught between its renames (ckpt_lock_held_elsewhere). */
static void ckpt_refuse_damaged(const CkptFiles* f, const char* what) {
    int prev_step = file_exists(f->prev) ? ckpt_header_step(f->prev) : -1;
    if (ckpt_lock_held_elsewhere(f))
        die_input("checkpoint %s %s; an engine holding %s is writing checkpoints there (read between its writes?): "
                  "run again, or once that run has stopped", f->ckpt, what, f->lock);
    if (prev_step >= 0)
        die_input("checkpoint %s %s; it is left as it is. The previous checkpoint %s (step %d) is kept: to go back to "
                  "it, run mv %s %s && mv %s %s, then run again (training: with --resume)", f->ckpt, what, f->prev,
                  prev_step, f->prev, f->ckpt, f->prev_side, f->side);
    die_input("checkpoint %s %s; it is left as it is (there is no previous checkpoint %s)", f->ckpt, what, f->prev);
}

/* p past any JSON whitespace. */
static const char* json_skip_space(const char* p) {
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    return p;
}

/* Tiny JSON lookup for the sidecar: p past the colon of the member "key" anywhere in text (sidecar
 * names are unique, so no nesting logic is needed), or NULL. The first "key" followed by a colon: a
 * string value that spells the name ("fp8_classifier":"seed") is no member, and a quote inside a
 * string is escaped, so no string holds a "key" that is followed by one. */
static const char* json_find_member(const char* text, const char* key) {
    char pat[64];
    const char* p;
    snprintf(pat, sizeof pat, "\"%s\"", key);
    for (p = strstr(text, pat); p; p = strstr(p + 1, pat)) {
        const char* colon = json_skip_space(p + strlen(pat));
        if (*colon == ':') return colon + 1;
    }
    return NULL;
}

/* The number of the member key in text (json_find_member). Returns 1 if found. */
static int json_find_number(const char* text, const char* key, double* out) {
    const char* p = json_find_member(text, key);
    char* end;
    if (!p) return 0;
    *out = strtod(p, &end);
    return end != p;
}

/* Whether text names the member key, as json_find_number and json_find_string look it up: one that
 * neither reads holds a value of another type. */
static int json_has_member(const char* text, const char* key) { return json_find_member(text, key) != NULL; }

/* A member no checksum covers and older sidecars lack (the data fingerprints): 1 with *out where it
 * is a number, 0 where it is absent, -1 where it holds another type (damaged or edited: what it
 * would have said cannot be told). */
static int json_optional_number(const char* text, const char* key, double* out) {
    if (json_find_number(text, key, out)) return 1;
    return json_has_member(text, key) ? -1 : 0;
}

/* The value of the 4 hex digits at p (json_skip_string checked them). */
static unsigned hex4(const char* p) {
    unsigned u = 0;
    int k;
    for (k = 0; k < 4; k++)
        u = 16 * u + (unsigned)(isdigit((unsigned char)p[k]) ? p[k] - '0' : (p[k] | 0x20) - 'a' + 10);
    return u;
}

/* The code point of the \u escape at p (json_skip_string checked its digits), or of the pair when
 * it is a high surrogate right before a low one's escape; *len the escapes' length (6 or 12). A
 * surrogate that is no half of a pair comes back as itself (D800-DFFF). */
static unsigned json_u_escape(const char* p, int* len) {
    unsigned u = hex4(p + 2), low;
    *len = 6;
    if (u >= 0xD800 && u <= 0xDBFF && p[6] == '\\' && p[7] == 'u' && (low = hex4(p + 8)) >= 0xDC00 &&
        low <= 0xDFFF) {
        *len = 12;
        return 0x10000 + ((u - 0xD800) << 10) + (low - 0xDC00);
    }
    return u;
}

/* The UTF-8 bytes of code point u into b (a lone surrogate in the 3-byte form that Python's
 * "surrogatepass" writes too); returns their count. */
static int utf8_encode(unsigned u, unsigned char* b) {
    if (u < 0x80) {
        b[0] = (unsigned char)u;
        return 1;
    }
    if (u < 0x800) {
        b[0] = (unsigned char)(0xC0 | u >> 6);
        b[1] = (unsigned char)(0x80 | (u & 0x3F));
        return 2;
    }
    if (u < 0x10000) {
        b[0] = (unsigned char)(0xE0 | u >> 12);
        b[1] = (unsigned char)(0x80 | (u >> 6 & 0x3F));
        b[2] = (unsigned char)(0x80 | (u & 0x3F));
        return 3;
    }
    b[0] = (unsigned char)(0xF0 | u >> 18);
    b[1] = (unsigned char)(0x80 | (u >> 12 & 0x3F));
    b[2] = (unsigned char)(0x80 | (u >> 6 & 0x3F));
    b[3] = (unsigned char)(0x80 | (u & 0x3F));
    return 4;
}

/* The JSON string that starts at p (its opening quote; a valid one, json_skip_string), decoded as
 * JSON decodes it (escapes, a \u pair as one character, a lone surrogate as its 3 bytes, U+0000 as
 * a 0 byte): its first cap - 1 bytes of UTF-8 into out, NUL-terminated. Returns the decoded length
 * (all of it, cut or not); *has_nul says whether it holds U+0000. */
static size_t json_decode_string(const char* p, char* out, size_t cap, int* has_nul) {
    unsigned char b[4];
    size_t k = 0;
    int n, i;
    *has_nul = 0;
    for (p++; *p && *p != '"'; k += (size_t)n) {
        unsigned u;
        int len;
        if (*p != '\\') { /* a byte of the text's UTF-8, as it is */
            b[0] = (unsigned char)*p++;
            n = 1;
        } else if (p[1] == 'u') {
            u = json_u_escape(p, &len);
            p += len;
            if (u == 0) *has_nul = 1;
            n = utf8_encode(u, b);
        } else {
            b[0] = (unsigned char)(p[1] == 'b' ? '\b' : p[1] == 'f' ? '\f' : p[1] == 'n' ? '\n' : p[1] == 'r' ? '\r'
                                   : p[1] == 't' ? '\t' : p[1]);
            n = 1;
            p += 2;
        }
        for (i = 0; i < n && k + i + 1 < cap; i++) out[k + i] = (char)b[i];
    }
    out[k < cap ? k : cap - 1] = '\0';
    return k;
}

/* The string of the member key in text (json_find_member; a text sidecar_is_well_formed took, so
 * its escapes are whole), decoded (json_decode_string), its first cap - 1 bytes of UTF-8, into out.
 * Returns 1 if found; 0 for a string holding U+0000 too, which a C string cannot hold: cut there,
 * "fp32\u0000x" would read as fp32. Python's reader takes the same bytes (microgpt/checkpoint.py:
 * _canonical_value). */
static int json_find_string(const char* text, const char* key, char* out, size_t cap) {
    const char* p = json_find_member(text, key);
    int has_nul;
    if (!p || *(p = json_skip_space(p)) != '"') return 0;
    json_decode_string(p, out, cap, &has_nul);
    return !has_nul;
}

/* Sidecars nest 4 deep (an fp8 history inside "exp" inside "fp8_history"); deeper is no sidecar. */
#define SIDECAR_DEPTH_MAX 64

/* p past the JSON string that starts at p (its opening quote), or NULL if it is none. */
static const char* json_skip_string(const char* p) {
    int k;
    for (p++; *p != '"';) {
        if ((unsigned char)*p < 0x20) return NULL; /* a control character, or the text's end */
        if (*p == '\\' && p[1] == 'u') {
            for (k = 2; k < 6; k++)
                if (!isxdigit((unsigned char)p[k])) return NULL;
            p += 6;
        } else if (*p == '\\') {
            if (!p[1] || !strchr("\"\\/bfnrt", p[1])) return NULL;
            p += 2;
        } else if ((k = utf8_sequence_length((const unsigned char*)p)) > 0) {
            p += k;
        } else {
            return NULL;
        }
    }
    return p + 1;
}

static const char* json_skip_digits(const char* p) {
    const char* start = p;
    while (*p >= '0' && *p <= '9') p++;
    return p > start ? p : NULL;
}

/* p past the JSON number at p (-?int(.digits)?([eE][+-]?digits)?: no hex, inf or nan), or NULL. */
static const char* json_skip_number(const char* p) {
    if (*p == '-') p++;
    if (*p == '0') p++;
    else if (!(p = json_skip_digits(p))) return NULL;
    if (*p == '.' && !(p = json_skip_digits(p + 1))) return NULL;
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-') p++;
        if (!(p = json_skip_digits(p))) return NULL;
    }
    return p;
}

/* p past the JSON number, string or literal that starts at p, or NULL if there is none. NaN,
 * Infinity and -Infinity are taken as Python's json takes them (json.dump writes a float inf so),
 * for the readers to judge (a loss_scale of Infinity is reported and replaced). */
static const char* json_skip_scalar(const char* p) {
    static const char* const literals[] = {"true", "false", "null", "NaN", "Infinity", "-Infinity"};
    size_t i;
    for (i = 0; i < sizeof literals / sizeof literals[0]; i++)
        if (strncmp(p, literals[i], strlen(literals[i])) == 0) return p + strlen(literals[i]);
    if (*p == '"') return json_skip_string(p);
    return json_skip_number(p);
}

/* In fp8 on both sides, where the FP8 classifier pays: a run that resumes with another
 * train.fp8_classifier than it was written with continues in another classifier arithmetic
 * (docs/DESIGN.md §18), so it says so; a sidecar without the member was written before it was
 * recorded, when fp8 ran its classifier in bf16 by default (off) or on request all in FP8 (then
 * named auto); one whose member is no mode (a number, null, a name no run writes) tells nothing of
 * it, and the warning says so. */
static void sidecar_check_fp8_classifier(const char* text, const Config* c) {
    char saved[16];
    int found = json_find_string(text, "fp8_classifier", saved, sizeof saved);
    if ((found && !choice_ok(CFG_FP8_CLASSIFIERS, saved)) || (!found && json_has_member(text, "fp8_classifier")))
        warn("resuming with train.fp8_classifier %s; the checkpoint's sidecar records an fp8_classifier that is not "
             "one of %s (damaged or edited?), so which classifier it was trained with is unknown",
             c->train.fp8_classifier, CFG_FP8_CLASSIFIERS);
    else if (!found)
        warn("resuming with train.fp8_classifier %s; the checkpoint does not say which classifier it was trained "
             "with (written before that was recorded: off or all)", c->train.fp8_classifier);
    else if (strcmp(saved, c->train.fp8_classifier) != 0)
        warn("resuming with train.fp8_classifier %s, the checkpoint was written with %s", c->train.fp8_classifier,
             saved);
}

/* Every member name a sidecar holds (sidecar_text, save_checkpoint in train_loop.h,
 * mixture_sidecar_json in mixture.h, fp8_history_sidecar_json in fp8_history.h; a writer that adds
 * a member adds its name here). The readers find members by name, so a name with a bit flipped
 * would hide its member without a word: "crc33c" would read as a sidecar written before checksums. */
static const char* const sidecar_names[] = {
    "step", "n_params", "crc32c", "values_crc32c", "loss_scale", "fingerprint", "n_layer", "d_model", "n_head",
    "d_ff", "seq_len", "vocab_size", "padded_vocab_size", "seed", "batch_size", "grad_accum", "steps", "precision",
    "fp8_classifier", "data_crc32c",
    "bandit", "rounds", "reward_mean", "reward_var", "gain", "p", "probe_crc32c", "sources_crc32c",
    "fp8_history", "len", "exp"};
#define SIDECAR_N_NAMES (sizeof sidecar_names / sizeof sidecar_names[0])

/* p past an object member's name, one of sidecar_names and not yet seen[], and its colon, from p
 * (JSON whitespace allowed), or NULL; *twice: the name, where it was seen before. Each name is
 * written once in the whole sidecar and the readers take its first occurrence anywhere in the text
 * (json_find_member), where Python's json takes an object's last: a name given twice would mean
 * one thing to the engine and another to the tools. */
static const char* json_skip_name(const char* p, unsigned char* seen, const char** twice) {
    const char* name = json_skip_space(p);
    size_t i, len;
    if (*name != '"' || !(p = json_skip_string(name))) return NULL;
    len = (size_t)(p - name) - 2;
    for (i = 0; i < SIDECAR_N_NAMES; i++)
        if (strlen(sidecar_names[i]) == len && memcmp(sidecar_names[i], name + 1, len) == 0) break;
    if (i == SIDECAR_N_NAMES) return NULL;
    if (seen[i]++) {
        *twice = sidecar_names[i];
        return NULL;
    }
    p = json_skip_space(p);
    return *p == ':' ? p + 1 : NULL;
}

/* Whether text is one JSON object (RFC 8259, UTF-8; nested at most SIDECAR_DEPTH_MAX deep, without
 * recursion; every member name one of sidecar_names, each at most once in the whole text) and JSON
 * whitespace around it: every sidecar a writer made is, re-indented or not; *twice: the name given
 * twice, where that is what is wrong (NULL otherwise). The
 * readers look members up by name, so a sidecar cut short after any member, even one ending in "}"
 * ("fingerprint", "bandit"), or with a byte flipped in its syntax would otherwise be read as far as
 * its names are found, the members past the damage lost without a word (a lost crc32c reads as a
 * checkpoint written before checksums, lost fp8 histories as a checkpoint written before them). */
static int sidecar_is_well_formed(const char* text, const char** twice) {
    char closing[SIDECAR_DEPTH_MAX]; /* what closes each open object or array, outermost first */
    unsigned char seen[SIDECAR_N_NAMES] = {0};
    int depth = 0;
    const char* p = json_skip_space(text);
    *twice = NULL;
    if (*p != '{') return 0;
    while (p) { /* p: where a value starts */
        p = json_skip_space(p);
        if (*p == '{' || *p == '[') {
            if (depth == SIDECAR_DEPTH_MAX) return 0;
            closing[depth++] = *p == '{' ? '}' : ']';
            p = json_skip_space(p + 1);
            if (*p != closing[depth - 1]) { /* not empty: its first value, after a name in an object */
                if (closing[depth - 1] == '}' && !(p = json_skip_name(p, seen, twice))) return 0;
                continue;
            }
        } else if (!(p = json_skip_scalar(p))) {
            return 0;
        }
        while (depth > 0 && *(p = json_skip_space(p)) == closing[depth - 1]) { /* the containers it ends */
            depth--;
            p++;
        }
        p = json_skip_space(p);
        if (depth == 0) return *p == '\0';
        if (*p != ',') return 0;
        p = closing[depth - 1] == '}' ? json_skip_name(p + 1, seen, twice) : p + 1;
    }
    return 0;
}

/* A checkpoint's sidecar, read from disk once at start-up (sidecar_load) and handed to each of its
 * readers (ckpt_check, sidecar_loss_scale, mixture_resume, fp8_history_read): they all see the
 * bytes ckpt_check verified, however the file changes meanwhile. */
typedef struct {
    int loaded;   /* whether sidecar_load has run */
    char* text;   /* NUL-terminated, a whole JSON object; NULL: the checkpoint has no sidecar */
    size_t bytes; /* strlen(text) */
} Sidecar;

/* A sidecar of `bytes` bytes is no re-indented one the writer made for n_layer layers: refused. */
static void sidecar_refuse_longer(const CkptFiles* f, unsigned long long bytes, size_t n_layer) {
    char what[2 * CFG_PATH_MAX];
    if (bytes <= sidecar_read_max(n_layer)) return;
    snprintf(what, sizeof what, "has a sidecar %s of %llu bytes, longer than any this program writes for %zu "
             "layers, re-indented or not (damaged or edited)", f->side, bytes, n_layer);
    ckpt_refuse_damaged(f, what);
}

/* Reads the sidecar of the checkpoint `path` (PATH.json) of a model of n_layer layers into *s
 * (text NULL when there is none; sidecar_free it). The readers look its members up as C strings,
 * so a sidecar they would see only in part is refused as damaged: one longer than sidecar_read_max
 * (never more is read or allocated), holding a NUL byte or cut short would hide the members past
 * the cut or the NUL without a word (a hidden crc32c reads as a checkpoint written before
 * checksums). */
static void sidecar_load(const char* path, size_t n_layer, Sidecar* s) {
    size_t len = 0, cap;
    ssize_t got;
    struct stat st;
    int fd;
    CkptFiles f;
    char what[2 * CFG_PATH_MAX], *text;
    const char* twice;
    ckpt_files(path, &f);
    s->loaded = 1;
    s->text = NULL;
    s->bytes = 0;
    /* Only a sidecar that is not there is missing: a link to nothing, or round a loop, is refused
     * by the open (stat would call it missing, and the checkpoint would load unverified). */
    if (lstat(f.side, &st) != 0 && errno == ENOENT) return;
    fd = open_regular_or_die(f.side, "checkpoint sidecar", &st);
    sidecar_refuse_longer(&f, (unsigned long long)st.st_size, n_layer);
    cap = (size_t)st.st_size + 1;
    text = (char*)xmalloc(cap, "the checkpoint sidecar");
    while (len + 1 < cap && ((got = read(fd, text + len, cap - 1 - len)) > 0 || (got < 0 && errno == EINTR)))
        if (got > 0) len += (size_t)got;
    close(fd);
    text[len] = '\0';
    if (strlen(text) != len) {
        snprintf(what, sizeof what, "has a sidecar %s holding a NUL byte (damaged)", f.side);
        ckpt_refuse_damaged(&f, what);
    }
    if (!sidecar_is_well_formed(text, &twice)) {
        if (twice)
            snprintf(what, sizeof what, "has a sidecar %s that names the member \"%s\" twice (edited or damaged; "
                     "which one is meant is ambiguous)", f.side, twice);
        else
            snprintf(what, sizeof what, "has a sidecar %s that is no well-formed JSON object of the members a "
                     "sidecar holds (cut short, damaged or edited)", f.side);
        ckpt_refuse_damaged(&f, what);
    }
    s->text = text;
    s->bytes = len;
}

static void sidecar_free(Sidecar* s) {
    free(s->text);
    s->text = NULL;
}

/* Index of the first non-finite value of x[0 .. n), or n. */
static size_t first_non_finite(const float* x, size_t n) {
    size_t i = 0;
    while (i < n && isfinite(x[i])) i++;
    return i;
}

/* Whether value i of a checkpoint's [weights | m | v] (n each) is one no run writes: a number that
 * is not finite (a save refuses non-finite state), or a negative v, AdamW's second moment (a
 * running mean of squares, never below 0: a sign bit flipped, which nothing else shows where the
 * checkpoint has no sidecar and so no checksum). */
static int ckpt_value_bad(float x, size_t i, size_t n) { return !isfinite(x) || (i >= 2 * n && x < 0.0f); }

/* Index of the first of the values x[0 .. count), values first .. first + count - 1 of the
 * checkpoint's n parameters, that no run writes (ckpt_value_bad), or count. */
static size_t first_bad_value(const float* x, size_t count, size_t first, size_t n) {
    size_t i = 0;
    while (i < count && !ckpt_value_bad(x[i], first + i, n)) i++;
    return i;
}

/* One pass over the open checkpoint file fd (of the size ckpt_check found, for n parameters),
 * streamed through the static buffer: the CRC-32C of all its bytes, and the index in
 * [weights | m | v] of its first value that no run writes (first_bad_value; the count of its
 * values when there is none), and that value. Every read but the last fills the buffer, whose size
 * is a multiple of 4, as the header's is: no float straddles two reads. */
typedef struct {
    uint32_t crc;
    size_t first_bad;
    float bad_value;
} CkptScan;

static CkptScan ckpt_scan(int fd, const char* path, size_t n_params) {
    CkptScan s = {0, 0, 0.0f};
    size_t len, offset = 0, values = 0, bad;
    int done = 0;
    ssize_t got;
    s.first_bad = (size_t)-1;
    while (!done) {
        for (len = 0; len < sizeof ckpt_io_buf; len += (size_t)got) {
            got = pread(fd, ckpt_io_buf + len, sizeof ckpt_io_buf - len, (off_t)(offset + len));
            if (got < 0 && errno == EINTR) { got = 0; continue; }
            if (got < 0) die_input("reading checkpoint %s failed: %s", path, strerror(errno));
            if (got == 0) { done = 1; break; }
        }
        s.crc = crc32c_update(s.crc, ckpt_io_buf, len);
        {
            size_t skip = offset < CKPT_HEADER_BYTES ? CKPT_HEADER_BYTES - offset : 0; /* the header is no value */
            size_t n = len > skip ? (len - skip) / 4 : 0;
            const float* x = (const float*)(const void*)(ckpt_io_buf + skip);
            if (s.first_bad == (size_t)-1 && (bad = first_bad_value(x, n, values, n_params)) < n) {
                s.first_bad = values + bad;
                s.bad_value = x[bad];
            }
            values += n;
        }
        offset += len;
    }
    if (s.first_bad == (size_t)-1) s.first_bad = values;
    return s;
}

/* A value no run writes (ckpt_value_bad) in a file that is otherwise intact, or unverified: made
 * or edited by hand, or damaged where no checksum shows it; loaded, it would make every step, or
 * every generated token, silently wrong (a negative v: every step's update NaN, ended as a
 * divergence that blamed the learning rate). */
static void ckpt_refuse_bad_value(const CkptFiles* f, const CkptScan* s, size_t n) {
    const char* names[3] = {"weight", "AdamW m value", "AdamW v value"};
    char what[160];
    size_t i = s->first_bad;
    if (i >= 3 * n) return;
    if (isfinite(s->bad_value))
        snprintf(what, sizeof what, "holds %s %zu of %zu, %g, which is negative (a second moment: no run writes one; "
                 "a flipped sign bit?)", names[i / n], i % n, n, (double)s->bad_value);
    else
        snprintf(what, sizeof what, "holds %s %zu of %zu, which is not a finite number (no run writes one: edited?)",
                 names[i / n], i % n, n);
    ckpt_refuse_damaged(f, what);
}

/* The sidecar's values against their own checksum (sidecar_values_crc32c): a mismatch, or a
 * values_crc32c that is no number, is damage, refused. Returns whether the sidecar holds the
 * checksum. --generate and --evaluate check it before they take model flags from the values
 * (config_parse_for_checkpoint): a flipped digit there is the sidecar's damage, not a flag's error. */
static int sidecar_refuse_bad_values(const CkptFiles* f, const char* sidecar) {
    char what[2 * CFG_PATH_MAX];
    uint32_t crc = sidecar_values_crc32c(sidecar);
    double x;
    if (json_find_number(sidecar, "values_crc32c", &x)) {
        if (x == (double)crc) return 1;
        snprintf(what, sizeof what, "has a sidecar %s whose values (model shape, settings, loss scale) fail their "
                 "own check: CRC-32C %lu, recorded %.12g (damaged or edited)", f->side, (unsigned long)crc, x);
        ckpt_refuse_damaged(f, what);
    }
    if (json_has_member(sidecar, "values_crc32c")) {
        snprintf(what, sizeof what, "has a sidecar %s whose values_crc32c is not a number (damaged or edited)",
                 f->side);
        ckpt_refuse_damaged(f, what);
    }
    return 0;
}

/* sidecar_refuse_bad_values; a sidecar without the checksum that holds the checkpoint's crc32c
 * (written before sidecars carried both) is taken with a warning (one without crc32c has its own). */
static void sidecar_check_values(const CkptFiles* f, const char* sidecar) {
    if (sidecar_refuse_bad_values(f, sidecar)) return;
    if (json_has_member(sidecar, "crc32c"))
        warn("checkpoint sidecar %s holds no checksum of its own values (written before sidecars carried one): its "
             "model shape and settings are taken unverified", f->side);
}

/* A checkpoint that ckpt_check accepted: its step, the CRC-32C of all its bytes, and the open
 * descriptor of the very file it verified, from which ckpt_load reads the state. By name it could
 * be another: --generate and --evaluate take no lock (§15), so a run still writing checkpoints
 * there may rename a new file over the path between the check and the load, and its weights were
 * loaded unverified (a file of NaN served every token as id 0). */
typedef struct {
    int step;
    uint32_t crc;
    int fd; /* -1 once loaded (ckpt_load), or where no checkpoint was checked */
} CkptChecked;

/* A checkpoint of another model shape whose parameter count is the config's (one layer with a wide
 * MLP for two narrow ones; another n_head, which no tensor's size shows) passes ckpt_check's n_params
 * check: resumed, its tensors would be read as others and the run train on, replacing it. The
 * sidecar's shape, verified by ckpt_check, tells it apart: refused as another n_params is. Members
 * a sidecar lacks (an older writer's) are left to the n_params check. */
static void ckpt_refuse_other_shape(const char* path, const Config* c, const char* sidecar) {
    double x;
    size_t i;
    for (i = 0; i < SIDECAR_N_SETTINGS; i++) {
        const char* key = sidecar_settings[i].key;
        int value = sidecar_setting(c, i);
        if (sidecar_settings[i].on_resume == SETTING_SHAPE && sidecar && json_find_number(sidecar, key, &x) &&
            x != (double)value)
            die_input("checkpoint %s was written with model.%s %.12g, and model.%s is %d here (a different model "
                      "shape with as many parameters); it is neither loaded nor overwritten", path, key, x, key, value);
    }
}

/* Validates c's checkpoint before it is resumed and before any large allocation: header and size
 * against the config's n_params, the sidecar's step, and the CRC-32C of every byte against the
 * sidecar's, then its values (ckpt_refuse_bad_value), then the model shape its sidecar records
 * (ckpt_refuse_other_shape). Dies with one error line on any mismatch; the files are left as they
 * are. A checkpoint without a checksum (no sidecar, or one written before sidecars held "crc32c")
 * is loaded with a warning. `side`: the sidecar, loaded already (--generate and --evaluate read it
 * to learn the model) or read here, after the checkpoint's own checks; the later readers take it. */
static CkptChecked ckpt_check(const Config* c, size_t n_params, Sidecar* side) {
    const char* path = c->checkpoint.path;
    size_t n_layer = (size_t)c->model.n_layer; /* bounds the sidecar */
    CkptChecked checked;
    CkptFiles f;
    struct stat st;
    int32_t header[2];
    char what[2 * CFG_PATH_MAX];
    const char* sidecar;
    double x;
    CkptScan scan;
    int fd;
    ckpt_files(path, &f);
    if (!file_exists(path)) die_input("checkpoint %s does not exist (drop --resume to start a fresh run)", path);
    checked.fd = fd = open_regular_or_die(path, "checkpoint", &st);
    if (pread(fd, header, sizeof header, 0) != (ssize_t)sizeof header) {
        snprintf(what, sizeof what, "is truncated: %lld bytes, shorter than its 8-byte header", (long long)st.st_size);
        ckpt_refuse_damaged(&f, what);
    }
    /* a header that disagrees with the file's own size, where the size is the config's: a damaged
     * header (a flipped bit), whose way back is the previous slot, not another model's checkpoint */
    if ((header[1] < 0 || (size_t)header[1] != n_params) && (size_t)st.st_size == ckpt_expected_bytes(n_params)) {
        snprintf(what, sizeof what, "has n_params %d in its header, where its size is that of this config's %zu "
                 "(a damaged header)", header[1], n_params);
        ckpt_refuse_damaged(&f, what);
    }
    if (header[1] < 0 || (size_t)header[1] != n_params)
        die_input("checkpoint %s has n_params %d but this config needs %zu (different model shape?); "
                  "refusing to load or overwrite it", path, header[1], n_params);
    if ((size_t)st.st_size != ckpt_expected_bytes(n_params)) {
        snprintf(what, sizeof what, "is %lld bytes, expected %zu for %zu parameters (truncated or corrupt)",
                 (long long)st.st_size, ckpt_expected_bytes(n_params), n_params);
        ckpt_refuse_damaged(&f, what);
    }
    scan = ckpt_scan(fd, path, n_params);
    checked.step = header[0];
    checked.crc = scan.crc;
    if (side->loaded) sidecar_refuse_longer(&f, side->bytes, n_layer);
    else sidecar_load(path, n_layer, side);
    if (!(sidecar = side->text)) {
        warn("checkpoint sidecar %s is missing: %s is loaded unverified (no checksum) and the loss scale starts "
             "from its default", f.side, path);
        ckpt_refuse_bad_value(&f, &scan, n_params);
        if (header[0] < 0) ckpt_refuse_damaged(&f, "has a negative step");
        return checked;
    }
    if (!json_find_number(sidecar, "step", &x) || x != (double)header[0]) {
        char side_step[32] = "none";
        if (json_find_number(sidecar, "step", &x)) snprintf(side_step, sizeof side_step, "%.12g", x);
        snprintf(what, sizeof what, "does not match its sidecar %s (step %d in the checkpoint, %s in the sidecar)",
                 f.side, header[0], side_step);
        ckpt_refuse_damaged(&f, what);
    }
    sidecar_check_values(&f, sidecar);
    if (!json_find_number(sidecar, "crc32c", &x)) {
        if (json_has_member(sidecar, "crc32c")) { /* a checksum that is there but no number is damage, not age */
            snprintf(what, sizeof what, "has a sidecar %s whose crc32c is not a number (damaged or edited)", f.side);
            ckpt_refuse_damaged(&f, what);
        }
        warn("checkpoint sidecar %s holds no checksum (written before checkpoints carried one): %s is loaded "
             "unverified", f.side, path);
    } else if ((double)scan.crc != x) {
        snprintf(what, sizeof what, "fails its integrity check: its bytes have CRC-32C %lu, its sidecar %s records "
                 "%.12g (damaged on disk or edited)", (unsigned long)scan.crc, f.side, x);
        ckpt_refuse_damaged(&f, what);
    }
    ckpt_refuse_bad_value(&f, &scan, n_params);
    if (header[0] < 0) ckpt_refuse_damaged(&f, "has a negative step");
    ckpt_refuse_other_shape(path, c, sidecar);
    return checked;
}

/* Reads weights, m and v (n floats each) of the checkpoint `path` from the file that ckpt_check
 * accepted (`checked`), and closes it (checked->fd is -1 then); m and v NULL: the weights only
 * (--generate, --evaluate). */
static void ckpt_load(CkptChecked* checked, const char* path, size_t n, float* params, float* m, float* v) {
    FILE* f;
    int ok;
    if (!(f = fdopen(checked->fd, "rb"))) die_input("cannot open checkpoint %s: %s", path, strerror(errno));
    checked->fd = -1;
    ok = fseek(f, CKPT_HEADER_BYTES, SEEK_SET) == 0 && fread(params, 4, n, f) == n &&
         (!m || (fread(m, 4, n, f) == n && fread(v, 4, n, f) == n));
    fclose(f);
    if (!ok) die_input("reading checkpoint %s failed (changed while reading?)", path);
}

/* The loss scale to resume with from the sidecar of the checkpoint `path` that ckpt_check accepted
 * (0: engine default, also when there is no sidecar: ckpt_check warned). Fingerprint differences
 * (e.g. resuming a bf16 run in fp32) are reported and allowed. */
static float sidecar_loss_scale(const char* path, int ckpt_step, const Config* c, const Sidecar* sidecar) {
    char side[CFG_PATH_MAX + 8];
    const char* text = sidecar->text;
    double x;
    float loss_scale = 0.0f;
    size_t i;
    snprintf(side, sizeof side, "%s.json", path);
    if (!text) return 0.0f;
    if (!json_find_number(text, "step", &x) || x != (double)ckpt_step) {
        warn("checkpoint sidecar %s does not belong to step %d of %s; ignoring it", side, ckpt_step, path);
        return 0.0f;
    }
    /* A sidecar written before values_crc32c carries no checksum of its values: a loss scale of inf
     * would make an fp16 run skip every step (inf halved stays inf), so only a positive finite
     * float is taken. */
    if (json_find_number(text, "loss_scale", &x) && x > 0.0 && x <= FLT_MAX) loss_scale = (float)x;
    else if (json_has_member(text, "loss_scale"))
        warn("checkpoint sidecar %s holds a loss_scale that is not a positive finite number; the loss scale starts "
             "from its default", side);
    for (i = 0; i < SIDECAR_N_SETTINGS; i++) {
        const char* key = sidecar_settings[i].key;
        int value = sidecar_setting(c, i);
        if (sidecar_settings[i].on_resume == SETTING_WARN && json_find_number(text, key, &x) &&
            x != (double)value) /* as a double: (int)1e300 is undefined */
            warn("resuming with %s = %d, the checkpoint was written with %.12g", key, value, x);
    }
    {
        /* A loss scale belongs to the precision whose run produced it (non-fp16 runs record 1):
         * resuming in another precision starts from the engine's default scale. */
        char saved[16];
        int found = json_find_string(text, "precision", saved, sizeof saved);
        if (found && strcmp(saved, c->train.precision) != 0) {
            warn("resuming in precision %s, the checkpoint was written in %s; the loss scale starts from its default",
                 c->train.precision, saved);
            loss_scale = 0.0f;
        } else if (found && strcmp(saved, "fp8") == 0 && fp8_classifier_pays(c->model.d_model)) {
            sidecar_check_fp8_classifier(text, c);
        }
    }
    return loss_scale;
}

#endif
