/*
 * include/nbdcached/control.h: the control socket's protocol, for
 * nbdcachectl and any other tool. This file is the schema.
 *
 * Transport: a Unix stream socket, by default NBDCACHED_CONTROL_DEFAULT
 * (`--control PATH` on nbdcached and nbdcachectl), mode 0600: the daemon's
 * user (nbdcached under nbdcached.service) and root only, unless the
 * operator loosens it. One JSON object per line (UTF-8, no
 * newline inside an object) in each direction; a client may send several
 * requests on one connection, and each gets exactly one reply, in order.
 * A request line longer than NBDCACHED_CONTROL_MAX_REQUEST bytes closes the
 * connection. A request is strict JSON: one object, no key twice in any
 * object, nothing but white space after it; anything else is an "EINVAL"
 * reply (and runs nothing). While a client has 1 MiB of replies unread the
 * daemon reads no more of its requests, until it has read half of them; at
 * most 64 clients are connected at a time (more are closed at once).
 *
 * Request:   {"command": NAME, ...arguments}
 * Reply:     {"ok": true, ...fields}                 on success
 *            {"ok": false, "error": TEXT, "errno": NAME}   on failure
 *            NAME is a symbolic errno: "ENOENT" (no such export), "EINVAL"
 *            (bad request or argument), "EIO" (the backend refused data),
 *            "EBUSY", "ENOTSUP".
 *
 * Every number is a JSON integer (64-bit) unless marked (double). Sizes are
 * bytes, times as named (_ns, _ms, _s). Counters only grow while the daemon
 * runs; tools compute rates from two samples and "time_ms".
 *
 * Commands and their reply fields:
 *
 *   status
 *     version (string), pid, uptime_ms, config (string or null: the config
 *     file in use), exports (count), connections (count, all exports),
 *     threads, arena (string: "hugetlb", "thp" or "plain"), cache_bytes,
 *     used_bytes, dirty_bytes, removed_backends (exports removed by a
 *     reload whose connections or dirty data are not finished yet: their
 *     backends are still open), rate_slots (exports whose writeback_rate
 *     the daemon keeps: the exports served, once a second has passed since
 *     the last reload; a removed export's slot is freed then),
 *     listen: array of {type: "tcp", address (string, numeric), port} or
 *             {type: "unix", path}: every listening socket, including the
 *             ones systemd passed (socket activation)
 *
 *   exports
 *     exports: array of EXPORT objects:
 *       name, description (string or null), backend (string: the path, URI,
 *       "nbdkit:..." or "rbd:..." as configured), kind (string: "file",
 *       "nbd" or "rbd"), fenced (bool: the backend may never be written
 *       again, an rbd image whose exclusive lock another node took; every
 *       request fails with EIO),
 *       size (what clients see: the window's size), offset (the window's
 *       first byte in the backend; 0 for a whole export), split (the window
 *       size of its NAME/K windows; 0: none), window_of (string: the split
 *       export a window belongs to, or null), readonly (bool), block_size,
 *       cache_mode (string: "writeback", "writethrough", "writearound" or
 *       "none"), seq_cutoff, max_connections (0: unlimited), connections,
 *       dirty_high, dirty_low (percent of the cache; the global values
 *       unless set per export), limits (LIMITS, below)
 *     LIMITS: the export's QoS limits in force (a split export's windows
 *       show their export's): {iops_limit, bytes_limit (bytes/s),
 *       client_iops_limit, client_bytes_limit (bytes/s), iops_burst,
 *       bytes_burst, client_iops_burst, client_bytes_burst}; a limit of 0
 *       is none, a burst is the most a bucket holds (the limit when not
 *       set: one second's worth)
 *     Exports over one backend share its cache export: their "stats" are
 *     the backend's, the same for each.
 *     Only exports a client can connect to are listed; status counts the
 *     ones a reload removed that are still finishing (removed_backends).
 *
 *   stats [export: NAME]
 *     time_ms (monotonic clock, for rates),
 *     cache: {cache_bytes, used_bytes, entries, dirty_bytes, hits, misses,
 *             partial_hits, hit_ratio (double, 0..1; 0 when no reads),
 *             backend_reads, backend_read_bytes, backend_writes,
 *             backend_write_bytes, writeback_bytes, writeback_rate (bytes/s
 *             over the last whole second), evictions, writeback_errors,
 *             bypass_reads, direct_writes, writes_in_place (WRITEs
 *             received from the socket straight into the cache),
 *             writes_swapped (of those, WRITEs received into fresh
 *             arena frames that then replaced the entry's, no copy),
 *             throttled_writes (WRITEs that waited at --dirty-high for
 *             writeback), metadata_bytes (the index: entries, side
 *             records, range nodes and arrays, hash buckets, ghost
 *             table), arena_metadata_bytes (the arena allocator's
 *             tables: a record per 2 MiB chunk, and per-frame tables for
 *             the chunks split into smaller blocks),
 *             arena: {kind (string), free_bytes, free_bytes_by_order (array
 *                     of 10: free bytes in free blocks of order 0..9, a
 *                     block of order k being 4 KiB << k),
 *                     fragmentation (double, 0..1: 1 - free bytes in free
 *                     order-9 (2 MiB) blocks / free bytes; 0 when nothing
 *                     is free), large_bytes (cached in 2 MiB entries),
 *                     large_share (double, 0..1: large_bytes / bytes in
 *                     entries), alloc_2m_attempts, alloc_2m_ok (entries
 *                     that asked for 2 MiB, and got it), compact_moves,
 *                     compact_skipped_pinned, compact_collapses,
 *                     entry_splits (entries split in two so that a WRITE
 *                     over dirty blocks covers whole entries),
 *                     compact_chunks_freed, compact_passes, compact_ns}}
 *     clients: {connections (NBD connections open, all exports, negotiating
 *             ones too), max_clients (--max-clients; 0: unlimited), refused
 *             (connections closed at once for being over it),
 *             refused_per_client (closed at accept by
 *             --max-connections-per-client), refused_access (closed at
 *             accept by the global access rules), reply_bytes
 *             (requests in service and replies not yet sent, 3 KiB more
 *             for each reference to data, all connections: what
 *             --max-reply-memory bounds), max_reply_bytes,
 *             pinned_reply_bytes (cache memory that unsent READ replies
 *             hold pinned), max_pinned_reply_bytes (--max-pinned-replies),
 *             copied_replies, copied_reply_bytes (READ replies, their
 *             data without their holes, copied out of the cache because
 *             the pinned ones were at the limit),
 *             budget_waits (times a connection stopped reading to wait for
 *             reply memory)}
 *     exports: array of {name, connections, hits, misses, partial_hits,
 *             hit_ratio (double), dirty_bytes, backend_reads,
 *             backend_read_bytes, backend_writes, backend_write_bytes,
 *             writeback_bytes, writeback_rate, evictions, writeback_errors,
 *             cached_bytes (arena bytes its cache entries hold),
 *             throttled_requests (requests its QoS limits held back),
 *             throttled_ns (the time they waited, summed: a request
 *             counts when it starts waiting, its time when it stops),
 *             qos_clients (client buckets kept: clients connected since
 *             a limit was set, and those gone whose buckets are not full
 *             again yet), qos_idle_clients (of them, the gone ones: at
 *             most 4096); an export and its split windows count
 *             together}
 *             (only the named export when "export" is given)
 *     Durability (cache and each export): unstable_bytes (written back,
 *     no backend flush since: not evictable yet; an upper bound, counted
 *     in blocks written), backend_flushes, backend_flush_errors, losses
 *     (times the backend may have lost writes it acknowledged, so what the
 *     cache held of them was written again). nbdcached(8), DURABILITY.
 *     Requests (cache and each export): commands: {read, write, flush,
 *     trim, write_zeroes, cache, block_status (client requests of each
 *     command started, refused ones not counted), fua (those of them with
 *     NBD_CMD_FLAG_FUA)}.
 *     backend_writes and backend_write_bytes count what was sent to the
 *     backend, failed writes included (writeback_errors counts those);
 *     writeback_bytes counts what the writeback thread wrote successfully.
 *     A READ counts once: a hit when every block came from the cache, a
 *     miss when none did, a partial hit otherwise.
 *     Latency (each export): latency: {read_hit, read_miss, write, flush,
 *     backend}, each {count, sum_ns, p50_ns, p99_ns, p999_ns}: client
 *     READs that needed no backend read, READs that did (partial hits
 *     too), WRITEs and FLUSHes, from the request's header read to its
 *     reply queued; backend: the cache's requests to the backend (fills,
 *     writeback, flushes, direct operations), sent to completed. The
 *     quantiles are the upper bound of a histogram bucket (8 per power of
 *     two): never below the true value, at most 12.5% above; 0 when count
 *     is 0. The same histograms as nbdcached(8)'s /metrics.
 *
 *   flush export: NAME
 *     Writes back every block of the export that is dirty when the request
 *     arrives, then flushes the backend; the reply comes when that is done:
 *     export, flushed_bytes (dirty bytes when it started), time_ms.
 *     Fails with "EIO" when the backend refuses (the data stays dirty).
 *     Runs as a FLUSH round (nbdcached(8), DURABILITY): with unstable data
 *     it makes that durable too.
 *     Progress: poll "stats" for the export's dirty_bytes on a second
 *     connection meanwhile.
 *
 *   drop-clean export: NAME
 *     Evicts the export's clean, unpinned entries; dirty and in-use ones stay.
 *     export, dropped_bytes, kept_bytes (cached bytes still held)
 *
 *   compact
 *     One on-demand compaction pass over the arena (blocks the control
 *     socket while it runs, never the I/O path): moved, skipped_pinned,
 *     collapsed, freed_2m_chunks, time_ns, fragmentation_before,
 *     fragmentation_after (double, as in stats)
 *
 *   set-mode export: NAME, mode: MODE
 *     Changes the export's cache mode live. Leaving writeback writes the
 *     export's dirty data back first (the reply waits for it; on failure
 *     the mode is unchanged and the reply is "EIO"). Switching to or from
 *     "none" (which bypasses the cache) is refused with "ENOTSUP": set it
 *     in the config and restart. export, mode, previous
 *
 *   reload
 *     Re-reads the config file, as SIGHUP does: added, changed, removed,
 *     refused and resized (arrays of export names; resized: their backend
 *     had a new size), refused_settings (array of strings, one per global
 *     setting that needs a restart to change)
 *
 *   resize export: NAME [, size: SIZE]
 *     Gives the export the size its backend has now, or SIZE bytes (a
 *     number, or a string with a suffix K, M, G or T; a multiple of the
 *     export's block size): export, old_size, new_size. New connections
 *     see the new size, a split export's windows follow; open connections
 *     keep theirs. "EBUSY": a shrink over dirty, unstable or in-use data
 *     (the message says how many dirty bytes are past the new end; flush,
 *     then resize again), or a window made by hand it would cut; "EINVAL":
 *     a window, or a size that is not a multiple of the block size;
 *     "ENOENT": no such export; "ENOTSUP": an NBD backend.
 *
 *   upgrade [binary: PATH] [, timeout: SECONDS]
 *     Starts a new daemon (PATH, by default the binary this one was started
 *     from) and hands it every listener and every connection in
 *     transmission (nbdcached(8), LIVE UPGRADE). Answered once it serves:
 *     pid (the new daemon's), moved (connections it serves), closed (by
 *     this daemon: negotiating, TLS, not parked in time; and by the new
 *     one), refused (of those closed, by the new daemon: their export is
 *     another object in its configuration, or its access rules refuse
 *     the client) and refused_why (string: "conn ID: REASON; ...", the
 *     first ones; null when none), pause_ms (from parking the
 *     connections to the hand-over); this daemon then exits.
 *     "EAGAIN": it failed, and this daemon serves on (the message says
 *     why: the new daemon's error, its exit status, or the step it did
 *     not take within timeout seconds, default 30); "ENOTSUP": an
 *     nbdkit: or writable rbd: export; "EBUSY": one is in progress.
 *
 *   connections
 *     connections: array of CONNECTION objects, one per NBD connection
 *     (negotiating ones too), oldest first:
 *       id (the number of the log's "conn N" lines), transport (string:
 *       "tcp" or "unix"), peer (string: "ADDRESS:PORT", "[V6]:PORT" or
 *       "unix uid UID pid PID"), address (string, numeric; IPv4-mapped
 *       IPv6 addresses shown as IPv4) and port (TCP; null for Unix), uid
 *       and pid (Unix, from SO_PEERCRED; null for TCP or when unknown),
 *       phase (string: "negotiating" or "transmitting"), export (string,
 *       or null while negotiating), bytes_read, bytes_written (data of the
 *       READs and WRITEs answered), requests (answered), payload_copied
 *       (WRITE payload bytes taken from the input buffer, not read from
 *       the socket straight into where they go), inflight
 *       (requests without a reply yet), age_s and age_ms (since accept),
 *       worker (the worker thread's index), disconnecting (bool: a
 *       disconnect was asked for), upgrades (times it was handed over
 *       to a new daemon by a live upgrade; its counters and age go on),
 *       tls (bool: its TLS handshake is done), tls_version (string, e.g.
 *       "TLS1.3"), tls_cipher (string: the cipher suite), tls_peer
 *       (string: the client certificate's DN or the PSK username, as
 *       allow-identities matches it; null when the client gave none)
 *       (the three null without TLS)
 *     A snapshot: each connection's counters are read at one moment, but
 *     not all connections at the same one.
 *
 *   disconnect id: ID
 *     Closes connection ID (an integer from "connections"): the daemon
 *     reads no more of its requests, sends the replies to those in
 *     flight, then closes it; a connection still negotiating is closed at
 *     once. Its log line says "disconnected by the control socket". The
 *     reply (id) comes once the close is asked for, not when it is done.
 *     "ENOENT": no connection has that id; "EINVAL": id missing or not a
 *     positive integer.
 *
 *   limit export: NAME, limits: {KEY: VALUE, ...}
 *     Sets the export's QoS limits live (a split window's name sets its
 *     export's). KEY: "iops-limit", "bytes-limit", "client-iops-limit",
 *     "client-bytes-limit" or one of them with "-burst" for "-limit";
 *     VALUE: a string (a number with an optional K, M, G or T suffix,
 *     binary; "0" or "off": none) or a non-negative integer. Keys not
 *     given keep their value; {} changes nothing. Every pair is checked
 *     before any applies. The limits last until the next reload, which
 *     sets the configuration's. export, limits (LIMITS, as in exports).
 *     "ENOENT": no such export; "EINVAL": a key unknown or a value bad
 *     (the error names them).
 */
#ifndef NBDCACHED_CONTROL_H
#define NBDCACHED_CONTROL_H

#define NBDCACHED_CONTROL_DEFAULT "/run/nbdcached/control.sock"
#define NBDCACHED_CONTROL_MAX_REQUEST 65536
#define NBDCACHED_ARENA_ORDERS 10

#endif
