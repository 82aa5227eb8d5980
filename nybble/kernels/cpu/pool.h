/* A small thread pool for nybble's C kernels: nyb_parallel_for(n, chunk, fn, ctx) runs
 * fn(ctx, lo, hi) over [0, n) in chunks claimed from one atomic counter by the calling thread
 * and the pool's workers together.
 *
 * Why not a static split with a barrier (OpenMP's schedule(static), llama.cpp's threadpool):
 * on a machine whose other cores are busy, a worker that is not scheduled holds up every
 * barrier, and a step of a few hundred GEMMs collapses.  Here the caller never waits for a
 * worker to start: it claims chunks itself until none are left and then waits only for the
 * chunks workers have already claimed (at most one each).  A worker that never gets a core
 * costs nothing; one that does takes its share.  Each output element is computed by exactly
 * one chunk with the same code whatever the split, so results do not depend on the thread
 * count.
 *
 * The counter is a 64-bit ticket: the job's generation in the high half, the next index in
 * the low half.  A claim is a compare-and-swap on the whole ticket, so a worker that read an
 * older job's fields can never claim from a newer job (its swap fails).  The caller publishes
 * a job by (1) storing a ticket of the new generation with no index left, (2) the job's
 * fields, (3) the ticket with index 0, (4) the new generation, then waking sleeping workers.
 * Idle workers spin (with PAUSE) for NYB_POOL_SPIN_US microseconds after a job, then sleep on
 * a condition variable: between the GEMMs of one decode step they are awake; between steps
 * they give the core back.
 *
 * One pool per extension module (each module compiles its own copy of this header); calls
 * from several threads at once are safe: a call that finds the pool busy runs serially.  A
 * forked child starts with one thread (pthread_atfork).
 */
#ifndef NYB_CPU_POOL_H
#define NYB_CPU_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define NYB_POOL_MAX 64
#define NYB_POOL_SPIN_US 300
#define NYB_POOL_NONE 0xffffffffu

typedef void (*nyb_range_fn)(void *ctx, int64_t lo, int64_t hi);

