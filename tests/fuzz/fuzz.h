/*
 * tests/fuzz/fuzz.h: what every libFuzzer target here shares: the entry
 * point's prototype and CHECK, which aborts (a finding) when a promise
 * the code under test makes does not hold.
 */
#ifndef NBDCACHED_TESTS_FUZZ_H
#define NBDCACHED_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(x)                                                                                   \
	do {                                                                                       \
		if (!(x))                                                                          \
			abort();                                                                   \
	} while (0)

#endif
