/* files.h: opening input files (shards, checkpoints) so that nothing can hang the engine: a FIFO
 * or device given as a data or checkpoint path is refused with one error line instead of blocking
 * open() or read(), deaf to SIGTERM, until some writer appears; and the standard descriptors a
 * launcher hands over, made fit to use (none closed, none non-blocking).
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_FILES_H
#define MICROGPT_HOST_FILES_H

#include "output.h"
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

static int file_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* What a file that is not a regular file is, for error messages. */
static const char* file_kind(mode_t mode) {
    return S_ISDIR(mode)    ? "a directory"
           : S_ISFIFO(mode) ? "a FIFO"
           : S_ISSOCK(mode) ? "a socket"
           : S_ISLNK(mode)  ? "a symbolic link" /* lstat's: the checkpoint's lock, never followed */
                            : "a device";
}

/* Opens an existing file for reading without ever blocking: O_NONBLOCK makes opening a FIFO return
 * at once (a plain open would wait, deaf to SIGTERM, for a writer), and anything but a regular
 * file is refused with one error line naming `what`. Returns the descriptor; *st is its stat. */
static int open_regular_or_die(const char* path, const char* what, struct stat* st) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC); /* a checkpoint's stays open until it is loaded */
    if (fd < 0) die_input("cannot open %s %s: %s", what, path, strerror(errno));
    if (fstat(fd, st) != 0) die_input("cannot read %s %s: %s", what, path, strerror(errno));
    if (!S_ISREG(st->st_mode)) die_input("%s %s is %s, not a regular file", what, path, file_kind(st->st_mode));
    return fd;
}

/* Clears O_NONBLOCK on fd. A launcher may hand the engine a stdin or stdout whose open file is
 * non-blocking (the flag belongs to the file, shared with whoever set it: a Node.js parent, a
 * terminal another program left so): a read with no request yet, or a write to a reader a moment
 * behind (a full pipe), then fails with EAGAIN: --generate ended as if stdin had failed or the
 * reader were gone, and training dropped its progress lines without a word (the exit line too).
 * stdio cannot retry such a write (the unwritten bytes are dropped), so the engine blocks instead,
 * as bash does for its input: stdout in every mode, stdin where requests are read. */
static void fd_make_blocking(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_NONBLOCK)) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

/* Opens /dev/null on each of stdin, stdout and stderr that a launcher left closed (`>&-`): else the
 * next file the engine opens takes that number, and what it prints there is written into that file
 * (with stdout closed, every progress line went into the checkpoint's lock file). */
static void std_fds_fill(void) {
    int fd;
    for (fd = 0; fd <= 2; fd++)
        if (fcntl(fd, F_GETFD) < 0 && errno == EBADF && open("/dev/null", O_RDWR) != fd) return;
}

#endif
