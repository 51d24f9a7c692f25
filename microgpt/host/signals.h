/* signals.h: signals only set flags; the training loop acts on them between steps (SPEC §3).
 * SIGTERM / SIGINT: finish the current step, checkpoint, exit 0. SIGUSR1: checkpoint, keep going.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_SIGNALS_H
#define MICROGPT_HOST_SIGNALS_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <signal.h>
#include <string.h>

static volatile sig_atomic_t g_stop_signal = 0;    /* the stopping signal's number, 0 = none */
static volatile sig_atomic_t g_ckpt_requested = 0; /* SIGUSR1 seen since the last checkpoint */

static void on_stop_signal(int sig) { g_stop_signal = sig; }
static void on_usr1_signal(int sig) { (void)sig; g_ckpt_requested = 1; }

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
    /* Exceeding a file-size limit must be a write error we report (and survive with the old
     * checkpoint intact), not a silent kill. */
    signal(SIGXFSZ, SIG_IGN);
}

#endif
