/* A vLLM-like request pipeline in one process, for tests/vm/pipeline_bench.py (issue 17, item 2).
 *
 * Threads named by role (pthread_setname_np, what the agent matches on):
 *   api             requests at a steady rate (open loop: a request's latency counts from when it was due)
 *   tokenizer-N     a short burst of its own CPU time per request, then hands it to the engine
 *   EngineCore_DP0  steps: its own CPU time (scheduling, sampling), then a sleep (the GPU's turn); every
 *                   request in the batch gets one token per step; one output message per step
 *   detok-N         a short burst per token of each step's output; a request ends at its last token
 *   bg-N            a busy background pool (as torch or a tokenizer batch brings): bursts of CPU with a
 *                   short pause between them, so that SCHED_FIFO on the whole process cannot starve the
 *                   rest forever
 * CPU work is measured in the thread's own CPU time (CLOCK_THREAD_CPUTIME_ID): contention shows as a
 * longer wall time, never as less work.
 *
 * Protocol: prints "ready" once every thread is named, waits for a line on stdin, runs, prints one JSON
 * object and exits. Requests still in flight at the end count with their age then (a lower bound).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double seconds = 10;
static int rate = 100;             /* requests per second */
static int tokenizers = 2;
static int detoks = 2;
static int bgs = 2;
static int tokens = 8;             /* output tokens per request: engine steps it takes */
static long tok_ns = 500000;       /* tokenizer CPU per request */
static long step_ns = 2000000;     /* engine CPU per step */
static long gpu_ns = 5000000;      /* engine sleep per step */
static long detok_ns = 50000;      /* detokenizer CPU per token */
static long bg_ns = 10000000;      /* background burst */
static long bg_pause_ns = 1000000; /* background pause between bursts */

static atomic_int go, stop_api, stop_all;
static atomic_long steps, bg_ops, sent, done;
static int64_t *latency_ns;        /* by request id; 0: not done */
static int64_t *arrival_ns;
static int64_t *step_wall_ns;
static long max_requests, max_steps;

static int64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void burn(long ns) {
    int64_t end = now_ns(CLOCK_THREAD_CPUTIME_ID) + ns;
    while (now_ns(CLOCK_THREAD_CPUTIME_ID) < end) {
    }
}

static void sleep_ns(long ns) {
    struct timespec ts = {ns / 1000000000, ns % 1000000000};
    nanosleep(&ts, NULL);
}

/* A blocking FIFO of pointers. */
struct queue {
    pthread_mutex_t lock;
    pthread_cond_t nonempty;
    void **items;
    long head, tail, cap;
};

static void q_init(struct queue *q, long cap) {
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->nonempty, NULL);
    q->items = calloc(cap, sizeof(void *));
    q->head = q->tail = 0;
    q->cap = cap;
}

static void q_push(struct queue *q, void *item) {
    pthread_mutex_lock(&q->lock);
    if (q->tail - q->head < q->cap) {
        q->items[q->tail % q->cap] = item;
        q->tail++;
    }
    pthread_cond_signal(&q->nonempty);
    pthread_mutex_unlock(&q->lock);
}

/* The next item; NULL once stop_all is set (or, with wait 0, when empty). */
static void *q_pop(struct queue *q, int wait) {
    void *item = NULL;
    pthread_mutex_lock(&q->lock);
    while (q->head == q->tail && wait && !atomic_load(&stop_all)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&q->nonempty, &q->lock, &ts);
    }
    if (q->head != q->tail) {
        item = q->items[q->head % q->cap];
        q->head++;
    }
    pthread_mutex_unlock(&q->lock);
    return item;
}

struct request {
    long id;
    int left;
};

/* One engine step's output: the requests that got a token, and which of them finished. */
struct output {
    int n;
    long ids[];
};

static struct queue to_tok, to_engine, to_detok;

static void wait_go(void) {
    while (!atomic_load(&go) && !atomic_load(&stop_all))
        sleep_ns(1000000);
}

static void *api(void *arg) {
    (void)arg;
    wait_go();
    int64_t start = now_ns(CLOCK_MONOTONIC);
    int64_t period = 1000000000 / rate;
    int64_t next = start;
    long id = 0;
    while (!atomic_load(&stop_api) && id < max_requests) {
        struct timespec ts = {next / 1000000000, next % 1000000000};
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
        int64_t now = now_ns(CLOCK_MONOTONIC);
        while (next <= now && id < max_requests && !atomic_load(&stop_api)) {
            struct request *r = malloc(sizeof *r);
            r->id = id;
            r->left = tokens;
            arrival_ns[id] = next; /* due then: a late API thread is part of the latency */
            id++;
            atomic_store(&sent, id);
            q_push(&to_tok, r);
            next += period;
        }
    }
    return NULL;
}

static void *tokenizer(void *arg) {
    (void)arg;
    wait_go();
    struct request *r;
    while ((r = q_pop(&to_tok, 1)) != NULL) {
        burn(tok_ns);
        q_push(&to_engine, r);
    }
    return NULL;
}

