# nbdcached: plain GNU make.
#
#   make            build/nbdcached and the client programs
#   make check      install missing Debian packages, build, run unit +
#                   integration + interop tests (tests/run: integration
#                   tests two at a time, those marked "alone" by
#                   themselves; TEST_JOBS=1 runs them one after the other)
#   make asan       the same suite under ASan + UBSan (build-asan/)
#   make tsan       the unit tests and the concurrency tests (cache_compact,
#                   cache_races, durability, write_receive, upgrade and the
#                   cache_device ones; one run, two at a time) under TSan
#                   (build-tsan/; suppressions in tests/tsan.supp)
#   make i386       proto/, the dependency-free daemon core and their unit
#                   tests built with -m32 and run (build-i386/); then the
#                   whole project built in an i386 Debian chroot, its unit
#                   tests run there and the integration suite run against
#                   the i386 daemon (scripts/i386-chroot); skipped, saying
#                   so, on a kernel without IA32 emulation
#   make fuzz       libFuzzer targets, each for FUZZ_SECONDS
#   make soak       the crash-consistency tests (and their cache device
#                   modes: device, device-fault, backend-loss, resize) at
#                   length: CRASH_TRIALS trials each (default 300), from
#                   CRASH_SEED (default: the clock)
#   make run        the daemon on the embedded default (see README.md), after
#                   building it and the client programs beside it
#   make bench      bench/ against nbdkit and qemu-nbd, ratios printed
#   make ceph-check the Ceph RBD tests (tests/ceph/) on a throwaway
#                   single-node cluster, its packages installed first
#   make deb        the Debian package, built from a copy of the tree in
#                   build/deb/ (scripts/deb; installs missing build
#                   dependencies): build/deb/nbdcached_VERSION_ARCH.deb
#   make deb-check  make deb, then install the package in a fresh Debian 12
#                   chroot and test it there (scripts/deb-check), lintian too

BUILD ?= build
CC ?= gcc
PREFIX ?= /usr/local
FUZZ_SECONDS ?= 60
SANITIZE ?=
M32 ?=
# The version: debian/changelog's first entry is its only source.
VERSION := $(shell sed -n '1s/^[^(]*(\([^)]*\)).*/\1/p' debian/changelog 2>/dev/null)

WARN := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Werror
OPT ?= -O2 -g
# CFLAGS / LDFLAGS given on the command line are added last, never replace these.
ALL_CFLAGS = $(OPT) -std=c11 $(WARN) -D_FORTIFY_SOURCE=2 -fstack-protector-strong \
	  -D_GNU_SOURCE -D_FILE_OFFSET_BITS=64 -pthread -I. -MMD -MP $(SANITIZE) $(M32) \
	  $(if $(VERSION),-DNBDCACHED_VERSION='"$(VERSION)"') $(CFLAGS)
ALL_LDFLAGS = -pthread $(SANITIZE) $(M32) $(LDFLAGS)

DAEMON_LIBS := $(shell pkg-config --libs libevent_pthreads liburing libnbd libsystemd inih json-c gnutls libmicrohttpd 2>/dev/null || echo -levent -levent_pthreads -luring -lnbd -lsystemd -linih -ljson-c -lgnutls -lmicrohttpd)
# Ceph RBD backends (daemon/backend/rbd*.c): librbd and librados (Debian's
# librbd-dev, which ships no pkg-config file). RBD=0 builds without them
# (daemon/backend/rbd_none.c: an rbd: export is refused at start), as the
# i386 chroot does.
RBD ?= 1
RBD_SRC := daemon/backend/rbd.c daemon/backend/rbd_io.c
ifeq ($(RBD),1)
DAEMON_LIBS += -lrbd -lrados
RBD_OUT := daemon/backend/rbd_none.c
else
RBD_OUT := $(RBD_SRC)
endif
DAEMON_CFLAGS := $(shell pkg-config --cflags libevent liburing libnbd libsystemd inih json-c gnutls libmicrohttpd 2>/dev/null)
CTL_LIBS := $(shell pkg-config --libs json-c 2>/dev/null || echo -ljson-c)

