/* data.h: llm.c token shards (docs/DESIGN.md §7) and the deterministic choice of training / validation
 * windows (docs/DESIGN.md §13).
 * Shards are memory-mapped read-only: validating them (header, size, every token id) happens before
 * any large allocation and costs no memory beyond the page cache.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_DATA_H
#define MICROGPT_HOST_DATA_H

#include "crc32c.h"
#include "files.h"
#include "output.h"
#include "rng.h"
#include <fcntl.h>
#include <glob.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define SHARD_HEADER_BYTES 1024

typedef struct {
    int n_shards;
    char** paths;
    const uint16_t** tokens; /* tokens of shard i (points into its mapping) */
    size_t* ntok;
    void** maps;
    size_t* map_bytes;
    uint64_t* first_window; /* prefix sums: windows of shards before i; [n_shards] = total */
    uint64_t n_windows;     /* windows of T+1 tokens that lie inside one shard */
    size_t total_tokens;
    int vocab_size;         /* every id read is checked against it again (shard_token) */
} Dataset;

/* Maps and validates one shard; dies naming the file on any defect. */
static void shard_map(Dataset* ds, int i, const char* path, int vocab_size) {
    struct stat st;
    const int32_t* header;
    size_t k, n;
    int err, fd = open_regular_or_die(path, "shard", &st);
    if ((size_t)st.st_size < SHARD_HEADER_BYTES)
        die_input("shard %s: %lld bytes is shorter than the %d-byte header", path, (long long)st.st_size, SHARD_HEADER_BYTES);
    ds->maps[i] = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    err = errno; /* before close() may change it */
    close(fd);
    /* ENOMEM is the machine's limit, not the shard's fault: the kernel's count of mappings
     * (vm.max_map_count, 65530 by default: one per shard) or the address space */
    if (ds->maps[i] == MAP_FAILED && err == ENOMEM)
        die_io("cannot map shard %s (%lld bytes, %d shards mapped before it): %s; the kernel limits a process's "
               "mappings (vm.max_map_count, one per shard: fewer, larger shards need fewer) and its address space "
               "(ulimit -v)", path, (long long)st.st_size, i, strerror(err));
    if (ds->maps[i] == MAP_FAILED) die_input("cannot map shard %s: %s", path, strerror(err));
    ds->map_bytes[i] = (size_t)st.st_size;
    header = (const int32_t*)ds->maps[i];
    if (header[0] != SHARD_MAGIC) die_input("shard %s: bad magic %d (expected %d)", path, header[0], SHARD_MAGIC);
    if (header[1] != SHARD_VERSION) die_input("shard %s: unsupported version %d (expected %d)", path, header[1], SHARD_VERSION);
    if (header[2] < 0) die_input("shard %s: the header's token count is %d, negative", path, header[2]);
    if ((size_t)st.st_size != SHARD_HEADER_BYTES + 2 * (size_t)header[2])
        die_input("shard %s: file is %lld bytes, header promises %lld", path, (long long)st.st_size,
                  (long long)SHARD_HEADER_BYTES + 2LL * header[2]);
    n = (size_t)header[2];
    ds->ntok[i] = n;
    ds->tokens[i] = (const uint16_t*)((const char*)ds->maps[i] + SHARD_HEADER_BYTES);
    for (k = 0; k < n; k++)
        if (ds->tokens[i][k] >= vocab_size)
            die_input("shard %s: token id %d at position %zu >= model.vocab_size (%d)", path, ds->tokens[i][k], k, vocab_size);
}

/* Opens every shard matching `pattern` (sorted, as glob returns them) for windows of T+1 tokens.
 * `what` names the flag in error messages. */
static void dataset_open(Dataset* ds, const char* pattern, const char* what, int vocab_size, int T) {
    glob_t g;
    int i, rc;
    size_t longest = 0;
    memset(ds, 0, sizeof *ds);
    ds->vocab_size = vocab_size;
    rc = glob(pattern, 0, NULL, &g);
    if (rc != 0 || g.gl_pathc == 0) die_input("%s: no shard matches '%s'", what, pattern);
    ds->n_shards = (int)g.gl_pathc;
    ds->paths = (char**)xcalloc(g.gl_pathc, sizeof(char*), "shard list");
    ds->tokens = (const uint16_t**)xcalloc(g.gl_pathc, sizeof(uint16_t*), "shard list");
    ds->ntok = (size_t*)xcalloc(g.gl_pathc, sizeof(size_t), "shard list");
    ds->maps = (void**)xcalloc(g.gl_pathc, sizeof(void*), "shard list");
    ds->map_bytes = (size_t*)xcalloc(g.gl_pathc, sizeof(size_t), "shard list");
    ds->first_window = (uint64_t*)xcalloc(g.gl_pathc + 1, sizeof(uint64_t), "shard list");
    for (i = 0; i < ds->n_shards; i++) {
        ds->paths[i] = (char*)xmalloc(strlen(g.gl_pathv[i]) + 1, "shard path");
        strcpy(ds->paths[i], g.gl_pathv[i]);
        shard_map(ds, i, ds->paths[i], vocab_size);
        ds->total_tokens += ds->ntok[i];
        if (ds->ntok[i] > longest) longest = ds->ntok[i];
        /* a window of T+1 tokens may start at 0 .. ntok-T-1 */
        ds->first_window[i + 1] = ds->first_window[i] + (ds->ntok[i] > (size_t)T ? ds->ntok[i] - (size_t)T : 0);
    }
    ds->n_windows = ds->first_window[ds->n_shards];
    globfree(&g);
    if (ds->n_windows == 0)
        die_input("%s: model.seq_len (%d) is too long for the data: a window needs %d tokens, the longest shard has %zu",
                  what, T, T + 1, longest);
}

