/* LD_PRELOAD shim for tests/test_engine.py: a file system without hard links (FAT, some network
 * file systems). link() and linkat() fail with EPERM and say so on stderr (fd 2, write(2): no
 * stdio), so a test can see that the engine's checkpoint rotation really took its copying path.
 *
 * Build: gcc -shared -fPIC -O2 -o no_hard_links.so no_hard_links.c
 */
#include <errno.h>
#include <string.h>
#include <unistd.h>

static int refuse(void) {
    static const char line[] = "no_hard_links: link refused\n";
    ssize_t ignored = write(2, line, sizeof line - 1);
    (void)ignored;
    errno = EPERM;
    return -1;
}

int link(const char* from, const char* to) {
    (void)from;
    (void)to;
    return refuse();
}

int linkat(int from_dir, const char* from, int to_dir, const char* to, int flags) {
    (void)from_dir;
    (void)from;
    (void)to_dir;
    (void)to;
    (void)flags;
    return refuse();
}
