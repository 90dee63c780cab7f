/* The floor of a native lane for plain steps in the engine (bench/NOTES.md, twenty-third session,
 * section 4): the per-request work that no redesign can take away, in C with no Python objects.
 *
 *   gcc -O2 -pthread bench/lane_floor.c -o /tmp/lane_floor && /tmp/lane_floor [per_round ...]
 *
 * Per request, on the timed thread, what a lane from the link's frame to the reply ring must do:
 *   - read the frame (tag, session id, layer, position, where its inputs lie in the request ring),
 *   - find the session (an open-addressing table keyed by its id) and check and advance its
 *     position at the layer,
 *   - copy q, k, v, a, b (16,512 bytes at qwen3-next's heads, T=1) from the worker's request ring
 *     into the next staging set, laid out as gdn_server/backends/staging.py's plan, and write the
 *     row's slot, out slot and layer,
 *   - once "the device" is done, copy the row's output (8,192 bytes) into the worker's reply ring
 *     behind a reply header.
 * A second thread plays the workers and the device: it writes each round's inputs into eight
 * request rings and each launch's outputs into the staging set's output buffer, so the timed
 * thread reads both from another core's writes, as the engine does (workers are other processes,
 * the outputs come by DMA). Not counted: waiting for that thread. What the engine does per round
 * (a launch, the link's system calls) is not here either: this is c_row's floor, not c_round's.
 *
 * Prints, per requests-per-round value, the median over 15 measurements of thread CPU time per
 * request, in ns.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>

enum { H = 16, HV = 32, K = 128, V = 128, LAYERS = 36, SESSIONS = 256, WORKERS = 8, SETS = 8, MAX_ROWS = 256 };
enum { Q_BYTES = H * K * 2, V_BYTES = HV * V * 2, G_BYTES = HV * 2 };
enum { IN_BYTES = 2 * Q_BYTES + V_BYTES + 2 * G_BYTES, OUT_BYTES = HV * V * 2 };
#define REQUEST_RING (8u << 20)
#define REPLY_RING (4u << 20)
#define TABLE 1024

typedef struct { /* a link frame's fields, as a worker writes them */
    uint64_t tag;
    char session[24];
    uint32_t layer, position, worker, ring_offset;
} Frame;

typedef struct {
    char id[24];
    int32_t slot, used;
    uint32_t positions[LAYERS];
} Session;

typedef struct {
    uint8_t *base;                     /* one set: q, k, v, a, b, slots, out_slots, layers */
    size_t q, k, v, a, b, slots, out_slots, layers;
    uint8_t *out;                      /* [rows, HV, V] bf16, written by "the device" */
} Staging;

static uint8_t *request_ring[WORKERS], *reply_ring[WORKERS];
static size_t reply_head[WORKERS];
static Session table[TABLE];
static Staging sets[SETS];
static Frame *frames;
static int per_round;
static atomic_int produced = 0, consumed = 0; /* rounds the helper has written / the timer has taken */
static atomic_int stop = 0;
static uint32_t producer_positions[SESSIONS][LAYERS];

static uint64_t hash_id(const char *id) {
    uint64_t h = 1469598103934665603ull;
    for (; *id; id++) h = (h ^ (uint8_t)*id) * 1099511628211ull;
    return h;
}

static Session *find(const char *id) {
    for (uint64_t i = hash_id(id) & (TABLE - 1);; i = (i + 1) & (TABLE - 1)) {
        if (!table[i].used) return NULL;
        if (strcmp(table[i].id, id) == 0) return &table[i];
    }
}

static size_t align(size_t n) { return (n + 255) & ~(size_t)255; }

/* The helper thread: the workers' writes of round n+1 while the timed thread takes round n. */
static void *helper(void *arg) {
    (void)arg;
    uint64_t seed = 7, tag = 0;
    size_t ring_head[WORKERS] = {0};
    for (int round = 0; !atomic_load(&stop); round++) {
        while (atomic_load(&produced) - atomic_load(&consumed) >= 2 /* at most one round ahead */ && !atomic_load(&stop)) {}
        Frame *f = frames + (size_t)(round & 1) * MAX_ROWS;
        for (int i = 0; i < per_round; i++) {
            int s = (int)((round * per_round + i) % SESSIONS), layer = (round * per_round + i) / SESSIONS % LAYERS;
            int w = i % WORKERS;
            if (ring_head[w] + IN_BYTES > REQUEST_RING) ring_head[w] = 0;
            uint8_t *in = request_ring[w] + ring_head[w];
            for (int j = 0; j < IN_BYTES; j += 8) { seed = seed * 6364136223846793005ull + 1; memcpy(in + j, &seed, 8); }
            f[i].tag = ++tag;
            snprintf(f[i].session, sizeof f[i].session, "session-%06d", s);
            f[i].layer = (uint32_t)layer;
            f[i].position = producer_positions[s][layer]++;
            f[i].worker = (uint32_t)w;
            f[i].ring_offset = (uint32_t)ring_head[w];
            ring_head[w] += IN_BYTES;
        }
        /* "the device" of the round's launch: outputs land in the set the round will use */
        Staging *set = &sets[round % SETS];
        for (size_t j = 0; j < (size_t)per_round * OUT_BYTES; j += 8) {
            seed = seed * 6364136223846793005ull + 1;
            memcpy(set->out + j, &seed, 8);
        }
        atomic_fetch_add(&produced, 1);
    }
    return NULL;
}