typedef struct {
    _Atomic uint64_t ticket;      /* generation << 32 | next index */
    _Atomic uint32_t gen;         /* the published job's generation */
    _Atomic int64_t done;         /* items finished in the current job */
    _Atomic int64_t n, chunk;     /* the current job */
    _Atomic(nyb_range_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int sleepers, stop;
    int threads;                  /* workers + the caller */
    int workers;                  /* started */
    pthread_t tid[NYB_POOL_MAX];
    pthread_mutex_t mu;           /* sleeping workers */
    pthread_cond_t cv;
    pthread_mutex_t busy;         /* one job at a time */
    pthread_mutex_t config;       /* set_threads */
} nyb_pool_t;

static nyb_pool_t nyb_pool = {
    .threads = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER,
    .busy = PTHREAD_MUTEX_INITIALIZER, .config = PTHREAD_MUTEX_INITIALIZER};

static inline void nyb_pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int64_t nyb_pool_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Claim and run chunks of job `gen` until none are left (or a newer job replaced it). */
static void nyb_pool_claim(uint32_t gen) {
    nyb_pool_t *P = &nyb_pool;
    for (;;) {
        uint64_t t = atomic_load(&P->ticket);
        if ((uint32_t)(t >> 32) != gen) return;
        const int64_t i = (int64_t)(uint32_t)t;
        const int64_t n = atomic_load(&P->n), chunk = atomic_load(&P->chunk);
        const nyb_range_fn fn = atomic_load(&P->fn);
        void *ctx = atomic_load(&P->ctx);
        if ((uint32_t)t == NYB_POOL_NONE || i >= n) return;
        if (!atomic_compare_exchange_weak(&P->ticket, &t, t + (uint64_t)chunk)) continue;
        const int64_t hi = i + chunk < n ? i + chunk : n;
        fn(ctx, i, hi);
        atomic_fetch_add(&P->done, hi - i);
    }
}

static void *nyb_pool_worker(void *arg) {
    (void)arg;
    nyb_pool_t *P = &nyb_pool;
    uint32_t seen = atomic_load(&P->gen);
    for (;;) {
        int64_t since = nyb_pool_now_us();
        unsigned spins = 0;
        while (atomic_load(&P->gen) == seen) {
            if (atomic_load(&P->stop)) return NULL;
            nyb_pool_relax();
            if ((++spins & 255u) || nyb_pool_now_us() - since < NYB_POOL_SPIN_US) continue;
            pthread_mutex_lock(&P->mu);
            atomic_fetch_add(&P->sleepers, 1);
            while (atomic_load(&P->gen) == seen && !atomic_load(&P->stop))
                pthread_cond_wait(&P->cv, &P->mu);
            atomic_fetch_sub(&P->sleepers, 1);
            pthread_mutex_unlock(&P->mu);
            since = nyb_pool_now_us();
        }
        seen = atomic_load(&P->gen);
        nyb_pool_claim(seen);
    }
}

static void nyb_pool_stop_workers(void) {
    nyb_pool_t *P = &nyb_pool;
    if (P->workers == 0) return;
    pthread_mutex_lock(&P->mu);
    atomic_store(&P->stop, 1);
    pthread_cond_broadcast(&P->cv);
    pthread_mutex_unlock(&P->mu);
    for (int i = 0; i < P->workers; i++) pthread_join(P->tid[i], NULL);
    P->workers = 0;
    atomic_store(&P->stop, 0);
}

static void nyb_pool_after_fork(void) {   /* the child has no workers */
    nyb_pool.workers = 0;
    nyb_pool.threads = 1;
    atomic_store(&nyb_pool.sleepers, 0);
    pthread_mutex_init(&nyb_pool.mu, NULL);
    pthread_cond_init(&nyb_pool.cv, NULL);
    pthread_mutex_init(&nyb_pool.busy, NULL);
    pthread_mutex_init(&nyb_pool.config, NULL);
}

/* Use `threads` threads (the caller and threads - 1 workers), clamped to [1, NYB_POOL_MAX].
 * Returns the count in use (fewer when a worker could not be started). */
static int nyb_pool_set_threads(int threads) {
    static int atfork = 0;
    nyb_pool_t *P = &nyb_pool;
    if (threads < 1) threads = 1;
    if (threads > NYB_POOL_MAX) threads = NYB_POOL_MAX;
    pthread_mutex_lock(&P->config);
    if (!atfork) { pthread_atfork(NULL, NULL, nyb_pool_after_fork); atfork = 1; }
    pthread_mutex_lock(&P->busy);
    if (threads != P->threads) {
        nyb_pool_stop_workers();
        P->threads = 1;
        for (int i = 0; i < threads - 1; i++) {
            if (pthread_create(&P->tid[i], NULL, nyb_pool_worker, NULL) != 0) break;
            P->workers++;
        }
        P->threads = P->workers + 1;
    }
    const int got = P->threads;
    pthread_mutex_unlock(&P->busy);
    pthread_mutex_unlock(&P->config);
    return got;
}

static inline int nyb_pool_threads(void) { return nyb_pool.threads; }

/* A chunk for n items whose natural tile is `tile`: the tile, or a halving of it, small
 * enough that each thread gets about three chunks (the caller's share then evens out when a
 * worker starts late or not at all). */
static inline int64_t nyb_pool_chunk(int64_t n, int64_t tile) {
    const int64_t want = 3 * (int64_t)nyb_pool.threads;
    while (tile > 1 && n < want * tile) tile /= 2;
    return tile < 1 ? 1 : tile;
}

/* fn(ctx, lo, hi) over [0, n) in chunks of `chunk` (the last may be shorter), on the pool's
 * threads and this one; returns when every chunk has run.  Serial when the pool has one
 * thread, when there is a single chunk, or when another call holds the pool. */
static void nyb_parallel_for(int64_t n, int64_t chunk, nyb_range_fn fn, void *ctx) {
    nyb_pool_t *P = &nyb_pool;
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    if (P->threads == 1 || n <= chunk || n >= ((int64_t)1 << 31)
            || pthread_mutex_trylock(&P->busy) != 0) {
        fn(ctx, 0, n);
        return;
    }
    const uint32_t gen = atomic_load(&P->gen) + 1u;
    atomic_store(&P->ticket, (uint64_t)gen << 32 | NYB_POOL_NONE);
    atomic_store(&P->n, n);
    atomic_store(&P->chunk, chunk);
    atomic_store(&P->fn, fn);
    atomic_store(&P->ctx, ctx);
    atomic_store(&P->done, 0);
    atomic_store(&P->ticket, (uint64_t)gen << 32);
    atomic_store(&P->gen, gen);
    if (atomic_load(&P->sleepers) > 0) {
        pthread_mutex_lock(&P->mu);
        pthread_cond_broadcast(&P->cv);
        pthread_mutex_unlock(&P->mu);
    }
    nyb_pool_claim(gen);
    unsigned spins = 0;
    while (atomic_load(&P->done) < n)   /* only chunks a worker is running are left */
        if (++spins & 1023u) nyb_pool_relax();
        else sched_yield();
    pthread_mutex_unlock(&P->busy);
}

#endif
