/* LD_PRELOAD shim for tests/test_generate.py: another file is renamed over a checkpoint just
 * before the engine opens a file for the Nth time, as a training run still writing checkpoints
 * there renames its new one in between two of the engine's reads. SWAP_PATH names the checkpoint,
 * SWAP_FROM the file renamed over it, SWAP_WHEN the file whose opens are counted (SWAP_PATH when
 * unset), SWAP_AT_OPEN the N (opens by open(2) or fopen(3), counted alike).
 *
 * Build: gcc -shared -fPIC -O2 -o swap_at_open.so swap_at_open.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void maybe_swap(const char* path) {
    static int calls;
    const char* target = getenv("SWAP_PATH");
    const char* from = getenv("SWAP_FROM");
    const char* at = getenv("SWAP_AT_OPEN");
    const char* when = getenv("SWAP_WHEN") ? getenv("SWAP_WHEN") : target;
    if (target && from && at && strcmp(path, when) == 0 && ++calls == atoi(at)) rename(from, target);
}

static int real_open(const char* name, const char* path, int flags, mode_t mode) {
    int (*real)(const char*, int, ...) = (int (*)(const char*, int, ...))dlsym(RTLD_NEXT, name);
    maybe_swap(path);
    return real(path, flags, mode);
}

/* open(2) and open64(2), variadic: the mode is there only with O_CREAT. */
#define SWAP_OPEN(fn)                                                                              \
    int fn(const char* path, int flags, ...) {                                                    \
        mode_t mode = 0;                                                                          \
        if (flags & O_CREAT) {                                                                    \
            va_list ap;                                                                           \
            va_start(ap, flags);                                                                  \
            mode = (mode_t)va_arg(ap, int);                                                       \
            va_end(ap);                                                                           \
        }                                                                                         \
        return real_open(#fn, path, flags, mode);                                                 \
    }
SWAP_OPEN(open)
SWAP_OPEN(open64)

FILE* fopen(const char* path, const char* how) {
    FILE* (*real)(const char*, const char*) = (FILE * (*)(const char*, const char*)) dlsym(RTLD_NEXT, "fopen");
    maybe_swap(path);
    return real(path, how);
}

FILE* fopen64(const char* path, const char* how) {
    FILE* (*real)(const char*, const char*) = (FILE * (*)(const char*, const char*)) dlsym(RTLD_NEXT, "fopen64");
    maybe_swap(path);
    return real(path, how);
}