static void *engine(void *arg) {
    (void)arg;
    wait_go();
    struct request **batch = calloc(max_requests + 1, sizeof *batch);
    long running = 0;
    while (!atomic_load(&stop_all)) {
        struct request *r;
        while ((r = q_pop(&to_engine, running == 0)) != NULL) {
            batch[running++] = r;
        }
        if (running == 0)
            continue;
        int64_t t0 = now_ns(CLOCK_MONOTONIC);
        burn(step_ns);
        long s = atomic_load(&steps);
        if (s < max_steps)
            step_wall_ns[s] = now_ns(CLOCK_MONOTONIC) - t0;
        sleep_ns(gpu_ns);
        struct output *out = malloc(sizeof *out + running * sizeof(long));
        out->n = 0;
        long kept = 0;
        for (long i = 0; i < running; i++) {
            struct request *q = batch[i];
            q->left--;
            /* a finished request is sent as -(id + 1) */
            out->ids[out->n++] = q->left == 0 ? -(q->id + 1) : q->id;
            if (q->left > 0)
                batch[kept++] = q;
            else
                free(q);
        }
        running = kept;
        atomic_fetch_add(&steps, 1);
        q_push(&to_detok, out);
    }
    return NULL;
}

static void *detok(void *arg) {
    (void)arg;
    wait_go();
    struct output *out;
    while ((out = q_pop(&to_detok, 1)) != NULL) {
        for (int i = 0; i < out->n; i++) {
            burn(detok_ns);
            if (out->ids[i] < 0) {
                long id = -out->ids[i] - 1;
                latency_ns[id] = now_ns(CLOCK_MONOTONIC) - arrival_ns[id];
                atomic_fetch_add(&done, 1);
            }
        }
        free(out);
    }
    return NULL;
}

static void *bg(void *arg) {
    (void)arg;
    wait_go();
    while (!atomic_load(&stop_all)) {
        burn(bg_ns);
        atomic_fetch_add(&bg_ops, 1);
        sleep_ns(bg_pause_ns);
    }
    return NULL;
}

static void start(void *(*fn)(void *), const char *name) {
    pthread_t t;
    if (pthread_create(&t, NULL, fn, NULL) != 0) {
        perror("pthread_create");
        exit(2);
    }
    pthread_setname_np(t, name);
    pthread_detach(t);
}

static int cmp(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static double pct(const int64_t *sorted, long n, double p) {
    if (n == 0)
        return -1;
    long idx = (long)(p * n + 0.999999) - 1; /* nearest rank */
    if (idx < 0)
        idx = 0;
    if (idx >= n)
        idx = n - 1;
    return sorted[idx] / 1e6;
}

int main(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--seconds")) seconds = atof(v);
        else if (!strcmp(k, "--rate")) rate = atoi(v);
        else if (!strcmp(k, "--tokenizers")) tokenizers = atoi(v);
        else if (!strcmp(k, "--detoks")) detoks = atoi(v);
        else if (!strcmp(k, "--bg")) bgs = atoi(v);
        else if (!strcmp(k, "--tokens")) tokens = atoi(v);
        else {
            fprintf(stderr, "unknown option %s\n", k);
            return 2;
        }
    }
    max_requests = (long)(seconds * rate) + 16;
    max_steps = (long)(seconds * 1000) + 16;
    latency_ns = calloc(max_requests, sizeof(int64_t));
    arrival_ns = calloc(max_requests, sizeof(int64_t));
    step_wall_ns = calloc(max_steps, sizeof(int64_t));
    q_init(&to_tok, max_requests + 1);
    q_init(&to_engine, max_requests + 1);
    q_init(&to_detok, max_steps + 1);
    pthread_setname_np(pthread_self(), "GthPipeline");
    char name[32]; /* names stay under 16 bytes; the size quiets -Wformat-truncation */
    start(api, "api");
    for (int i = 0; i < tokenizers; i++) {
        snprintf(name, sizeof name, "tokenizer-%d", i);
        start(tokenizer, name);
    }
    start(engine, "EngineCore_DP0");
    for (int i = 0; i < detoks; i++) {
        snprintf(name, sizeof name, "detok-%d", i);
        start(detok, name);
    }
    for (int i = 0; i < bgs; i++) {
        snprintf(name, sizeof name, "bg-%d", i);
        start(bg, name);
    }
    printf("ready\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    int64_t t0 = now_ns(CLOCK_MONOTONIC);
    atomic_store(&go, 1);
    sleep_ns((long)(seconds * 1e9));
    atomic_store(&stop_api, 1);
    int64_t t1 = now_ns(CLOCK_MONOTONIC);
    long steps_at_end = atomic_load(&steps), bg_at_end = atomic_load(&bg_ops);
    /* let the requests in flight finish: up to 3 s */
    for (int i = 0; i < 300 && atomic_load(&done) < atomic_load(&sent); i++)
        sleep_ns(10000000);
    int64_t end = now_ns(CLOCK_MONOTONIC);
    atomic_store(&stop_all, 1);
    long n = atomic_load(&sent), completed = atomic_load(&done);
    int64_t *lat = calloc(n + 1, sizeof(int64_t));
    for (long i = 0; i < n; i++)
        lat[i] = latency_ns[i] > 0 ? latency_ns[i] : end - arrival_ns[i];
    qsort(lat, n, sizeof(int64_t), cmp);
    long ns_steps = steps_at_end < max_steps ? steps_at_end : max_steps;
    qsort(step_wall_ns, ns_steps, sizeof(int64_t), cmp);
    double elapsed = (t1 - t0) / 1e9;
    printf("{\"requests\": %ld, \"completed\": %ld, \"p50_ms\": %.3f, \"p99_ms\": %.3f, \"max_ms\": %.3f, "
           "\"steps_per_s\": %.2f, \"step_p99_ms\": %.3f, \"bg_ops_per_s\": %.2f, \"requests_per_s\": %.2f}\n",
           n, completed, pct(lat, n, 0.50), pct(lat, n, 0.99), n ? lat[n - 1] / 1e6 : -1.0,
           steps_at_end / elapsed, pct(step_wall_ns, ns_steps, 0.99), bg_at_end / elapsed, n / elapsed);
    fflush(stdout);
    _exit(0);
}
