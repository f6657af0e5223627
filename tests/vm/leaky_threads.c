// Spawns many short-lived threads named "leaky" (at most 64 alive at once), then keeps KEEP long-lived
// ones until stdin closes. Used by tests/vm/sched_workloads.py (no-leak) to race the agent's map writes.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define WAVE 64

static void *short_lived(void *arg)
{
	long i = (long)arg;
	struct timespec ts = { 0, (i % 7) * 1000000L };

	prctl(PR_SET_NAME, "leaky", 0, 0, 0);
	nanosleep(&ts, NULL);
	return NULL;
}

static void *keeper(void *arg)
{
	char c;

	prctl(PR_SET_NAME, "leaky", 0, 0, 0);
	while (read(0, &c, 1) > 0)
		;
	return NULL;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10000, keep = argc > 2 ? atol(argv[2]) : 4, i;
	pthread_t wave[WAVE], keepers[64];

	for (i = 0; i < keep && i < 64; i++)
		pthread_create(&keepers[i], NULL, keeper, NULL);
	for (i = 0; i < n; i++) {
		if (i >= WAVE)
			pthread_join(wave[i % WAVE], NULL);
		pthread_create(&wave[i % WAVE], NULL, short_lived, (void *)i);
	}
	for (i = n > WAVE ? n - WAVE : 0; i < n; i++)
		pthread_join(wave[i % WAVE], NULL);
	printf("spawned %ld\n", n);
	fflush(stdout);
	for (i = 0; i < keep && i < 64; i++)
		pthread_join(keepers[i], NULL);
	return 0;
}
