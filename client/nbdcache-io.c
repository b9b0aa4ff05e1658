/*
 * client/nbdcache-io.c: nbdcache-io, nbdcached's own small NBD client: one
 * connection, one command, blocking I/O, one request in flight.
 *
 * The NBD client itself is client/lib/nbd.h, built on proto/nbd.h; this
 * file is the command line, the commands and their output. The interop
 * tests run it against nbdcached and against qemu-nbd.
 *
 * The client does not second-guess the server: out-of-range, unaligned or
 * unadvertised requests go out as asked, so tests see the server's answer.
 * It only splits what one request cannot carry: payloads beyond the maximum
 * payload size, and effect lengths beyond 32 bits in compact mode.
 *
 *   main -> nbd_client_handshake -> nbd_client_list (list)
 *                                -> nbd_client_go -> run_command
 *        -> run_range -> nbd_client_transact
 *
 * Errors are 0 / -errno inside and are reported where detected. main() maps
 * them to the exit status: 0 success; 1 an NBD error from the server
 * (-EREMOTEIO) or a local failure; 2 a protocol violation by the server or a
 * lost connection (-EPROTO).
 */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/lib/io.h"
#include "client/lib/nbd.h"
#include "client/lib/report.h"
#include "proto/nbd.h"

#define PROGRAM "nbdcache-io"
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

/* What each COMMAND does: how it runs and which NBD_CMD_FLAG_* it may add. */
enum run { RUN_INFO, RUN_LIST, RUN_ONCE, RUN_PAYLOAD, RUN_EFFECT, RUN_STATUS };
struct command {
	const char *name;
	uint16_t type;
	enum run run; /* RUN_PAYLOAD and later take OFF LEN */
	uint16_t flags;
};

static const struct command commands[] = {
    {"info", 0, RUN_INFO, 0},
    {"list", 0, RUN_LIST, 0},
    {"flush", NBD_CMD_FLUSH, RUN_ONCE, 0},
    {"read", NBD_CMD_READ, RUN_PAYLOAD, 0},
    {"write", NBD_CMD_WRITE, RUN_PAYLOAD, NBD_CMD_FLAG_FUA},
    {"trim", NBD_CMD_TRIM, RUN_EFFECT, NBD_CMD_FLAG_FUA},
    {"zero", NBD_CMD_WRITE_ZEROES, RUN_EFFECT,
     NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO},
    {"cache", NBD_CMD_CACHE, RUN_EFFECT, 0},
    {"status", NBD_CMD_BLOCK_STATUS, RUN_STATUS, NBD_CMD_FLAG_REQ_ONE},
};

struct args {
	const char *unix_path, *tcp, *export_name;
	const struct command *command;
	int no_extended, no_structured, meta, debug; /* set by getopt_long */
	uint16_t flags;
	uint64_t offset, length;
};

/* list: one line per export, "NAME" or "NAME<TAB>DESCRIPTION". */
static void print_export(void *opaque, const char *name, size_t name_length,
			 const char *description, size_t description_length)
{
	(void)opaque;
	print_safe(stdout, name, name_length);
	if (description_length) {
		putchar('\t');
		print_safe(stdout, description, description_length);
	}
	putchar('\n');
}

/* status: one line per extent, "OFFSET LENGTH FLAGS". */
static void print_extent(void *opaque, uint64_t offset, uint64_t length, uint64_t flags)
{
	(void)opaque;
	printf("%" PRIu64 " %" PRIu64 " %" PRIu64 "\n", offset, length, flags);
}

/*
 * Every transmission command over [offset, offset + length): split into
 * requests of at most `step` bytes (always at least one request, so a zero
 * length, or FLUSH, reaches the server too). READ output goes to stdout,
 * WRITE input comes from stdin.
 */
static int run_range(struct nbd_client *c, struct nbd_transaction *t, uint64_t step)
{
	uint64_t offset = t->offset, done = 0, total = t->length;
	size_t buffer = total < step ? (size_t)total + 1 : (size_t)step;
	uint8_t *data = NULL, *map = NULL;
	int err = 0;

	if (t->type == NBD_CMD_READ || t->type == NBD_CMD_WRITE) {
		data = malloc(buffer);
		if (t->type == NBD_CMD_READ)
			map = malloc(buffer / 8 + 1);
		if (!data || (t->type == NBD_CMD_READ && !map)) {
			err = -ENOMEM;
			goto out;
		}
	}
	do {
		t->offset = offset + done;
		t->length = total - done < step ? total - done : step;
		t->data = data;
		t->map = map;
		if (t->type == NBD_CMD_WRITE) {
			err = io_full(STDIN_FILENO, data, (size_t)t->length, false);
			if (err) {
				report("write: standard input: %s",
				       err == -ENODATA ? "shorter than LEN" : strerror(-err));
				break;
			}
		}
		err = nbd_client_transact(c, t, t->type == NBD_CMD_WRITE ? data : NULL);
		if (!err && t->type == NBD_CMD_READ) {
			err = io_full(STDOUT_FILENO, data, (size_t)t->length, true);
			if (err)
				report("read: standard output: %s", strerror(-err));
		}
		done += t->length;
	} while (!err && done < total);
out:
	free(map);
	free(data);
	return err;
}

