/* LD_PRELOAD shim for tests/test_engine.py: the Nth rename(2) onto a name containing ".ckpt" (a
 * checkpoint file; renames of a library's own files are not counted), N from the environment
 * variable FAIL_RENAME, fails with ENOSPC instead of happening, as a full or failing disk can make
 * it fail. The process goes on, so it can see the failure and say what it left. Other renames,
 * before and after, happen.
 *
 * Build: gcc -shared -fPIC -O2 -o fail_rename.so fail_rename.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

int rename(const char* from, const char* to) {
    static int (*real_rename)(const char*, const char*);
    static int calls;
    const char* fail_at = getenv("FAIL_RENAME");
    if (fail_at && strstr(to, ".ckpt") && ++calls == atoi(fail_at)) {
        errno = ENOSPC;
        return -1;
    }
    if (!real_rename) real_rename = (int (*)(const char*, const char*))dlsym(RTLD_NEXT, "rename");
    return real_rename(from, to);
}
