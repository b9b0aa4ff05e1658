/*
 * proto/handshake.c: the fixed newstyle handshake and option haggling.
 *
 * The server opens with a greeting (NBDMAGIC, IHAVEOPT, handshake flags),
 * the client answers with its flags, then sends options one at a time:
 *
 *   client: IHAVEOPT | option (32) | length (32) | length bytes of data
 *   server: REP_MAGIC | option (32) | reply type (32) | length (32) | data
 *
 * Fixed headers are encoded and decoded through the packed wire structs of
 * proto/nbd.h. Option *data* (GO/INFO, LIST/SET_META_CONTEXT) arrives from
 * an untrusted peer, so the parsers below check every length against the
 * bytes actually received before anything points into the buffer; once a
 * payload is accepted, the accessors (nbd_opt_go_info, the meta iterator)
 * can walk it without further checks.
 */
#include <assert.h>
#include <endian.h>
#include <errno.h>
#include <string.h>

#include "proto/nbd.h"

size_t nbd_encode_greeting(void *buf, uint16_t flags)
{
	struct nbd_wire_greeting w = {
	    .magic = htobe64(NBD_MAGIC),
	    .opts_magic = htobe64(NBD_OPTS_MAGIC),
	    .flags = htobe16(flags),
	};

	memcpy(buf, &w, sizeof w);
	return sizeof w;
}

int nbd_decode_greeting(const void *buf, size_t len, uint16_t *flags)
{
	struct nbd_wire_greeting w;

	if (len < sizeof w)
		return -EAGAIN;
	memcpy(&w, buf, sizeof w);
	if (be64toh(w.magic) != NBD_MAGIC || be64toh(w.opts_magic) != NBD_OPTS_MAGIC)
		return -EBADMSG;
	*flags = be16toh(w.flags);
	return 0;
}

size_t nbd_encode_client_flags(void *buf, uint32_t flags)
{
	nbd_put32(buf, flags);
	return NBD_CLIENT_FLAGS_SIZE;
}

int nbd_decode_client_flags(const void *buf, size_t len, uint32_t *flags)
{
	if (len < NBD_CLIENT_FLAGS_SIZE)
		return -EAGAIN;
	*flags = nbd_get32(buf);
	return 0;
}

size_t nbd_encode_option(void *buf, uint32_t option, uint32_t length)
{
	struct nbd_wire_option w = {
	    .magic = htobe64(NBD_OPTS_MAGIC),
	    .option = htobe32(option),
	    .length = htobe32(length),
	};

	memcpy(buf, &w, sizeof w);
	return sizeof w;
}

int nbd_decode_option(const void *buf, size_t len, struct nbd_option *out)
{
	struct nbd_wire_option w;

	if (len < sizeof w)
		return -EAGAIN;
	memcpy(&w, buf, sizeof w);
	if (be64toh(w.magic) != NBD_OPTS_MAGIC)
		return -EBADMSG;
	out->option = be32toh(w.option);
	out->length = be32toh(w.length);
	return 0;
}

size_t nbd_encode_option_reply(void *buf, uint32_t option, uint32_t type, uint32_t length)
{
	struct nbd_wire_option_reply w = {
	    .magic = htobe64(NBD_REP_MAGIC),
	    .option = htobe32(option),
	    .type = htobe32(type),
	    .length = htobe32(length),
	};

	memcpy(buf, &w, sizeof w);
	return sizeof w;
}

int nbd_decode_option_reply(const void *buf, size_t len, struct nbd_option_reply *out)
{
	struct nbd_wire_option_reply w;

	if (len < sizeof w)
		return -EAGAIN;
	memcpy(&w, buf, sizeof w);
	if (be64toh(w.magic) != NBD_REP_MAGIC)
		return -EBADMSG;
	out->option = be32toh(w.option);
	out->type = be32toh(w.type);
	out->length = be32toh(w.length);
	return 0;
}

/*
 * NBD_OPT_EXPORT_NAME has no reply header: the server answers with the
 * export size and flags directly, followed by 124 bytes of zeroes unless
 * both sides agreed on NO_ZEROES.
 */
size_t nbd_encode_export_name_reply(void *buf, uint64_t size, uint16_t eflags, bool no_zeroes)
{
	struct nbd_wire_export_name_reply w = {
	    .size = htobe64(size),
	    .flags = htobe16(eflags),
	};
	size_t n = no_zeroes ? NBD_EXPORT_NAME_REPLY_SHORT_SIZE : sizeof w;

	memcpy(buf, &w, n);
	return n;
}

size_t nbd_encode_info_export(void *buf, uint64_t size, uint16_t eflags)
{
	struct nbd_wire_info_export w = {
	    .type = htobe16(NBD_INFO_EXPORT),
	    .size = htobe64(size),
	    .flags = htobe16(eflags),
	};

	memcpy(buf, &w, sizeof w);
	return sizeof w;
}

size_t nbd_encode_info_block_size(void *buf, uint32_t minimum, uint32_t preferred, uint32_t maximum)
{
	struct nbd_wire_info_block_size w = {
	    .type = htobe16(NBD_INFO_BLOCK_SIZE),
	    .minimum = htobe32(minimum),
	    .preferred = htobe32(preferred),
	    .maximum = htobe32(maximum),
	};

	memcpy(buf, &w, sizeof w);
	return sizeof w;
}