/* Tokens at each end of a shard that dataset_fingerprint takes. */
#define DATASET_FINGERPRINT_TOKENS 64

/* crc, continued over what decides the windows a run draws from ds: each shard's token count in
 * order, and its first and last DATASET_FINGERPRINT_TOKENS tokens (a sample of the content, as
 * reading it all would cost a large corpus seconds at every start). Shards added, removed or
 * re-tokenized change it; an edit inside a shard that keeps its length and ends does not. */
static uint32_t dataset_fingerprint(const Dataset* ds, uint32_t crc) {
    int i;
    for (i = 0; i < ds->n_shards; i++) {
        uint64_t n = ds->ntok[i];
        size_t ends = n < DATASET_FINGERPRINT_TOKENS ? n : DATASET_FINGERPRINT_TOKENS;
        crc = crc32c_update(crc, &n, sizeof n);
        crc = crc32c_update(crc, ds->tokens[i], ends * 2);
        crc = crc32c_update(crc, ds->tokens[i] + (n - ends), ends * 2);
    }
    return crc;
}

static void dataset_close(Dataset* ds) {
    int i;
    for (i = 0; i < ds->n_shards; i++) {
        if (ds->maps[i] && ds->maps[i] != MAP_FAILED) munmap(ds->maps[i], ds->map_bytes[i]);
        free(ds->paths[i]);
    }
    free(ds->paths); free((void*)ds->tokens); free(ds->ntok); free(ds->maps); free(ds->map_bytes); free(ds->first_window);
    memset(ds, 0, sizeof *ds);
}

/* Token k of shard i, checked again as it is read: the mapping follows the file, so a shard
 * rewritten in place while the engine trains (a MAP_PRIVATE page not yet copied shows the new
 * bytes) gives ids shard_map never saw, and one >= vocab_size would index past the embedding
 * table and the logits. Exit 1 with the wording of on_bus_error (signals.h), the truncated case. */
static int shard_token(const Dataset* ds, int i, size_t k) {
    int id = ds->tokens[i][k];
    if (id >= ds->vocab_size)
        die_io("shard %s: token id %d at position %zu >= model.vocab_size (%d): a data shard truncated or rewritten "
               "in place while the engine read it; the last checkpoint is intact, rerun once the data is whole",
               ds->paths[i], id, k, ds->vocab_size);
    return id;
}

/* The window of T+1 tokens of shard i from position start: inputs are its first T, targets its
 * last T; each token read (and checked) once. */
static void copy_window(const Dataset* ds, int i, size_t start, int T, int* inputs, int* targets) {
    int t, prev = shard_token(ds, i, start);
    for (t = 0; t < T; t++) {
        int next = shard_token(ds, i, start + (size_t)t + 1);
        inputs[t] = prev;
        targets[t] = next;
        prev = next;
    }
}

/* B windows of T+1 tokens: window b starts at a position drawn from rng(seed, stream, counter0 + b)
 * over all windows of all shards. inputs/targets are [B*T]; targets are inputs shifted by one. */
static void dataset_fill(const Dataset* ds, uint64_t seed, int stream, uint64_t counter0, int B, int T,
                         int* inputs, int* targets) {
    int b;
    for (b = 0; b < B; b++) {
        uint64_t w = rng_below(seed, (uint64_t)stream, counter0 + (uint64_t)b, ds->n_windows);
        int lo = 0, hi = ds->n_shards - 1; /* find the shard i with first_window[i] <= w < first_window[i+1] */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (ds->first_window[mid] <= w) lo = mid;
            else hi = mid - 1;
        }
        copy_window(ds, lo, (size_t)(w - ds->first_window[lo]), T, inputs + b * T, targets + b * T);
    }
}

/* Micro-batch j of step index s (train and polish data). */
static void fill_train_batch(const Dataset* ds, uint64_t seed, int s, int j, int accum, int B, int T, int* inputs,
                             int* targets) {
    uint64_t counter0 = ((uint64_t)s * (uint64_t)accum + (uint64_t)j) * (uint64_t)B;
    dataset_fill(ds, seed, STREAM_TRAIN, counter0, B, T, inputs, targets);
}

/* Validation batch i of `stream`: the same fixed set at every evaluation (STREAM_VAL) or probe of
 * the bandit (STREAM_PROBE: other windows of the same shards). */
static void fill_val_batch(const Dataset* ds, uint64_t seed, int stream, int i, int B, int T, int* inputs, int* targets) {
    dataset_fill(ds, seed, stream, (uint64_t)i * (uint64_t)B, B, T, inputs, targets);
}

/* --evaluate --eval.batches 0: the whole non-overlapping windows of T+1 tokens of every shard, in
 * order. Window k of a shard starts at k·T, so every token but a shard's first is predicted once. */
static uint64_t shard_sequential_windows(const Dataset* ds, int i, int T) {
    return ds->ntok[i] > 0 ? (ds->ntok[i] - 1) / (size_t)T : 0;
}

static uint64_t dataset_sequential_windows(const Dataset* ds, int T) {
    uint64_t n = 0;
    int i;
    for (i = 0; i < ds->n_shards; i++) n += shard_sequential_windows(ds, i, T);
    return n;
}

/* Window w of that order into one sequence of inputs/targets [T]. */
static void fill_sequential_window(const Dataset* ds, uint64_t w, int T, int* inputs, int* targets) {
    int i = 0;
    for (; w >= shard_sequential_windows(ds, i, T); i++) w -= shard_sequential_windows(ds, i, T);
    copy_window(ds, i, (size_t)w * (size_t)T, T, inputs, targets);
}

#endif