static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One round on the timed thread: admit and stage every request, then answer every one. */
static int take_round(int round) {
    Frame *f = frames + (size_t)(round & 1) * MAX_ROWS;
    Staging *set = &sets[round % SETS];
    uint32_t after[MAX_ROWS];
    for (int r = 0; r < per_round; r++) {
        Session *s = find(f[r].session);
        if (s == NULL || s->positions[f[r].layer] != f[r].position) return -1; /* the Python's case */
        after[r] = s->positions[f[r].layer] += 1;
        const uint8_t *in = request_ring[f[r].worker] + f[r].ring_offset;
        memcpy(set->base + set->q + (size_t)r * Q_BYTES, in, Q_BYTES);
        memcpy(set->base + set->k + (size_t)r * Q_BYTES, in + Q_BYTES, Q_BYTES);
        memcpy(set->base + set->v + (size_t)r * V_BYTES, in + 2 * Q_BYTES, V_BYTES);
        memcpy(set->base + set->a + (size_t)r * G_BYTES, in + 2 * Q_BYTES + V_BYTES, G_BYTES);
        memcpy(set->base + set->b + (size_t)r * G_BYTES, in + 2 * Q_BYTES + V_BYTES + G_BYTES, G_BYTES);
        int32_t slot = s->slot * LAYERS + (int32_t)f[r].layer;
        ((int32_t *)(set->base + set->slots))[r] = slot;
        ((int32_t *)(set->base + set->out_slots))[r] = slot;
        ((int32_t *)(set->base + set->layers))[r] = (int32_t)f[r].layer;
    }
    /* (the launch) */
    for (int r = 0; r < per_round; r++) {
        int w = (int)f[r].worker;
        if (reply_head[w] + 32 + OUT_BYTES > REPLY_RING) reply_head[w] = 0;
        uint8_t *reply = reply_ring[w] + reply_head[w];
        uint64_t header[4] = {f[r].tag, after[r], OUT_BYTES, 0};
        memcpy(reply, header, sizeof header);
        memcpy(reply + 32, set->out + (size_t)r * OUT_BYTES, OUT_BYTES);
        reply_head[w] += 32 + OUT_BYTES;
    }
    return 0;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int values[16], n_values = 0;
    for (int i = 1; i < argc && n_values < 16; i++) values[n_values++] = atoi(argv[i]);
    if (n_values == 0) { values[0] = 1; values[1] = 24; values[2] = 64; n_values = 3; }
    for (int w = 0; w < WORKERS; w++) {
        request_ring[w] = aligned_alloc(4096, REQUEST_RING);
        reply_ring[w] = aligned_alloc(4096, REPLY_RING);
        memset(request_ring[w], 1, REQUEST_RING);
        memset(reply_ring[w], 1, REPLY_RING);
    }
    size_t off = 0, q = off; off += align((size_t)MAX_ROWS * Q_BYTES);
    size_t k = off; off += align((size_t)MAX_ROWS * Q_BYTES);
    size_t v = off; off += align((size_t)MAX_ROWS * V_BYTES);
    size_t a = off; off += align((size_t)MAX_ROWS * G_BYTES);
    size_t b = off; off += align((size_t)MAX_ROWS * G_BYTES);
    size_t slots = off; off += align(MAX_ROWS * 4);
    size_t out_slots = off; off += align(MAX_ROWS * 4);
    size_t layers = off; off += align(MAX_ROWS * 4);
    for (int i = 0; i < SETS; i++) {
        sets[i] = (Staging){aligned_alloc(4096, off), q, k, v, a, b, slots, out_slots, layers,
                            aligned_alloc(4096, (size_t)MAX_ROWS * OUT_BYTES)};
        memset(sets[i].base, 0, off);
        memset(sets[i].out, 0, (size_t)MAX_ROWS * OUT_BYTES);
    }
    frames = calloc(2 * MAX_ROWS, sizeof(Frame));
    for (int s = 0; s < SESSIONS; s++) {
        char id[24];
        snprintf(id, sizeof id, "session-%06d", s);
        uint64_t i = hash_id(id) & (TABLE - 1);
        while (table[i].used) i = (i + 1) & (TABLE - 1);
        strcpy(table[i].id, id);
        table[i].slot = s;
        table[i].used = 1;
    }
    printf("| requests per round | ns of CPU per request (median of 15) | min - max |\n|---|---|---|\n");
    for (int vi = 0; vi < n_values; vi++) {
        per_round = values[vi] < 1 ? 1 : values[vi] > MAX_ROWS ? MAX_ROWS : values[vi];
        memset(producer_positions, 0, sizeof producer_positions);
        for (int i = 0; i < TABLE; i++) memset(table[i].positions, 0, sizeof table[i].positions);
        atomic_store(&produced, 0);
        atomic_store(&consumed, 0);
        atomic_store(&stop, 0);
        pthread_t thread;
        pthread_create(&thread, NULL, helper, NULL);
        int rounds = 20000 / per_round + 20, round = 0;
        double per_request[15];
        for (int m = -1; m < 15; m++) { /* m = -1: a warm-up measurement */
            double spent = 0;
            for (int i = 0; i < rounds; i++, round++) {
                while (atomic_load(&produced) <= round) {}
                double t0 = thread_seconds();
                if (take_round(round) != 0) { fprintf(stderr, "position mismatch at round %d\n", round); return 1; }
                spent += thread_seconds() - t0;
                atomic_fetch_add(&consumed, 1);
            }
            if (m >= 0) per_request[m] = spent * 1e9 / ((double)rounds * per_round);
        }
        atomic_store(&stop, 1);
        pthread_join(thread, NULL);
        qsort(per_request, 15, sizeof(double), by_value);
        printf("| %d | %.0f | %.0f - %.0f |\n", per_round, per_request[7], per_request[0], per_request[14]);
    }
    return 0;
}
