/* LD_PRELOAD shim for tests/test_engine.py: reports every heap allocation of the process it is
 * preloaded into as a line "ALLOC <bytes>\n" written straight to fd 1 with write(2).
 *
 * Why fd 1 and write(2): the engine prints its JSON records on stdout and flushes after each one, so
 * an ALLOC line lands between the records it happened between, and the test can see whether anything
 * was allocated between the first step record and the exit event. No stdio here: printf itself may
 * allocate, and we must not recurse into ourselves.
 *
 * Build: gcc -shared -fPIC -O2 -o alloc_counter.so alloc_counter.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

static void* (*real_malloc)(size_t);
static void* (*real_calloc)(size_t, size_t);
static void* (*real_realloc)(void*, size_t);
static int (*real_posix_memalign)(void**, size_t, size_t);
static void* (*real_aligned_alloc)(size_t, size_t);
static void* (*real_memalign)(size_t, size_t);

/* dlsym may call calloc before real_calloc is known: serve those few early requests from a static
 * arena (never freed; free() of such a pointer is ignored below). */
static char bootstrap[8192];
static size_t bootstrap_used;
static int resolving;

static void report(size_t bytes) {
    char buf[32] = "ALLOC ";
    char digits[24];
    int n = 0;
    do { digits[n++] = (char)('0' + bytes % 10); bytes /= 10; } while (bytes);
    int len = 6;
    while (n) buf[len++] = digits[--n];
    buf[len++] = '\n';
    ssize_t rc = write(1, buf, (size_t)len);
    (void)rc;
}

static void resolve(void) {
    if (real_malloc || resolving) return;
    resolving = 1;
    real_calloc = (void* (*)(size_t, size_t))dlsym(RTLD_NEXT, "calloc");
    real_malloc = (void* (*)(size_t))dlsym(RTLD_NEXT, "malloc");
    real_realloc = (void* (*)(void*, size_t))dlsym(RTLD_NEXT, "realloc");
    real_posix_memalign = (int (*)(void**, size_t, size_t))dlsym(RTLD_NEXT, "posix_memalign");
    real_aligned_alloc = (void* (*)(size_t, size_t))dlsym(RTLD_NEXT, "aligned_alloc");
    real_memalign = (void* (*)(size_t, size_t))dlsym(RTLD_NEXT, "memalign");
    resolving = 0;
}

static void* bootstrap_alloc(size_t bytes) {
    size_t start = (bootstrap_used + 15) & ~(size_t)15;
    if (start + bytes > sizeof bootstrap) return NULL;
    bootstrap_used = start + bytes;
    return bootstrap + start;
}

static int from_bootstrap(const void* p) {
    return (const char*)p >= bootstrap && (const char*)p < bootstrap + sizeof bootstrap;
}

void* malloc(size_t bytes) {
    resolve();
    if (!real_malloc) return bootstrap_alloc(bytes);
    report(bytes);
    return real_malloc(bytes);
}

void* calloc(size_t n, size_t size) {
    resolve();
    if (!real_calloc) return bootstrap_alloc(n * size); /* static arena is zeroed */
    report(n * size);
    return real_calloc(n, size);
}

void* realloc(void* p, size_t bytes) {
    resolve();
    if (from_bootstrap(p)) { /* rare: grow a bootstrap block into a real one */
        void* q = malloc(bytes);
        if (q) memcpy(q, p, bytes < sizeof bootstrap ? bytes : sizeof bootstrap);
        return q;
    }
    report(bytes);
    return real_realloc(p, bytes);
}

int posix_memalign(void** out, size_t align, size_t bytes) {
    resolve();
    report(bytes);
    return real_posix_memalign(out, align, bytes);
}

void* aligned_alloc(size_t align, size_t bytes) {
    resolve();
    report(bytes);
    return real_aligned_alloc(align, bytes);
}

void* memalign(size_t align, size_t bytes) {
    resolve();
    report(bytes);
    return real_memalign(align, bytes);
}

void free(void* p) {
    static void (*real_free)(void*);
    if (from_bootstrap(p)) return;
    if (!real_free) real_free = (void (*)(void*))dlsym(RTLD_NEXT, "free");
    real_free(p);
}