# The codec: pure, no dependency.
PROTO_SRC := $(wildcard proto/*.c)
# The daemon's dependency-free core: builds on i386 and is unit tested there.
CORE_SRC := daemon/options.c daemon/export_spec.c daemon/option_values.c daemon/access.c daemon/qos.c daemon/log.c daemon/check.c daemon/settings.c daemon/cache/arena.c \
	daemon/histogram.c daemon/rbd_spec.c daemon/upgrade_record.c daemon/cache/device_format.c
# Everything else in the daemon needs libevent / liburing.
DAEMON_SRC := $(filter-out $(CORE_SRC) $(RBD_OUT),$(wildcard daemon/*.c daemon/backend/*.c daemon/cache/*.c))
# test_uring and test_queue need liburing and libevent: not in the -m32 build of the core.
UNIT_SRC := $(filter-out $(if $(M32),tests/unit/test_uring.c tests/unit/test_queue.c),$(wildcard tests/unit/test_*.c))
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
# The client library (client/lib/: the control-socket client, the NBD
# client, messages), linked into both client programs: nbdcachectl is
# client/nbdcachectl/*.c, nbdcache-io is client/nbdcache-io.c.
CLIENT_LIB_SRC := $(wildcard client/lib/*.c)
CTL_SRC := $(wildcard client/nbdcachectl/*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
PROTO_OBJ := $(call obj,$(PROTO_SRC))
CORE_OBJ := $(call obj,$(CORE_SRC))
DAEMON_OBJ := $(call obj,$(DAEMON_SRC))
UNIT_BIN := $(patsubst tests/unit/%.c,$(BUILD)/tests/unit/%,$(UNIT_SRC))
CLIENT_LIB_OBJ := $(call obj,$(CLIENT_LIB_SRC))
CLIENT_LIB := $(BUILD)/obj/client/lib/libclient.a
CTL_OBJ := $(call obj,$(CTL_SRC))
CLIENT_BIN := $(BUILD)/nbdcachectl $(BUILD)/nbdcache-io
# Fault injection tools for the tests (tests/faultfs, tests/nbdkit-fault);
# scripts/i386-chroot builds without them (TEST_TOOLS=).
TEST_TOOLS ?= $(BUILD)/tests/faultfs $(BUILD)/tests/nbdkit-fault-filter.so

.PHONY: all programs check unit asan tsan i386 fuzz soak run bench deps clean install deb deb-check
.DEFAULT_GOAL := all

all: programs $(UNIT_BIN) $(TEST_TOOLS)

# What make install installs.
programs: $(BUILD)/nbdcached $(CLIENT_BIN)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(DAEMON_CFLAGS) -c -o $@ $<

# The two files that print the version.
$(BUILD)/obj/daemon/main.o $(BUILD)/obj/daemon/control.o: $(wildcard debian/changelog)

$(BUILD)/nbdcached: $(DAEMON_OBJ) $(CORE_OBJ) $(PROTO_OBJ)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ $(DAEMON_LIBS)

# The client library, compiled once: a static archive, so each program
# takes only the modules it uses (nbdcache-io needs no json-c).
$(CLIENT_LIB): $(CLIENT_LIB_OBJ)
	rm -f $@
	$(AR) rcs $@ $^

# nbdcachectl speaks JSON (json-c) to the control socket.
$(BUILD)/nbdcachectl: $(CTL_OBJ) $(CLIENT_LIB)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ $(CTL_LIBS)

# nbdcache-io speaks NBD through the codec.
$(BUILD)/nbdcache-io: $(BUILD)/obj/client/nbdcache-io.o $(CLIENT_LIB) $(PROTO_OBJ)
	$(CC) $(ALL_LDFLAGS) -o $@ $^

# Unit tests: one cmocka binary per module, linked with proto/ and the core.
$(BUILD)/tests/unit/%: $(BUILD)/obj/tests/unit/%.o $(PROTO_OBJ) $(CORE_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ -lcmocka

# faultfs: a FUSE passthrough that fails, stalls and undoes I/O on command.
FAULTFS_OBJ := $(call obj,$(wildcard tests/faultfs/*.c))
$(FAULTFS_OBJ): ALL_CFLAGS += $(shell pkg-config --cflags fuse3 2>/dev/null)
$(BUILD)/tests/faultfs: $(FAULTFS_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ $(shell pkg-config --libs fuse3 2>/dev/null || echo -lfuse3)

# An nbdkit filter failing commands on command. Never sanitized: it is
# loaded into Debian's nbdkit, which has no sanitizer runtime.
$(BUILD)/tests/nbdkit-fault-filter.so: tests/nbdkit-fault/fault-filter.c tests/faultfs/undo.c tests/faultfs/undo.h
	@mkdir -p $(dir $@)
	$(CC) $(OPT) -std=c11 $(WARN) -D_GNU_SOURCE -D_FILE_OFFSET_BITS=64 -I. -fPIC -shared -pthread \
		-o $@ $(filter %.c,$^) $(LDFLAGS)

# The arena's unit test makes malloc fail on demand (a split chunk's tables
# not allocated): its malloc is the test's wrapper.
$(BUILD)/tests/unit/test_arena: ALL_LDFLAGS += -Wl,--wrap=malloc

# The io_uring wrapper's unit test links the wrapper and its libraries.
$(BUILD)/tests/unit/test_uring: $(BUILD)/obj/tests/unit/test_uring.o $(BUILD)/obj/daemon/uring.o \
		$(PROTO_OBJ) $(CORE_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ -lcmocka $(DAEMON_LIBS)

# The queue's unit test links the queue and libevent (its wake-up).
$(BUILD)/tests/unit/test_queue: $(BUILD)/obj/tests/unit/test_queue.o $(BUILD)/obj/daemon/queue.o \
		$(PROTO_OBJ) $(CORE_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ -lcmocka $(DAEMON_LIBS)

# The client library's NBD client against a scripted server: links that
# part of the library (libc only, so it builds with -m32 too).
$(BUILD)/tests/unit/test_client_nbd: $(BUILD)/obj/tests/unit/test_client_nbd.o \
		$(call obj,client/lib/nbd.c client/lib/io.c client/lib/report.c) $(PROTO_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) -o $@ $^ -lcmocka

deps:
	@scripts/deps

check: deps
	$(MAKE) all
	BUILD=$(BUILD) tests/run

# Unit tests only (used by make i386).
unit: $(UNIT_BIN)
	BUILD=$(BUILD) tests/run --unit-only

# The sanitizer and i386 passes repeat the long randomised tests fewer times
# than make check does (which runs them in full): crash trials, backend-death
# runs, the compaction run's length; cache_races' FLUSH-during-writeback
# rounds and model ops per configuration (400 and 3000 in full), upgrade's
# upgrades in a row (20), cache_property's random ops per run (500), and
# fio_verify's bytes per job (64 MiB, its cache shrunk alike so that the
# data still outgrows it). They also shorten the fixed waits of timed tests,
# each still long enough for what it times, whose bounds stay as they are:
# hostile_direct's run and quiet spells (2 s each; the backend takes
# several hundred of the operation's requests a second), fault_matrix's
# --backend-timeout (2 s; its waits for a reply are 10 x it), qos' floods
# (QOS_SECONDS, 3 s: each rate over 1 s instead of 2, still +-10%),
# budgets' --stall-timeout for its non-readers (5 s; resets are still due
# 1 s early to 3 x it late, and the log says which deadline) and its
# backend read delay (1 s), hostile_reads' flood of non-readers (6 s, and
# on until the reply memory is half full, which the test checks); qos'
# isolation check allows the unlimited client's rate beside
# a limited one 50% from its rate alone (15% in make check: the i386 chroot
# swung 24-31% both ways in three tries). cache_device_l2's crash rounds (3 of each kind; 1) stay a
# round of every kind: SIGKILL after writes, at once after a FLUSH, power
# cuts. The cache device crash families (cache_device_crash_fault, _drain,
# _backend, _resize: 5 trials each in make check) run 3 each
# (CRASH_FAMILY_TRIALS), 2 under TSan. upgrade_device (4 upgrades and 4
# SIGKILL trials per cache-device-use mode in make check) runs 2 and 2.
SHORT_REPEATS = CRASH_TRIALS=12 CRASH_FAMILY_TRIALS=3 RUNS=5 RUNS9=1 CACHE_COMPACT_SECONDS=10 \
	CACHE_RACES_WB_ITERATIONS=100 CACHE_RACES_MODEL_OPS=1000 UPGRADES=8 \
	CACHE_PROPERTY_OPS=200 FIO_VERIFY_MIB=16 \
	HOSTILE_DIRECT_RUN=1 HOSTILE_DIRECT_QUIET=1 \
	FAULT_MATRIX_BACKEND_TIMEOUT=1 \
	QOS_SECONDS=2 BUDGETS_STALL_TIMEOUT=3 BUDGETS_READ_DELAY=0.5 \
	HOSTILE_READS_SECONDS=3 L2_CRASH_ROUNDS=1 QOS_ISOLATION_TOLERANCE=0.5 \
	UPGRADES_DEVICE=2 CRASH_TRIALS_DEVICE=2

# ... and leave out (TEST_EXCLUDE) the tests whose outcome does not depend
# on the build under test, which make check runs: deps_mirror.py
# (scripts/deps and its apt mirror; 45-55 s a pass) and, in make i386,
# install_tree.py (there it builds the host's amd64 programs into
# build-i386-root/run and installs those, never the i386 ones; 22 s).
# tests/run fails if a name here is no longer a test.
SAME_IN_EVERY_BUILD = deps_mirror.py

asan: deps
	$(MAKE) BUILD=build-asan CC=gcc SANITIZE="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -DNBDCACHED_CHECKS" OPT="-O1 -g" all
	$(SHORT_REPEATS) TEST_EXCLUDE="$(SAME_IN_EVERY_BUILD)" ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:quarantine_size_mb=16 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		BUILD=build-asan tests/run

# TSan does not mix with ASan. libevent and liburing are not instrumented:
# tests/tsan.supp lists the few reports that come from inside them.
TSAN_RUN = TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp halt_on_error=1 second_deadlock_stack=1" BUILD=build-tsan
tsan: deps
	$(MAKE) BUILD=build-tsan CC=gcc SANITIZE="-fsanitize=thread -fno-omit-frame-pointer" OPT="-O1 -g" all
	$(TSAN_RUN) tests/run --unit-only
	$(TSAN_RUN) CACHE_COMPACT_SECONDS=10 CRASH_TRIALS=8 CRASH_FAMILY_TRIALS=2 L2_CRASH_ROUNDS=1 \
		UPGRADES_DEVICE=2 CRASH_TRIALS_DEVICE=2 tests/run --integration-only \
		'cache_compact|cache_races|durability|write_receive|upgrade|cache_device'

# A kernel without IA32 emulation runs no i386 program: the whole target
# is skipped then, saying so (scripts/i386-can-run).
i386: deps
	@if scripts/i386-can-run; then \
		$(MAKE) BUILD=build-i386 M32=-m32 unit && \
		$(SHORT_REPEATS) TEST_EXCLUDE="$(SAME_IN_EVERY_BUILD) install_tree.py" scripts/i386-chroot; \
	else \
		echo "make i386: skipped: the kernel lacks IA32 emulation (see above)"; \
		echo "0 passed, 0 failed, 1 skipped"; \
	fi

FUZZ_BIN := $(patsubst tests/fuzz/%.c,build-fuzz/%,$(FUZZ_SRC))
build-fuzz/%: tests/fuzz/%.c tests/fuzz/fuzz.h $(PROTO_SRC) proto/nbd.h
	@mkdir -p build-fuzz
	clang -std=c11 -g -O1 -D_GNU_SOURCE -I. -fsanitize=fuzzer,address,undefined -o $@ $< $(PROTO_SRC)

# The rbd: backend string's parser (no Ceph library).
build-fuzz/fuzz_rbd_spec: tests/fuzz/fuzz_rbd_spec.c tests/fuzz/fuzz.h daemon/rbd_spec.c daemon/rbd_spec.h
	@mkdir -p build-fuzz
	clang -std=c11 -g -O1 -D_GNU_SOURCE -I. -fsanitize=fuzzer,address,undefined -o $@ \
		tests/fuzz/fuzz_rbd_spec.c daemon/rbd_spec.c

# An --export value: its keys are the export settings' table.
EXPORT_SPEC_FUZZ_SRC := daemon/export_spec.c daemon/settings.c daemon/option_values.c \
	daemon/access.c daemon/qos.c daemon/log.c daemon/check.c
build-fuzz/fuzz_export_spec: tests/fuzz/fuzz_export_spec.c tests/fuzz/fuzz.h $(EXPORT_SPEC_FUZZ_SRC) $(wildcard daemon/*.h)
	@mkdir -p build-fuzz
	clang -std=c11 -g -O1 -D_GNU_SOURCE -I. -fsanitize=fuzzer,address,undefined -o $@ \
		tests/fuzz/fuzz_export_spec.c $(EXPORT_SPEC_FUZZ_SRC)

# The state record of a live upgrade, as the new daemon decodes it.
build-fuzz/fuzz_upgrade_record: tests/fuzz/fuzz_upgrade_record.c tests/fuzz/fuzz.h daemon/upgrade_record.c daemon/upgrade_record.h $(PROTO_SRC) proto/nbd.h
	@mkdir -p build-fuzz
	clang -std=c11 -g -O1 -D_GNU_SOURCE -I. -fsanitize=fuzzer,address,undefined -o $@ \
		tests/fuzz/fuzz_upgrade_record.c daemon/upgrade_record.c $(PROTO_SRC)

# A cache device's superblock and log batch headers, as the replay decodes them.
build-fuzz/fuzz_device_format: tests/fuzz/fuzz_device_format.c tests/fuzz/fuzz.h daemon/cache/device_format.c daemon/cache/device_format.h $(PROTO_SRC) proto/nbd.h
	@mkdir -p build-fuzz
	clang -std=c11 -g -O1 -D_GNU_SOURCE -I. -fsanitize=fuzzer,address,undefined -o $@ \
		tests/fuzz/fuzz_device_format.c daemon/cache/device_format.c $(PROTO_SRC)

# The negotiation fuzzer runs daemon/handshake.c itself, over stubs of the
# layers below it (its own file), with libevent's evbuffers.
build-fuzz/fuzz_negotiation: tests/fuzz/fuzz_negotiation.c tests/fuzz/fuzz.h daemon/handshake.c daemon/access.c daemon/option_values.c $(wildcard daemon/*.h) $(PROTO_SRC) proto/nbd.h
	@mkdir -p build-fuzz
	clang -std=c11 -g -O1 -D_GNU_SOURCE -I. $(DAEMON_CFLAGS) -fsanitize=fuzzer,address,undefined \
		-o $@ tests/fuzz/fuzz_negotiation.c daemon/handshake.c daemon/access.c daemon/option_values.c $(PROTO_SRC) -levent

fuzz: deps $(FUZZ_BIN)
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz $(FUZZ_BIN)

soak: deps
	$(MAKE) all
	seed=$${CRASH_SEED:-$$(date +%s)}; rc=0; \
	for t in crash_consistency cache_device_crash cache_device_crash_fault \
			cache_device_crash_backend cache_device_crash_resize \
			cache_device_crash_drain; do \
		CRASH_TRIALS=$${CRASH_TRIALS:-300} CRASH_SEED=$$seed \
			TEST_TIMEOUT=$${TEST_TIMEOUT:-7200} BUILD=$(BUILD) tests/run --integration-only $$t.py || rc=1; \
		grep -E '^(crash_consistency:|[0-9]+ (kill|cache device|device-fault|backend-loss|resize|drain) trial)' \
			$(BUILD)/test-logs/integration_$$t.py.log; \
	done; exit $$rc

run: deps $(BUILD)/nbdcached $(CLIENT_BIN)
	@scripts/run-default

bench: deps all
	bench/run

install: programs
	install -d $(DESTDIR)$(PREFIX)/sbin $(DESTDIR)$(PREFIX)/bin \
		$(DESTDIR)$(PREFIX)/share/man/man1 $(DESTDIR)$(PREFIX)/share/man/man8 \
		$(DESTDIR)/lib/systemd/system $(DESTDIR)/etc/nbdcached
	install -m 0755 $(BUILD)/nbdcached $(DESTDIR)$(PREFIX)/sbin/nbdcached
	for b in $(CLIENT_BIN); do install -m 0755 $$b $(DESTDIR)$(PREFIX)/bin/; done
	for m in man/*.1; do [ -e "$$m" ] && install -m 0644 $$m $(DESTDIR)$(PREFIX)/share/man/man1/; done; true
	install -m 0644 man/*.8 $(DESTDIR)$(PREFIX)/share/man/man8/
	sed 's|/usr/local|$(PREFIX)|g' systemd/nbdcached.service >$(DESTDIR)/lib/systemd/system/nbdcached.service
	install -m 644 systemd/nbdcached.socket $(DESTDIR)/lib/systemd/system/nbdcached.socket
	install -D -m 644 systemd/nbdcached.sysusers $(DESTDIR)/usr/lib/sysusers.d/nbdcached.conf
	install -D -m 644 systemd/block-device.conf \
		$(DESTDIR)$(PREFIX)/share/doc/nbdcached/nbdcached.service.d/block-device.conf
	install -d $(DESTDIR)$(PREFIX)/share/man/man5 $(DESTDIR)$(PREFIX)/share/doc/nbdcached \
		$(DESTDIR)$(PREFIX)/include/nbdcached
	for m in man/*.5; do [ -e "$$m" ] && install -m 0644 $$m $(DESTDIR)$(PREFIX)/share/man/man5/; done; true
	install -m 0644 include/nbdcached/control.h $(DESTDIR)$(PREFIX)/include/nbdcached/control.h
	install -m 0644 configs/*.conf $(DESTDIR)$(PREFIX)/share/doc/nbdcached/
	install -d $(DESTDIR)$(PREFIX)/share/doc/nbdcached/prometheus
	install -m 0644 configs/prometheus/* $(DESTDIR)$(PREFIX)/share/doc/nbdcached/prometheus/
	install -m 0644 configs/nbdcached.conf $(DESTDIR)/etc/nbdcached/nbdcached.conf.example
	# The operator's config is never overwritten.
	[ -e $(DESTDIR)/etc/nbdcached/nbdcached.conf ] || \
		install -m 0644 configs/nbdcached.conf $(DESTDIR)/etc/nbdcached/nbdcached.conf

# The kernel NBD client tests (tests/kernel/): Debian's own amd64 and i386
# kernels booted under qemu (TCG) attach the daemon's exports with nbd-client.
.PHONY: kernel-check
# KERNEL_TESTS: names of tests/kernel/*.py to run (default: all of them).
kernel-check: deps
	tests/kernel/deps
	$(MAKE) programs
	@if [ -z "$(KERNEL_TESTS)" ]; then BUILD=$(BUILD) tests/run --kernel; \
	else rc=0; for t in $(KERNEL_TESTS); do BUILD=$(BUILD) tests/run --kernel $$t || rc=1; done; \
	exit $$rc; fi

# The Ceph tests (tests/ceph/): rbd: exports against a throwaway
# single-node cluster each test starts itself (about 15 s) and stops by PID.
.PHONY: ceph-check
ceph-check: deps
	tests/ceph/deps
	$(MAKE) programs
	BUILD=$(BUILD) tests/run --ceph

deb:
	scripts/deb

deb-check: deb
	scripts/deb-check

clean:
	rm -rf build build-asan build-tsan build-i386 build-i386-root build-fuzz build-clang build-deb-root

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
.SECONDARY:
