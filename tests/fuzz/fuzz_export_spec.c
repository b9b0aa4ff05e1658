/*
 * tests/fuzz/fuzz_export_spec.c: one --export value (daemon/export_spec.c,
 * whose keys are the rows of daemon/settings.h's export table) as a
 * careless or hostile command line gives it. Whatever is accepted keeps
 * the promises options_finish() and the exports rely on: a name and a
 * non-empty backend, a description of at most 4096 bytes, given bits only
 * for rows of the table, each value in its range; a refusal says why; and
 * nothing leaks either way (ASan).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/options.h"
#include "daemon/settings.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *s = malloc(size + 1);
	if (!s)
		return 0;
	memcpy(s, data, size);
	s[size] = '\0';
	struct export_spec e;
	char err[512] = "";
	int rc = options_parse_export(s, &e, err, sizeof(err));
	if (rc < 0) {
		CHECK(err[0] != '\0');
		free(s);
		return 0;
	}
	CHECK(e.name && e.backend && e.backend[0]);
	CHECK(!e.description || strlen(e.description) <= 4096);
	CHECK(export_settings_count >= 32 || e.given >> export_settings_count == 0);
	const struct setting *bs = export_settings_find("block-size"),
			     *size_row = export_settings_find("size"),
			     *split = export_settings_find("split");
	if (e.given & export_settings_bit(bs))
		CHECK(e.block_size >= 512 && e.block_size <= 65536 &&
		      (e.block_size & (e.block_size - 1)) == 0);
	CHECK(!(e.given & export_settings_bit(size_row)) || e.size > 0);
	CHECK(!(e.given & export_settings_bit(split)) || e.split > 0);
	CHECK(e.dirty_high <= 100 && e.dirty_low <= 100);
	CHECK(e.max_connections <= OPTIONS_MAX_CONNECTIONS);
	options_export_spec_free(&e);
	free(s);
	return 0;
}