static void print_info(const struct nbd_client *c, const struct args *a)
{
	static const char *const names[] = {
	    "HAS_FLAGS",	   "READ_ONLY",	  "SEND_FLUSH",	       "SEND_FUA",
	    "ROTATIONAL",	   "SEND_TRIM",	  "SEND_WRITE_ZEROES", "SEND_DF",
	    "CAN_MULTI_CONN",	   "SEND_RESIZE", "SEND_CACHE",	       "SEND_FAST_ZERO",
	    "BLOCK_STATUS_PAYLOAD"};
	const char *sep = "";

	printf("export=%s\nsize=%" PRIu64 "\neflags=0x%04x\neflags_names=", a->export_name, c->size,
	       c->eflags);
	for (unsigned bit = 0; bit < 16; bit++) {
		if (!(c->eflags >> bit & 1))
			continue;
		if (bit < ARRAY_SIZE(names))
			printf("%s%s", sep, names[bit]);
		else
			printf("%sbit%u", sep, bit);
		sep = ",";
	}
	printf("\nstructured=%d\nextended=%d\n", c->structured, c->extended);
	if (c->have_block_size)
		printf("block_size_minimum=%" PRIu32 "\nblock_size_preferred=%" PRIu32
		       "\nblock_size_maximum=%" PRIu32 "\n",
		       c->min_block, c->preferred_block, c->max_block);
	for (int i = 0; i < 2; i++) {
		const char *value = i ? c->description : c->name;
		if (!value[0])
			continue;
		fputs(i ? "description=" : "name=", stdout);
		print_safe(stdout, value, strlen(value));
		putchar('\n');
	}
	if (a->meta) {
		printf("meta_context=%s\n", c->meta ? NBD_META_BASE_ALLOCATION : "");
		if (c->meta)
			printf("meta_context_id=%" PRIu32 "\n", c->meta_id);
	}
}

/* Option haggling: list the exports, or select one for the command. */
static int negotiate(struct nbd_client *c, const struct args *a)
{
	struct nbd_client_options o = {.export_name = a->export_name,
				       .no_extended = a->no_extended,
				       .no_structured = a->no_structured,
				       .meta = a->meta || a->command->run == RUN_STATUS};
	int err = nbd_client_handshake(c);

	if (err || a->command->run == RUN_LIST)
		return err ? err : nbd_client_list(c, print_export, NULL);
	return nbd_client_go(c, &o);
}

/* Transmission phase: the command, then NBD_CMD_DISC. */
static int run_command(struct nbd_client *c, const struct args *a)
{
	const struct command *cmd = a->command;
	struct nbd_transaction t = {.command = cmd->name,
				    .type = cmd->type,
				    .flags = a->flags,
				    .offset = a->offset,
				    .length = a->length,
				    .extent = print_extent};
	/* In compact mode an effect length is 32 bits: split at an aligned bound. */
	uint64_t effect_step = nbd_client_max_effect(c);
	int err = 0;

	if (cmd->run == RUN_INFO) {
		print_info(c, a);
	} else if (cmd->run == RUN_STATUS && !c->meta) {
		report("status: no base:allocation context (%s)",
		       c->structured ? "refused by the server" : "needs structured replies");
		err = -ENOTSUP;
	} else {
		/* Block status is one request: its length is a hint, so clamp it. */
		if (cmd->run == RUN_STATUS && t.length > effect_step)
			t.length = effect_step;
		err = run_range(c, &t, cmd->run == RUN_PAYLOAD ? c->max_payload : effect_step);
	}
	if (err != -EPROTO) {
		int e = nbd_client_disconnect(c);
		err = err ? err : e;
	}
	return err;
}

static void usage(FILE *f)
{
	fputs("usage: " PROGRAM " (--unix PATH | --tcp HOST:PORT) [--export NAME]\n"
	      "           [--no-extended] [--no-structured] [--meta] [--debug] COMMAND [ARGS]\n"
	      "commands: info | list | read OFF LEN | write OFF LEN (data on stdin)\n"
	      "          | trim OFF LEN [--fua] | zero OFF LEN [--fua] [--no-hole] [--fast]\n"
	      "          | flush | cache OFF LEN | status OFF LEN [--req-one]\n"
	      "OFF and LEN: decimal or 0x hex, optional suffix K M G T P E (powers of 1024)\n"
	      "exit status: 0 success, 1 NBD error or local failure, 2 protocol violation\n",
	      f);
}

