// Work sharing for the CPU kernels' OpenMP threads: each thread owns a contiguous run of work
// units and goes through it in order (so it knows its next unit and can prefetch it), and a
// thread done with its own run takes what is left of the others' from their ends. On a machine
// whose cores are shared (another process, a noisy neighbour's vCPU, a descheduled thread) a
// fixed split makes every call wait for whichever thread is slow at that moment; this way the
// fast thread takes over the slow one's last units instead.

#ifndef CPU_WORK_SHARING_H
#define CPU_WORK_SHARING_H

#include <stdatomic.h>
#include <stdint.h>

// Claims on one run: its owner takes units from the front, other threads from the back.
// `claimed` counts both, so together they never take more than the run holds and no unit is
// taken twice. One cache line per run: the owner's claims do not bounce another run's line.
typedef struct {
    _Atomic int64_t claimed, from_front, from_back;
} __attribute__((aligned(64))) RunClaims;

static inline void init_claims(RunClaims* runs, int32_t num_runs) {
    for (int32_t i = 0; i < num_runs; ++i) {
        atomic_init(&runs[i].claimed, 0);
        atomic_init(&runs[i].from_front, 0);
        atomic_init(&runs[i].from_back, 0);
    }
}

// Index of the next unclaimed unit of a run of `size` units, from the front (its owner) or
// the back (another thread), or -1 when none is left.
static inline int64_t claim(RunClaims* run, int64_t size, int from_front) {
    if (atomic_fetch_add_explicit(&run->claimed, 1, memory_order_relaxed) >= size) return -1;
    return from_front
               ? atomic_fetch_add_explicit(&run->from_front, 1, memory_order_relaxed)
               : size - 1 - atomic_fetch_add_explicit(&run->from_back, 1, memory_order_relaxed);
}

#endif