size_t nbd_encode_info_type(void *buf, uint16_t type)
{
	nbd_put16(buf, type);
	return 2;
}

size_t nbd_encode_rep_server_prefix(void *buf, uint32_t name_length)
{
	nbd_put32(buf, name_length);
	return 4;
}

size_t nbd_encode_meta_context_prefix(void *buf, uint32_t context_id)
{
	nbd_put32(buf, context_id);
	return 4;
}

/*
 * NBD_OPT_INFO / NBD_OPT_GO data:
 *
 *   name length (32) | name | request count (16) | count x info type (16)
 *
 * The layout leaves no room for trailing bytes, so anything but an exact
 * fit is malformed. All arithmetic stays within `len` (a uint32_t) because
 * name_length is bounded by len - 6 before it is added to anything.
 */
int nbd_parse_opt_go(const void *data, uint32_t len, struct nbd_opt_go *out)
{
	const uint8_t *p = data;
	uint32_t name_length;
	uint16_t count;

	if (len < 6)
		return -EINVAL;
	name_length = nbd_get32(p);
	if (name_length > len - 6 || name_length > NBD_MAX_STRING)
		return -EINVAL;
	count = nbd_get16(p + 4 + name_length);
	if ((uint64_t)len != 6 + (uint64_t)name_length + 2 * (uint64_t)count)
		return -EINVAL;
	out->name = (const char *)(p + 4);
	out->name_length = name_length;
	out->info_count = count;
	out->info = p + 6 + name_length;
	return 0;
}

uint16_t nbd_opt_go_info(const struct nbd_opt_go *go, uint16_t i)
{
	assert(i < go->info_count);
	return nbd_get16(go->info + 2 * (size_t)i);
}

/*
 * NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT data:
 *
 *   name length (32) | name | query count (32) |
 *       count x ( query length (32) | query )
 *
 * The query count comes from the peer and may be anything, but every query
 * consumes at least four bytes, so the walk ends after at most len / 4 steps
 * whatever it claims. The queries must end exactly at `len`.
 */
int nbd_parse_opt_meta(const void *data, uint32_t len, struct nbd_opt_meta *out)
{
	const uint8_t *p = data;
	uint32_t name_length, count, pos, i;

	if (len < 8)
		return -EINVAL;
	name_length = nbd_get32(p);
	if (name_length > len - 8 || name_length > NBD_MAX_STRING)
		return -EINVAL;
	count = nbd_get32(p + 4 + name_length);
	pos = 8 + name_length;
	for (i = 0; i < count; i++) {
		uint32_t qlen;

		if (len - pos < 4)
			return -EINVAL;
		qlen = nbd_get32(p + pos);
		pos += 4;
		if (qlen > len - pos || qlen > NBD_MAX_STRING)
			return -EINVAL;
		pos += qlen;
	}
	if (pos != len)
		return -EINVAL;
	out->name = (const char *)(p + 4);
	out->name_length = name_length;
	out->query_count = count;
	out->queries = p + 8 + name_length;
	out->queries_length = len - 8 - name_length;
	return 0;
}

void nbd_meta_iter_init(struct nbd_meta_iter *it, const struct nbd_opt_meta *meta)
{
	it->pos = meta->queries;
	it->end = meta->queries + meta->queries_length;
}

/*
 * The queries were validated by nbd_parse_opt_meta, so the bounds checks
 * here cannot fail; they stay as a cheap guard against an iterator built
 * over something else.
 */
int nbd_meta_iter_next(struct nbd_meta_iter *it, const char **query, uint32_t *length)
{
	uint32_t qlen;

	if (it->end - it->pos < 4)
		return 0;
	qlen = nbd_get32(it->pos);
	if (qlen > (size_t)(it->end - it->pos) - 4) {
		assert(!"meta query overruns its buffer");
		it->pos = it->end;
		return 0;
	}
	*query = (const char *)(it->pos + 4);
	*length = qlen;
	it->pos += 4 + (size_t)qlen;
	return 1;
}

bool nbd_meta_query_selects_base_allocation(const char *query, uint32_t length)
{
	static const char base[] = "base:";
	static const char alloc[] = NBD_META_BASE_ALLOCATION;

	if (length == sizeof base - 1)
		return memcmp(query, base, length) == 0;
	if (length == sizeof alloc - 1)
		return memcmp(query, alloc, length) == 0;
	return false;
}

/*
 * A query is "namespace:leaf" or "namespace:" (list everything in the
 * namespace). The namespace is non-empty and made of printable,
 * non-whitespace characters other than the colon; bytes >= 0x80 are let
 * through as parts of UTF-8 sequences. No NUL may appear anywhere, since
 * the server hands the name on as a C string.
 */
bool nbd_meta_query_valid(const char *query, uint32_t length)
{
	const unsigned char *q = (const unsigned char *)query;
	uint32_t i, colon = 0;

	if (length < 2)
		return false;
	for (i = 0; i < length; i++) {
		if (q[i] == ':') {
			colon = i;
			break;
		}
		if (q[i] < 0x21 || q[i] == 0x7f)
			return false;
	}
	if (i == length || colon == 0)
		return false;
	return memchr(q + colon, '\0', length - colon) == NULL;
}
