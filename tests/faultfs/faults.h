/*
 * tests/faultfs/faults.h: what faultfs does to data operations now, and
 * what it has done (counters).
 *
 * Owns: the fault mode, the delay, the lose-on-fsync-error flag and the
 * counters. Every data operation on a data file asks fault_gate() first;
 * the control file (.faultfs) changes the state with fault_command() and
 * reads it with fault_status(). One mutex guards it all; stalled
 * operations wait on a condition variable that every change of mode
 * broadcasts.
 *
 * Modes (one at a time):
 *   ok               nothing fails
 *   fail-read        read -> EIO
 *   fail-write       write, fallocate, truncate -> EIO
 *   fail-fsync       fsync / fdatasync -> EIO
 *   fail-fsync-once  the next fsync -> EIO, then the mode is ok again
 *   fail-all         read, write, fallocate, truncate, fsync -> EIO
 *   stall            those operations wait until the mode changes (at most
 *                    FAULT_STALL_SECONDS, then EIO)
 * Independent of the mode: delay-ms N (every data operation sleeps N ms
 * first) and lose-on-fsync-error on|off (default on; the caller rolls a
 * file back to its last successful fsync when an fsync fails).
 */
#ifndef FAULTFS_FAULTS_H
#define FAULTFS_FAULTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FAULT_STALL_SECONDS 120

enum fault_op {
	FAULT_OP_READ,
	FAULT_OP_WRITE, /* write, fallocate, truncate */
	FAULT_OP_FSYNC,
};

/* Counters that only the file system knows how to advance. */
enum fault_counter {
	FAULT_READS,
	FAULT_WRITES,
	FAULT_BYTES_WRITTEN,
	FAULT_FALLOCATES,
	FAULT_FSYNCS_OK,
	FAULT_FSYNCS_FAILED,
	FAULT_ROLLBACKS,
	FAULT_POWER_LOSSES,
	FAULT_COUNTERS,
};

/* Wait out the delay and any stall, then decide: 0 to go ahead, -EIO to
 * fail the operation (counted in ops_failed). */
int fault_gate(enum fault_op op);

void fault_count(enum fault_counter c, uint64_t n);

/* Whether a failed fsync rolls the file back. */
bool fault_lose_on_fsync_error(void);

/* Run the command lines in text[0..len): 0, or -EINVAL for a command not
 * understood (the ones before it have run). *power_loss is set when a
 * "power-loss" command was given: the caller does it (it owns the files). */
int fault_command(const char *text, size_t len, bool *power_loss);

/* What the undo logs of every file hold, for the status. */
struct fault_undo_summary {
	uint64_t files;		 /* files with unsynced changes */
	uint64_t bytes;		 /* bytes saved (ranges that were zero too) */
	uint64_t buffered_bytes; /* bytes held in memory */
	uint64_t ranges;
	bool overflow; /* some log hit its bound */
};

/* The state and counters as one JSON object and a newline, into buf
 * (NUL-terminated, cut at size). The length written. */
size_t fault_status(char *buf, size_t size, const struct fault_undo_summary *undo);

#endif
