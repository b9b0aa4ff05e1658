/*
 * tests/fuzz/fuzz_handshake.c: option haggling as a hostile client sends it.
 *
 * The input is an option header (IHAVEOPT, option, length) followed by the
 * option data. The data is copied into a heap buffer of exactly the length
 * the parsers are told, so ASan flags any read past it. Both payload
 * parsers see every input (whatever the option number), and whatever they
 * accept is walked completely and checked against the bytes it came from:
 * an accepted payload must describe itself exactly.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/nbd.h"
#include "tests/fuzz/fuzz.h"

/* Fold bytes into a sink so that reads of them are not optimised away. */
static volatile uint8_t sink;

static void touch(const void *p, size_t n)
{
	const uint8_t *b = p;
	uint8_t x = 0;
	size_t i;

	for (i = 0; i < n; i++)
		x ^= b[i];
	sink ^= x;
}

static void fuzz_go(const uint8_t *payload, uint32_t len)
{
	struct nbd_opt_go go;
	uint16_t i;

	if (nbd_parse_opt_go(payload, len, &go) != 0)
		return;
	CHECK(go.name_length <= NBD_MAX_STRING);
	CHECK((const uint8_t *)go.name == payload + 4);
	CHECK((uint64_t)len == 6 + (uint64_t)go.name_length + 2 * (uint64_t)go.info_count);
	CHECK(go.info == payload + 6 + go.name_length);
	touch(go.name, go.name_length);
	for (i = 0; i < go.info_count; i++)
		CHECK(nbd_opt_go_info(&go, i) == nbd_get16(go.info + 2 * (size_t)i));
}

static void fuzz_meta(const uint8_t *payload, uint32_t len)
{
	struct nbd_opt_meta meta;
	struct nbd_meta_iter it;
	const char *query;
	uint32_t qlen, n = 0;
	uint64_t seen = 8;

	if (nbd_parse_opt_meta(payload, len, &meta) != 0)
		return;
	CHECK(meta.name_length <= NBD_MAX_STRING);
	CHECK((const uint8_t *)meta.name == payload + 4);
	CHECK(meta.queries == payload + 8 + meta.name_length);
	CHECK((uint64_t)meta.name_length + 8 + meta.queries_length == len);
	touch(meta.name, meta.name_length);
	seen += meta.name_length;
	nbd_meta_iter_init(&it, &meta);
	while (nbd_meta_iter_next(&it, &query, &qlen)) {
		CHECK(qlen <= NBD_MAX_STRING);
		CHECK((const uint8_t *)query >= meta.queries);
		CHECK((const uint8_t *)query + qlen <= payload + len);
		touch(query, qlen);
		(void)nbd_meta_query_valid(query, qlen);
		if (nbd_meta_query_selects_base_allocation(query, qlen))
			CHECK(nbd_meta_query_valid(query, qlen));
		seen += 4 + (uint64_t)qlen;
		n++;
	}
	CHECK(n == meta.query_count);
	CHECK(seen == len);
	CHECK(nbd_meta_iter_next(&it, &query, &qlen) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct nbd_option opt;
	struct nbd_option_reply rep;
	uint16_t gflags;
	uint32_t cflags, len;
	uint8_t *payload;
	int r;

	/* The other handshake decoders see the raw input too. */
	(void)nbd_decode_greeting(data, size, &gflags);
	(void)nbd_decode_client_flags(data, size, &cflags);
	(void)nbd_decode_option_reply(data, size, &rep);

	r = nbd_decode_option(data, size, &opt);
	if (r != 0) {
		CHECK(r == -EAGAIN || r == -EBADMSG);
		CHECK((r == -EAGAIN) == (size < NBD_OPTION_HEADER_SIZE));
		return 0;
	}
	(void)nbd_opt_name(opt.option);

	/* The payload is what arrived, up to what the header announced. */
	len = size - NBD_OPTION_HEADER_SIZE > UINT32_MAX
		  ? UINT32_MAX
		  : (uint32_t)(size - NBD_OPTION_HEADER_SIZE);
	if (opt.length < len)
		len = opt.length;
	payload = malloc(len ? len : 1);
	if (!payload)
		return 0;
	memcpy(payload, data + NBD_OPTION_HEADER_SIZE, len);

	fuzz_go(payload, len);
	fuzz_meta(payload, len);
	/* The whole payload as one query string. */
	(void)nbd_meta_query_valid((const char *)payload, len);
	(void)nbd_meta_query_selects_base_allocation((const char *)payload, len);
	free(payload);
	return 0;
}
