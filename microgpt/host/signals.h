/* signals.h: signals only set flags; the training loop acts on them between steps (docs/DESIGN.md §3).
 * SIGTERM / SIGINT: finish the current step, checkpoint, exit 0 (before the first step: exit 0,
 * nothing to save). SIGUSR1: checkpoint, keep going. SIGBUS (a mapped shard truncated): one error
 * line, exit 1.
 * The handlers are the first thing main installs. A signal sent in the moments before that (between
 * fork and main) would kill the engine with the default action; a launcher closes that window by
 * spawning the engine with these signals blocked: the blocked signal waits, pending, until
 * signals_install has put the handlers in place and unblocks it.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_SIGNALS_H
#define MICROGPT_HOST_SIGNALS_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include "output.h"
#include <signal.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t g_stop_signal = 0;    /* the stopping signal's number, 0 = none */
static volatile sig_atomic_t g_ckpt_requested = 0; /* SIGUSR1 seen since the last checkpoint */

static void on_stop_signal(int sig) { g_stop_signal = sig; }
static void on_usr1_signal(int sig) { (void)sig; g_ckpt_requested = 1; }

/* The shards are memory-mapped (data.h): one truncated on disk while the engine trains (a data
 * script rerun in place) makes the next read of a vanished page raise SIGBUS, which would kill the
 * engine without a word. Only async-signal-safe calls here: one write, then _exit. */
static void on_bus_error(int sig) {
    static const char msg[] =
        "error: bus error: a memory-mapped file changed under the engine, most likely a data shard truncated or "
        "rewritten in place while the engine read it; the last checkpoint is intact, rerun once the data is whole\n";
    ssize_t ignored = write(2, msg, sizeof msg - 1);
    (void)ignored;
    (void)sig;
    _exit(EXIT_FAILURE_IO);
}

/* SIGBUS to on_bus_error: training and --evaluate read memory-mapped shards. */
static void signals_install_bus_error(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_bus_error;
    sigaction(SIGBUS, &sa, NULL);
}

/* Unblocks SIGTERM, SIGINT and SIGUSR1, which a launcher may have blocked (a pending one is
 * handled now). --generate and --evaluate call only this (and --evaluate signals_install_bus_error):
 * their stop signals keep the default action, and they ignore SIGUSR1 (no checkpoint to write). */
static void signals_unblock(void) {
    sigset_t handled;
    sigemptyset(&handled);
    sigaddset(&handled, SIGTERM);
    sigaddset(&handled, SIGINT);
    sigaddset(&handled, SIGUSR1);
    sigprocmask(SIG_UNBLOCK, &handled, NULL);
}

static void signals_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART; /* a signal must not make a read or write fail with EINTR */
    sa.sa_handler = on_stop_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_usr1_signal;
    sigaction(SIGUSR1, &sa, NULL);
    signals_install_bus_error();
    signals_unblock(); /* a pending one is handled now, by the handler */
    /* Exceeding a file-size limit must be a write error we report (and survive with the old
     * checkpoint intact), not a silent kill. */
    signal(SIGXFSZ, SIG_IGN);
}

#endif