/* Decimal or 0x hex, with an optional binary suffix; all 64 bits. */
static int parse_number(const char *s, uint64_t *out)
{
	static const char suffixes[] = "KMGTPE";
	const char *p = s, *suffix;
	int base = 10;
	unsigned shift = 0;
	unsigned long long value;
	char *end;

	if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) {
		base = 16;
		p += 2;
	}
	if (!(base == 16 ? isxdigit((unsigned char)*p) : isdigit((unsigned char)*p)))
		return -EINVAL;
	errno = 0;
	value = strtoull(p, &end, base);
	if (errno)
		return -errno;
	if (*end) {
		suffix = strchr(suffixes, toupper((unsigned char)*end));
		if (!suffix || end[1])
			return -EINVAL;
		shift = 10 * (unsigned)(suffix - suffixes + 1);
		if (value > (UINT64_MAX >> shift))
			return -ERANGE;
	}
	*out = (uint64_t)value << shift;
	return 0;
}

/* Options anywhere on the line; 0, or -EINVAL after printing why. */
static int parse_args(int argc, char **argv, struct args *a)
{
	enum { FLAG_OPTION = 1 << 16 }; /* getopt value of a command flag option */
	const struct option options[] = {
	    {"unix", required_argument, NULL, 'u'},
	    {"tcp", required_argument, NULL, 't'},
	    {"export", required_argument, NULL, 'e'},
	    {"no-extended", no_argument, &a->no_extended, 1},
	    {"no-structured", no_argument, &a->no_structured, 1},
	    {"meta", no_argument, &a->meta, 1},
	    {"debug", no_argument, &a->debug, 1},
	    {"fua", no_argument, NULL, FLAG_OPTION | NBD_CMD_FLAG_FUA},
	    {"no-hole", no_argument, NULL, FLAG_OPTION | NBD_CMD_FLAG_NO_HOLE},
	    {"fast", no_argument, NULL, FLAG_OPTION | NBD_CMD_FLAG_FAST_ZERO},
	    {"req-one", no_argument, NULL, FLAG_OPTION | NBD_CMD_FLAG_REQ_ONE},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	const char *name;
	int opt;

	a->export_name = "";
	while ((opt = getopt_long(argc, argv, "u:t:e:dh", options, NULL)) != -1) {
		if (opt == 'u')
			a->unix_path = optarg;
		else if (opt == 't')
			a->tcp = optarg;
		else if (opt == 'e')
			a->export_name = optarg;
		else if (opt == 'd')
			a->debug = 1;
		else if (opt == 'h') {
			usage(stdout);
			exit(0);
		} else if (opt & FLAG_OPTION)
			a->flags |= (uint16_t)opt;
		else if (opt != 0)
			return -EINVAL;
	}
	if (!a->unix_path == !a->tcp || optind >= argc || strlen(a->export_name) > NBD_MAX_STRING) {
		report("give one of --unix and --tcp, and a COMMAND");
		return -EINVAL;
	}
	name = argv[optind++];
	for (size_t i = 0; i < ARRAY_SIZE(commands); i++)
		if (strcmp(commands[i].name, name) == 0)
			a->command = &commands[i];
	if (!a->command) {
		report("unknown command %s", name);
		return -EINVAL;
	}
	if (argc - optind != (a->command->run >= RUN_PAYLOAD ? 2 : 0) ||
	    (a->flags & ~a->command->flags)) {
		report("%s: wrong arguments or flags", name);
		return -EINVAL;
	}
	if (optind < argc && (parse_number(argv[optind], &a->offset) != 0 ||
			      parse_number(argv[optind + 1], &a->length) != 0)) {
		report("%s: bad number", name);
		return -EINVAL;
	}
	return 0;
}

int main(int argc, char **argv)
{
	static struct nbd_client c; /* large: holds the option payload buffer */
	struct args a = {0};
	int fd, err;

	report_set_program(PROGRAM);
	if (parse_args(argc, argv, &a) != 0) {
		usage(stderr);
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	fd = nbd_client_connect(a.unix_path, a.tcp);
	if (fd < 0) {
		report("connect %s: %s", a.unix_path ? a.unix_path : a.tcp, strerror(-fd));
		return 1;
	}
	nbd_client_init(&c, fd, a.debug);
	err = negotiate(&c, &a);
	if (!err && a.command->run != RUN_LIST)
		err = run_command(&c, &a);
	close(c.fd);
	if (fflush(stdout) != 0 && !err) {
		report("standard output: %s", strerror(errno));
		err = -EIO;
	}
	return err == 0 ? 0 : err == -EPROTO ? 2 : 1;
}
