/*
 * tests/fuzz/fuzz_rbd_spec.c: the rbd: backend string (daemon/rbd_spec.c)
 * as a careless or hostile config gives it. Whatever is accepted keeps the
 * promises rbd.c relies on: pool and image are non-empty, no name holds a
 * separator or a control character, every field is NUL-terminated within
 * its buffer; a refusal always says why.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/rbd_spec.h"
#include "tests/fuzz/fuzz.h"

static void check_name(const char *s, size_t cap, int may_be_empty)
{
	size_t n = strnlen(s, cap);
	CHECK(n < cap);
	CHECK(may_be_empty || n > 0);
	for (size_t i = 0; i < n; i++)
		CHECK((unsigned char)s[i] >= 0x20 && s[i] != '/' && s[i] != '@' && s[i] != '?' &&
		      s[i] != '&');
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *s = malloc(size + 5);
	if (!s)
		return 0;
	/* Mostly with the prefix, so the parser gets past it. */
	size_t k = 0;
	if (size == 0 || data[0] != 'x') {
		memcpy(s, "rbd:", 4);
		k = 4;
	}
	memcpy(s + k, data, size);
	s[k + size] = '\0';
	struct rbd_spec spec;
	char err[256] = "";
	int rc = rbd_spec_parse(s, &spec, err, sizeof(err));
	if (rc == 0) {
		check_name(spec.pool, sizeof(spec.pool), 0);
		check_name(spec.image, sizeof(spec.image), 0);
		check_name(spec.ns, sizeof(spec.ns), 1);
		check_name(spec.snap, sizeof(spec.snap), 1);
		CHECK(strnlen(spec.conf, sizeof(spec.conf)) < sizeof(spec.conf));
		CHECK(strnlen(spec.id, sizeof(spec.id)) < sizeof(spec.id));
		CHECK(strnlen(spec.keyring, sizeof(spec.keyring)) < sizeof(spec.keyring));
	} else {
		CHECK(err[0] != '\0');
	}
	free(s);
	return 0;
}
