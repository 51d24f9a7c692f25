/* LD_PRELOAD shim for tests/test_engine.py: the process is killed (SIGKILL) just before its Nth
 * rename(2) onto a name containing ".ckpt" (a checkpoint file; renames of a library's own files,
 * a driver's cache say, are not counted), N from the environment variable KILL_AT_RENAME. Every
 * earlier write is already fsynced, so this is a crash at the moment a checkpoint write is most
 * exposed. The test walks N over every rename of a run's checkpoint writes to see that each
 * instant leaves a whole checkpoint slot.
 *
 * Build: gcc -shared -fPIC -O2 -o kill_at_rename.so kill_at_rename.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

int rename(const char* from, const char* to) {
    static int (*real_rename)(const char*, const char*);
    static int calls;
    const char* kill_at = getenv("KILL_AT_RENAME");
    if (kill_at && strstr(to, ".ckpt") && ++calls == atoi(kill_at)) raise(SIGKILL);
    if (!real_rename) real_rename = (int (*)(const char*, const char*))dlsym(RTLD_NEXT, "rename");
    return real_rename(from, to);
}
