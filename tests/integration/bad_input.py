#!/usr/bin/python3
"""bad_input: a hostile raw-socket client against the real daemon.

Two tables drive the test: HANDSHAKE_ROWS (option haggling) and
TRANSMISSION_ROWS (compact, structured and extended-header sessions). Each
row names what is sent and what must come back: a specific option reply
type, a specific NBD error in a simple/structured/extended reply, or a
disconnect. The bad client speaks the protocol by hand (socket + struct);
no libnbd on that side, so nothing is "fixed up" before it reaches the
server.

A second, well-behaved client (libnbd, opened before the first row) reads
the whole "data" export back after every row and compares it with a model of
what the successful rows wrote: a bad request must neither kill the daemon,
nor disturb other connections, nor change data. After every row the daemon
must still be running and its RSS must stay bounded (a client must not make
the daemon allocate in proportion to a length it sends).

Two more checks follow the tables: 200 connections parked mid-handshake,
and a client that pipelines 2000 1 MiB READs and never reads a reply; in
both the live client must still be served and the RSS stay bounded.

RawClient in the first half of this file is importable by other tests
(huge_export.py uses it for extended-header requests libnbd 1.14 cannot
send).

Nothing here is timed: a close the daemon owes a bad request comes at
once, and is waited for 30 s (wait_closed) only so that a daemon that
never closes fails instead of hanging; the daemon's RSS is its own.
"""

import collections
import os
import random
import re
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

# ---- Wire constants (proto/nbd.h). ----
NBD_MAGIC = 0x4E42444D41474943
NBD_OPTS_MAGIC = 0x49484156454F5054
NBD_REP_MAGIC = 0x0003E889045565A9
NBD_REQUEST_MAGIC = 0x25609513
NBD_EXTENDED_REQUEST_MAGIC = 0x21E41C71
NBD_SIMPLE_REPLY_MAGIC = 0x67446698
NBD_STRUCTURED_REPLY_MAGIC = 0x668E33EF
NBD_EXTENDED_REPLY_MAGIC = 0x6E8A278C

NBD_FLAG_FIXED_NEWSTYLE = 1 << 0
NBD_FLAG_NO_ZEROES = 1 << 1
NBD_FLAG_C_FIXED_NEWSTYLE = 1 << 0
NBD_FLAG_C_NO_ZEROES = 1 << 1

OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_STARTTLS = 5
OPT_INFO = 6
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8
OPT_LIST_META_CONTEXT = 9
OPT_SET_META_CONTEXT = 10
OPT_EXTENDED_HEADERS = 11

REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_META_CONTEXT = 4
REP_FLAG_ERROR = 1 << 31
REP_ERR_UNSUP = REP_FLAG_ERROR + 1
REP_ERR_POLICY = REP_FLAG_ERROR + 2
REP_ERR_INVALID = REP_FLAG_ERROR + 3
REP_ERR_PLATFORM = REP_FLAG_ERROR + 4
REP_ERR_TLS_REQD = REP_FLAG_ERROR + 5
REP_ERR_UNKNOWN = REP_FLAG_ERROR + 6
REP_ERR_SHUTDOWN = REP_FLAG_ERROR + 7
REP_ERR_BLOCK_SIZE_REQD = REP_FLAG_ERROR + 8
REP_ERR_TOO_BIG = REP_FLAG_ERROR + 9
REP_ERR_EXT_HEADER_REQD = REP_FLAG_ERROR + 10

INFO_EXPORT = 0
INFO_NAME = 1
INFO_DESCRIPTION = 2
INFO_BLOCK_SIZE = 3

FLAG_HAS_FLAGS = 1 << 0
FLAG_READ_ONLY = 1 << 1
FLAG_SEND_FLUSH = 1 << 2
FLAG_SEND_FUA = 1 << 3
FLAG_ROTATIONAL = 1 << 4
FLAG_SEND_TRIM = 1 << 5
FLAG_SEND_WRITE_ZEROES = 1 << 6
FLAG_SEND_DF = 1 << 7
FLAG_CAN_MULTI_CONN = 1 << 8
FLAG_SEND_RESIZE = 1 << 9
FLAG_SEND_CACHE = 1 << 10
FLAG_SEND_FAST_ZERO = 1 << 11
FLAG_BLOCK_STATUS_PAYLOAD = 1 << 12

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6
CMD_BLOCK_STATUS = 7

CF_FUA = 1 << 0
CF_NO_HOLE = 1 << 1
CF_DF = 1 << 2
CF_REQ_ONE = 1 << 3
CF_FAST_ZERO = 1 << 4
CF_PAYLOAD_LEN = 1 << 5

REPLY_FLAG_DONE = 1
RT_NONE = 0
RT_OFFSET_DATA = 1
RT_OFFSET_HOLE = 2
RT_BLOCK_STATUS = 5
RT_BLOCK_STATUS_EXT = 6
RT_ERROR = (1 << 15) + 1
RT_ERROR_OFFSET = (1 << 15) + 2

EPERM = 1
EIO = 5
ENOMEM = 12
EINVAL = 22
ENOSPC = 28
EOVERFLOW = 75
ENOTSUP = 95
ESHUTDOWN = 108
ERR_NAMES = {0: "OK", EPERM: "EPERM", EIO: "EIO", ENOMEM: "ENOMEM", EINVAL: "EINVAL",
             ENOSPC: "ENOSPC", EOVERFLOW: "EOVERFLOW", ENOTSUP: "ENOTSUP",
             ESHUTDOWN: "ESHUTDOWN"}

STATE_HOLE = 1
STATE_ZERO = 2

MAX_PAYLOAD = 32 << 20
MAX_OPTION = 64 << 10
DEFAULT_PREFERRED = 4096
U64 = (1 << 64) - 1

REP_NAMES = {REP_ACK: "ACK", REP_SERVER: "SERVER", REP_INFO: "INFO",
             REP_META_CONTEXT: "META_CONTEXT", REP_ERR_UNSUP: "ERR_UNSUP",
             REP_ERR_POLICY: "ERR_POLICY", REP_ERR_INVALID: "ERR_INVALID",
             REP_ERR_PLATFORM: "ERR_PLATFORM", REP_ERR_TLS_REQD: "ERR_TLS_REQD",
             REP_ERR_UNKNOWN: "ERR_UNKNOWN", REP_ERR_SHUTDOWN: "ERR_SHUTDOWN",
             REP_ERR_BLOCK_SIZE_REQD: "ERR_BLOCK_SIZE_REQD",
             REP_ERR_TOO_BIG: "ERR_TOO_BIG",
             REP_ERR_EXT_HEADER_REQD: "ERR_EXT_HEADER_REQD"}


def rep_name(t):
    return REP_NAMES.get(t, "0x%x" % t)


def err_name(e):
    return ERR_NAMES.get(e, str(e))


class Mismatch(Exception):
    """A row's expectation was not met (the daemon misbehaved)."""


class Closed(Exception):
    """The peer closed the connection (EOF or reset)."""


def expect(cond, msg):
    if not cond:
        raise Mismatch(msg)


# ---- Payload builders. ----

def go_payload(name, infos=()):
    n = name.encode() if isinstance(name, str) else name
    return (struct.pack(">I", len(n)) + n + struct.pack(">H", len(infos)) +
            b"".join(struct.pack(">H", i) for i in infos))


def meta_payload(name, queries):
    n = name.encode()
    out = struct.pack(">I", len(n)) + n + struct.pack(">I", len(queries))
    for q in queries:
        qb = q.encode()
        out += struct.pack(">I", len(qb)) + qb
    return out


def parse_infos(items):
    """NBD_REP_INFO replies -> dict; each info type at most once."""
    info = {}
    for typ, p in items:
        expect(typ == REP_INFO, "unexpected non-final reply %s to INFO/GO" % rep_name(typ))
        expect(len(p) >= 2, "NBD_REP_INFO payload of %d bytes" % len(p))
        t = struct.unpack(">H", p[:2])[0]
        expect(t not in info, "info type %d sent twice" % t)
        if t == INFO_EXPORT:
            expect(len(p) == 12, "NBD_INFO_EXPORT of %d bytes" % len(p))
            info[t] = struct.unpack(">QH", p[2:])
        elif t == INFO_BLOCK_SIZE:
            expect(len(p) == 14, "NBD_INFO_BLOCK_SIZE of %d bytes" % len(p))
            info[t] = struct.unpack(">III", p[2:])
        elif t in (INFO_NAME, INFO_DESCRIPTION):
            info[t] = p[2:].decode("utf-8", "replace")
        else:
            info[t] = p[2:]
    return info


def parse_server_reply(p):
    expect(len(p) >= 4, "NBD_REP_SERVER payload of %d bytes" % len(p))
    n = struct.unpack(">I", p[:4])[0]
    expect(4 + n <= len(p), "NBD_REP_SERVER name length %d overruns %d" % (n, len(p)))
    return p[4:4 + n].decode(), p[4 + n:].decode()


def parse_meta_reply(p):
    expect(len(p) >= 4, "NBD_REP_META_CONTEXT payload of %d bytes" % len(p))
    return struct.unpack(">I", p[:4])[0], p[4:].decode()


def expected_eflags(readonly, structured):
    """The transmission flags the contract promises, exactly."""
    f = (FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_CAN_MULTI_CONN |
         FLAG_SEND_CACHE)
    if readonly:
        f |= FLAG_READ_ONLY
    else:
        f |= FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO
    if structured:
        f |= FLAG_SEND_DF
    return f


def check_eflags(eflags, readonly, structured):
    want = expected_eflags(readonly, structured)
    got = eflags & ~FLAG_ROTATIONAL
    expect(got == want, "transmission flags 0x%04x, expected 0x%04x (readonly=%s structured=%s)"
           % (eflags, want, readonly, structured))


# ---- The raw client. ----

Reply = collections.namedtuple("Reply", "cookie error kind chunks data holes extents ctx")


class RawClient:
    """One hand-driven NBD connection (Unix or TCP)."""

    def __init__(self, sock_path=None, port=None, timeout=10, sock=None):
        if sock is not None:
            self.s = sock  # connected already (from a chosen address, say)
        elif sock_path:
            self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.s.settimeout(timeout)
            self.s.connect(sock_path)
        else:
            self.s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.timeout = timeout
        self.structured = False
        self.extended = False
        self.meta_ctx = None
        self.size = None
        self.eflags = None
        self.pending = {}
        self.next_cookie = 0x1000

    def close(self):
        try:
            self.s.close()
        except OSError:
            pass

    def send(self, b):
        try:
            self.s.sendall(b)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise Closed("send: %s" % e)

    def recv_exact(self, n):
        buf = bytearray()
        while len(buf) < n:
            try:
                c = self.s.recv(min(n - len(buf), 1 << 20))
            except ConnectionResetError:
                raise Closed("reset after %d of %d bytes" % (len(buf), n))
            except socket.timeout:
                raise Mismatch("timed out after %ds waiting for %d bytes (got %d)"
                               % (self.timeout, n, len(buf)))
            if not c:
                raise Closed("EOF after %d of %d bytes" % (len(buf), n))
            buf += c
        return bytes(buf)

    def wait_closed(self, timeout=30):
        """Wait for the server to close; return what it sent before closing.
        (A bound on a wait, not a time asserted: a close that comes at once
        is waited for up to `timeout` s, which a busy machine never needs.)"""
        self.s.settimeout(timeout)
        got = b""
        deadline = time.time() + timeout
        while time.time() < deadline and len(got) < (1 << 20):
            try:
                c = self.s.recv(65536)
            except ConnectionResetError:
                return got
            except socket.timeout:
                break
            if not c:
                return got
            got += c
        raise Mismatch("server did not close the connection within %ds (sent %d bytes: %r)"
                       % (timeout, len(got), got[:64]))

    def expect_silence(self, wait=0.3):
        """Nothing may arrive (and no close) while the server waits for more input."""
        self.s.settimeout(wait)
        try:
            c = self.s.recv(4096)
        except socket.timeout:
            c = None
        except ConnectionResetError:
            c = b""
        finally:
            self.s.settimeout(self.timeout)
        if c is not None:
            raise Mismatch("server %s while waiting for the rest of the input"
                           % ("closed the connection" if c == b"" else "sent %r" % c[:32]))

    # -- handshake --

    def greeting(self, cflags=NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES):
        g = self.recv_exact(18)
        magic, opts, gflags = struct.unpack(">QQH", g)
        expect(magic == NBD_MAGIC, "greeting magic 0x%x" % magic)
        expect(opts == NBD_OPTS_MAGIC, "not newstyle: 0x%x" % opts)
        expect(gflags & NBD_FLAG_FIXED_NEWSTYLE, "server lacks FIXED_NEWSTYLE (0x%x)" % gflags)
        expect(gflags & NBD_FLAG_NO_ZEROES, "server lacks NO_ZEROES (0x%x)" % gflags)
        if cflags is not None:
            self.send(struct.pack(">I", cflags))
        self.no_zeroes = bool(cflags and cflags & NBD_FLAG_C_NO_ZEROES)
        return gflags

    def send_opt(self, opt, data=b"", length=None):
        self.send(struct.pack(">QII", NBD_OPTS_MAGIC, opt,
                              len(data) if length is None else length) + data)

    def read_opt_reply(self):
        magic, opt, typ, length = struct.unpack(">QIII", self.recv_exact(20))
        expect(magic == NBD_REP_MAGIC, "option reply magic 0x%x" % magic)
        expect(length <= (1 << 20), "option reply of %d bytes" % length)
        return opt, typ, self.recv_exact(length)

    def opt_replies(self, opt):
        """Replies to one option up to the final one: (final type, [non-final], final payload)."""
        items = []
        for _ in range(10000):
            o, typ, p = self.read_opt_reply()
            expect(o == opt, "reply for option %d while waiting for %d" % (o, opt))
            if typ == REP_ACK or typ & REP_FLAG_ERROR:
                return typ, items, p
            items.append((typ, p))
        raise Mismatch("more than 10000 replies to option %d" % opt)

    def option(self, opt, data=b"", want=REP_ACK):
        self.send_opt(opt, data)
        typ, items, p = self.opt_replies(opt)
        expect(typ == want, "option %d: reply %s, expected %s" % (opt, rep_name(typ), rep_name(want)))
        if typ & REP_FLAG_ERROR:
            expect(not items, "option %d: non-final replies before an error" % opt)
        return items

    def set_meta(self, name, queries):
        items = self.option(OPT_SET_META_CONTEXT, meta_payload(name, queries))
        ctx = {}
        for typ, p in items:
            expect(typ == REP_META_CONTEXT, "SET_META_CONTEXT sent %s" % rep_name(typ))
            cid, cname = parse_meta_reply(p)
            ctx[cname] = cid
        return ctx

    def go(self, name, infos=(INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE)):
        items = self.option(OPT_GO, go_payload(name, infos))
        info = parse_infos(items)
        expect(INFO_EXPORT in info, "GO succeeded without NBD_INFO_EXPORT")
        self.size, self.eflags = info[INFO_EXPORT]
        return info

    def open(self, export, structured=False, extended=False, meta=None):
        """Greeting, flags, optional structured/extended/meta, GO."""
        self.greeting()
        if structured:
            self.option(OPT_STRUCTURED_REPLY)
            self.structured = True
        if extended:
            self.option(OPT_EXTENDED_HEADERS)
            self.structured = self.extended = True
        if meta is not None:
            ctx = self.set_meta(export, meta)
            self.meta_ctx = ctx.get("base:allocation")
        return self.go(export)

    # -- transmission --

    def encode_request(self, typ, offset, length, flags=0):
        cookie = self.next_cookie
        self.next_cookie += 1
        if self.extended:
            hdr = struct.pack(">IHHQQQ", NBD_EXTENDED_REQUEST_MAGIC, flags, typ, cookie,
                              offset & U64, length & U64)
        else:
            hdr = struct.pack(">IHHQQI", NBD_REQUEST_MAGIC, flags, typ, cookie,
                              offset & U64, length & 0xFFFFFFFF)
        return cookie, hdr

    def request(self, typ, offset, length, flags=0, payload=b""):
        cookie, hdr = self.encode_request(typ, offset, length, flags)
        self.pending[cookie] = (typ, offset, length)
        self.send(hdr + payload)
        return cookie

    def read_reply(self, cookie):
        """Read reply messages until the one for `cookie` is complete."""
        acc = {}
        for _ in range(100000):
            (magic,) = struct.unpack(">I", self.recv_exact(4))
            if magic == NBD_SIMPLE_REPLY_MAGIC:
                error, ck = struct.unpack(">IQ", self.recv_exact(12))
                expect(not self.extended, "simple reply in an extended-header session")
                expect(ck in self.pending, "simple reply for unknown cookie 0x%x" % ck)
                expect(ck not in acc, "simple reply after chunks for cookie 0x%x" % ck)
                rtyp, roff, rlen = self.pending[ck]
                data = b""
                if rtyp == CMD_READ:
                    expect(not self.structured,
                           "simple reply to READ although structured replies were negotiated")
                    if error == 0:
                        data = self.recv_exact(rlen)
                del self.pending[ck]
                if ck == cookie:
                    return Reply(ck, error, "simple", [], data, [], [], None)
                continue
            if magic == NBD_STRUCTURED_REPLY_MAGIC:
                expect(self.structured and not self.extended,
                       "structured reply chunk in a %s session"
                       % ("extended" if self.extended else "simple"))
                flags, ctype, ck, plen = struct.unpack(">HHQI", self.recv_exact(16))
                roff_echo = None
            elif magic == NBD_EXTENDED_REPLY_MAGIC:
                expect(self.extended, "extended reply chunk without extended headers")
                flags, ctype, ck, roff_echo, plen = struct.unpack(">HHQQQ", self.recv_exact(28))
                expect(plen <= MAX_PAYLOAD + 4096, "extended reply payload of %d bytes" % plen)
            else:
                raise Mismatch("bad reply magic 0x%08x" % magic)
            expect(ck in self.pending, "chunk for unknown cookie 0x%x" % ck)
            payload = self.recv_exact(plen)
            if roff_echo is not None:
                expect(roff_echo == self.pending[ck][1] & U64,
                       "extended reply offset %d, request offset %d"
                       % (roff_echo, self.pending[ck][1]))
            acc.setdefault(ck, []).append((flags, ctype, payload))
            if flags & REPLY_FLAG_DONE:
                chunks = acc.pop(ck)
                req = self.pending.pop(ck)
                if ck == cookie:
                    return self._assemble(ck, req, chunks)
        raise Mismatch("no complete reply for cookie 0x%x" % cookie)

    def _assemble(self, ck, req, chunks):
        typ, offset, length = req
        error = 0
        data = bytearray(length if typ == CMD_READ and length <= MAX_PAYLOAD else 0)
        covered = []
        holes = []
        extents = []
        ctx = None
        for i, (flags, ctype, p) in enumerate(chunks):
            last = i == len(chunks) - 1
            expect(bool(flags & REPLY_FLAG_DONE) == last, "DONE flag on a non-final chunk")
            if ctype == RT_NONE:
                expect(len(p) == 0 and last, "NBD_REPLY_TYPE_NONE with payload or not final")
            elif ctype in (RT_ERROR, RT_ERROR_OFFSET):
                expect(len(p) >= 6, "error chunk of %d bytes" % len(p))
                e, mlen = struct.unpack(">IH", p[:6])
                extra = 8 if ctype == RT_ERROR_OFFSET else 0
                expect(len(p) == 6 + mlen + extra, "error chunk length %d, message %d" % (len(p), mlen))
                expect(e != 0, "error chunk with error 0")
                if not error:
                    error = e
            elif ctype == RT_OFFSET_DATA:
                expect(typ == CMD_READ, "OFFSET_DATA in reply to command %d" % typ)
                expect(len(p) > 8, "OFFSET_DATA without data")
                (o,) = struct.unpack(">Q", p[:8])
                n = len(p) - 8
                expect(offset <= o and o + n <= offset + length,
                       "OFFSET_DATA [%d,+%d) outside request [%d,+%d)" % (o, n, offset, length))
                data[o - offset:o - offset + n] = p[8:]
                covered.append((o, n))
            elif ctype == RT_OFFSET_HOLE:
                expect(typ == CMD_READ, "OFFSET_HOLE in reply to command %d" % typ)
                expect(len(p) == 12, "OFFSET_HOLE payload of %d bytes" % len(p))
                o, n = struct.unpack(">QI", p)
                expect(n > 0, "zero-length hole")
                expect(offset <= o and o + n <= offset + length,
                       "OFFSET_HOLE [%d,+%d) outside request [%d,+%d)" % (o, n, offset, length))
                data[o - offset:o - offset + n] = bytes(n)
                covered.append((o, n))
                holes.append((o, n))
            elif ctype == RT_BLOCK_STATUS:
                expect(typ == CMD_BLOCK_STATUS, "BLOCK_STATUS chunk for command %d" % typ)
                expect(not self.extended, "32-bit BLOCK_STATUS chunk with extended headers")
                expect(len(p) >= 12 and (len(p) - 4) % 8 == 0, "BLOCK_STATUS of %d bytes" % len(p))
                ctx = struct.unpack(">I", p[:4])[0]
                for j in range(4, len(p), 8):
                    extents.append(struct.unpack(">II", p[j:j + 8]))
            elif ctype == RT_BLOCK_STATUS_EXT:
                expect(typ == CMD_BLOCK_STATUS, "BLOCK_STATUS_EXT chunk for command %d" % typ)
                expect(self.extended, "BLOCK_STATUS_EXT chunk without extended headers")
                expect(len(p) >= 24 and (len(p) - 8) % 16 == 0, "BLOCK_STATUS_EXT of %d bytes" % len(p))
                ctx, count = struct.unpack(">II", p[:8])
                expect(count == (len(p) - 8) // 16, "BLOCK_STATUS_EXT count %d for %d bytes"
                       % (count, len(p)))
                for j in range(8, len(p), 16):
                    extents.append(struct.unpack(">QQ", p[j:j + 16]))
            else:
                raise Mismatch("unexpected chunk type %d" % ctype)
        if typ == CMD_READ and not error:
            covered.sort()
            pos = offset
            for o, n in covered:
                expect(o == pos, "read reply chunks overlap or leave a gap at %d" % pos)
                pos = o + n
            expect(pos == offset + length, "read reply covers up to %d of %d" % (pos, offset + length))
        kind = "extended" if self.extended else "structured"
        return Reply(ck, error, kind, chunks, bytes(data), holes, extents, ctx)

    def command(self, typ, offset, length, flags=0, payload=b""):
        return self.read_reply(self.request(typ, offset, length, flags, payload))

    def disconnect(self):
        cookie, hdr = self.encode_request(CMD_DISC, 0, 0)
        self.send(hdr)
        extra = self.wait_closed()
        expect(extra == b"", "server replied %r to NBD_CMD_DISC" % extra[:32])


def check_extents(extents, offset, length, truth, req_one=False, must_reach=None):
    """Extents (length, flags) from `offset` must agree with `truth`, a list of
    (start, end, flags) covering the export; REQ_ONE allows only one extent."""
    expect(extents, "no extents")
    if req_one:
        expect(len(extents) == 1, "REQ_ONE but %d extents" % len(extents))
    pos = offset
    for n, f in extents:
        expect(n > 0, "zero-length extent")
        for s, e, tf in truth:
            if s < pos + n and e > pos:
                expect(f == tf, "extent [%d,+%d) has flags %d, but the file has flags %d in [%d,%d)"
                       % (pos, n, f, tf, s, e))
        pos += n
    if req_one:
        expect(pos <= offset + length, "REQ_ONE extent runs to %d, past the request end %d"
               % (pos, offset + length))
    else:
        # Only the final extent may run past the request (spec), never past the export.
        expect(pos - extents[-1][0] < offset + length,
               "extents before the last already cover the request")
        expect(pos <= truth[-1][1], "extents run to %d, past the export end %d" % (pos, truth[-1][1]))
    if must_reach is not None:
        expect(pos >= must_reach, "extents stop at %d, expected at least %d" % (pos, must_reach))


# ---------------------------------------------------------------------------
# The test proper.

KIB = 1024
MIB = 1024 * KIB
SIZE = 1 * MIB                       # every export here is 1 MiB
HOLE = (512 * KIB, 768 * KIB)        # the hole in the "ro" export
RO_TRUTH = [(0, HOLE[0], 0), (HOLE[0], HOLE[1], STATE_HOLE | STATE_ZERO), (HOLE[1], SIZE, 0)]
BS64K = 65536

EXPORTS = {
    # name: (readonly, description, block-size)
    "data": (False, "pattern disk", None),
    "ro": (True, "read only sparse", None),
    "bs64k": (False, "sixty four k", BS64K),
    "nodesc": (False, "", None),
}


class World:
    """Daemon, backend contents, model of "data" and the live client."""

    def __init__(self, d, files):
        self.d = d
        self.files = files
        self.content = {n: open(p, "rb").read() for n, p in files.items()}
        self.model = bytearray(self.content["data"])
        self.undefined = []             # (offset, length) of trimmed ranges
        self.sessions = collections.Counter()   # (structured, extended, meta) per GO
        self.live = None
        self.rss_base = None
        self.max_rss = 0

    def expected(self, export, offset, length):
        if export == "data":
            return bytes(self.model[offset:offset + length])
        return self.content[export][offset:offset + length]

    def apply(self, effect):
        if not effect:
            return
        kind, off, val = effect
        if kind == "write":
            self.model[off:off + len(val)] = val
            end = off + len(val)
            left = []
            for u, n in self.undefined:         # subtract [off, end)
                if u < off:
                    left.append((u, min(u + n, off) - u))
                if u + n > end:
                    left.append((max(u, end), u + n - max(u, end)))
            self.undefined = left
        elif kind == "undefined":
            self.undefined.append((off, val))

    def rss(self):
        return self.d.rss()

    def model_as_read(self, got):
        """The model of "data", its trimmed (undefined) ranges as in `got`."""
        want = bytearray(self.model)
        for off, n in self.undefined:
            want[off:off + n] = got[off:off + n]
        return want

    def live_check(self, what):
        nbdtest.check(self.d.alive(), "daemon died after %s" % what)
        try:
            got = self.live.pread(SIZE, 0)
        except Exception as e:  # nbd.Error, or a dead connection
            nbdtest.fail("live libnbd client broken after %s: %s" % (what, e))
        want = self.model_as_read(got)
        if got != bytes(want):
            first = nbdtest.first_diff(got, want)
            nbdtest.fail("export data changed after %s (first difference at %d)" % (what, first))
        rss = self.rss()
        self.max_rss = max(self.max_rss, rss)
        limit = max(200 * MIB, self.rss_base + 160 * MIB)
        nbdtest.check(rss < limit, "daemon RSS %d MiB after %s (limit %d MiB)"
                      % (rss >> 20, what, limit >> 20))


def continue_check(w, r, export="data"):
    """The connection is still in sync: GO if needed, READ 4 KiB, DISC."""
    if r.size is None:
        r.go(export)
        w.sessions[(r.structured, r.extended, r.meta_ctx is not None)] += 1
        expect(r.size == SIZE, "size %d after recovery" % r.size)
    rep = r.command(CMD_READ, 0, 4096)
    expect(rep.error == 0, "follow-up READ failed with %s" % err_name(rep.error))
    expect(rep.data == w.expected(export, 0, 4096), "follow-up READ returned wrong data")
    r.disconnect()


# ---- Handshake table. ----
#
# steps: ("opt", OPTION, data) sends an option; ("optlen", OPTION, length, data)
# sends a header whose length field lies; ("raw", bytes); ("ack", OPTION)
# negotiates an option that must succeed (STRUCTURED_REPLY/EXTENDED_HEADERS);
# ("flags", N) sends client flags (otherwise FIXED_NEWSTYLE|NO_ZEROES).
# expect: ("reply", OPTION, TYPE[, checker]) then `then` in
#   "continue" (GO + READ + DISC on the same connection), "closed", "none";
# ("closed",): the server closes without sending anything;
# ("silent",): the server must wait for more; the client then closes;
# ("export", export, zeroes): EXPORT_NAME reply then transmission.

H = collections.namedtuple("H", "name steps expect then")


def check_list(w):
    def checker(items):
        got = {}
        for typ, p in items:
            expect(typ == REP_SERVER, "LIST sent %s" % rep_name(typ))
            name, desc = parse_server_reply(p)
            expect(name not in got, "export %r listed twice" % name)
            got[name] = desc
        want = {n: v[1] for n, v in EXPORTS.items()}
        expect(got == want, "LIST returned %r, expected %r" % (got, want))
    return checker


def check_info(w, export, requested_name=None):
    readonly, desc, bs = EXPORTS[export]

    def checker(items):
        info = parse_infos(items)
        expect(INFO_EXPORT in info, "no NBD_INFO_EXPORT")
        size, eflags = info[INFO_EXPORT]
        expect(size == os.path.getsize(w.files[export]), "INFO size %d" % size)
        check_eflags(eflags, readonly, structured=False)
        expect(INFO_BLOCK_SIZE in info, "BLOCK_SIZE requested but not sent")
        want = (1, bs or DEFAULT_PREFERRED, MAX_PAYLOAD)
        expect(info[INFO_BLOCK_SIZE] == want, "BLOCK_SIZE %r, expected %r"
               % (info[INFO_BLOCK_SIZE], want))
        expect(INFO_NAME in info, "NAME requested but not sent")
        names = (export,) if requested_name is None else (requested_name, export)
        expect(info[INFO_NAME] in names, "NAME %r, expected one of %r" % (info[INFO_NAME], names))
        if desc:
            expect(info.get(INFO_DESCRIPTION) == desc,
                   "DESCRIPTION %r, expected %r" % (info.get(INFO_DESCRIPTION), desc))
        else:
            expect(info.get(INFO_DESCRIPTION, "") == "", "DESCRIPTION for an export without one")
    return checker


def check_meta(names):
    def checker(items):
        got = []
        for typ, p in items:
            expect(typ == REP_META_CONTEXT, "META reply %s" % rep_name(typ))
            got.append(parse_meta_reply(p)[1])
        expect(sorted(got) == sorted(names), "meta contexts %r, expected %r" % (got, names))
    return checker


def check_go(export, structured):
    def checker(items):
        info = parse_infos(items)
        size, eflags = info[INFO_EXPORT]
        expect(size == SIZE, "size %d" % size)
        check_eflags(eflags, EXPORTS[export][0], structured)
    return checker


ALL_INFOS = (INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE)


def handshake_rows(w):
    q = meta_payload
    g = go_payload
    return [
        H("EXPORT_NAME data, NO_ZEROES: 10-byte reply",
          [("opt", OPT_EXPORT_NAME, b"data")], ("export", "data", False), "continue"),
        H("EXPORT_NAME data, no NO_ZEROES: 134-byte reply",
          [("flags", NBD_FLAG_C_FIXED_NEWSTYLE), ("opt", OPT_EXPORT_NAME, b"data")],
          ("export", "data", True), "continue"),
        H("EXPORT_NAME \"\" selects the first export",
          [("opt", OPT_EXPORT_NAME, b"")], ("export", "data", False), "continue"),
        H("EXPORT_NAME of an unknown export closes",
          [("opt", OPT_EXPORT_NAME, b"nope")], ("closed",), "none"),
        H("EXPORT_NAME after EXTENDED_HEADERS closes",
          [("ack", OPT_EXTENDED_HEADERS), ("opt", OPT_EXPORT_NAME, b"data")], ("closed",), "none"),
        H("ABORT: ACK then close",
          [("opt", OPT_ABORT, b"")], ("reply", OPT_ABORT, REP_ACK), "closed"),
        H("LIST: every export with its description",
          [("opt", OPT_LIST, b"")], ("reply", OPT_LIST, REP_ACK, check_list(w)), "continue"),
        H("LIST with data: ERR_INVALID",
          [("opt", OPT_LIST, b"x")], ("reply", OPT_LIST, REP_ERR_INVALID), "continue"),
        H("STARTTLS: ERR_POLICY (TLS off)",
          [("opt", OPT_STARTTLS, b"")], ("reply", OPT_STARTTLS, REP_ERR_POLICY), "continue"),
        H("INFO data: size, flags, name, description, block size",
          [("opt", OPT_INFO, g("data", ALL_INFOS))],
          ("reply", OPT_INFO, REP_ACK, check_info(w, "data")), "continue"),
        H("INFO \"\" describes the first export",
          [("opt", OPT_INFO, g("", ALL_INFOS))],
          ("reply", OPT_INFO, REP_ACK, check_info(w, "data", "")), "continue"),
        H("INFO ro: READ_ONLY, no TRIM/WRITE_ZEROES/FAST_ZERO",
          [("opt", OPT_INFO, g("ro", ALL_INFOS))],
          ("reply", OPT_INFO, REP_ACK, check_info(w, "ro")), "continue"),
        H("INFO bs64k: preferred block size from block-size=",
          [("opt", OPT_INFO, g("bs64k", ALL_INFOS))],
          ("reply", OPT_INFO, REP_ACK, check_info(w, "bs64k")), "continue"),
        H("INFO nodesc: no description",
          [("opt", OPT_INFO, g("nodesc", ALL_INFOS))],
          ("reply", OPT_INFO, REP_ACK, check_info(w, "nodesc")), "continue"),
        H("INFO with an unknown info request (ignored)",
          [("opt", OPT_INFO, g("data", (0x7FFF, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE)))],
          ("reply", OPT_INFO, REP_ACK, check_info(w, "data")), "continue"),
        H("INFO unknown export: ERR_UNKNOWN",
          [("opt", OPT_INFO, g("nope"))], ("reply", OPT_INFO, REP_ERR_UNKNOWN), "continue"),
        H("GO unknown export: ERR_UNKNOWN",
          [("opt", OPT_GO, g("nope"))], ("reply", OPT_GO, REP_ERR_UNKNOWN), "continue"),
        H("GO payload shorter than 6 bytes: ERR_INVALID",
          [("opt", OPT_GO, b"\0\0\0")], ("reply", OPT_GO, REP_ERR_INVALID), "continue"),
        H("GO name length past the payload: ERR_INVALID",
          [("opt", OPT_GO, struct.pack(">I", 100) + b"data\0\0")],
          ("reply", OPT_GO, REP_ERR_INVALID), "continue"),
        H("GO info count past the payload: ERR_INVALID",
          [("opt", OPT_GO, struct.pack(">I", 4) + b"data" + struct.pack(">HH", 3, INFO_NAME))],
          ("reply", OPT_GO, REP_ERR_INVALID), "continue"),
        H("GO with trailing garbage: ERR_INVALID",
          [("opt", OPT_GO, g("data", (INFO_NAME,)) + b"\x01")],
          ("reply", OPT_GO, REP_ERR_INVALID), "continue"),
        H("INFO name length past the payload: ERR_INVALID",
          [("opt", OPT_INFO, struct.pack(">I", 0xFFFFFFFF) + b"\0\0")],
          ("reply", OPT_INFO, REP_ERR_INVALID), "continue"),
        H("STRUCTURED_REPLY with data: ERR_INVALID",
          [("opt", OPT_STRUCTURED_REPLY, b"x")],
          ("reply", OPT_STRUCTURED_REPLY, REP_ERR_INVALID), "continue"),
        H("EXTENDED_HEADERS with data: ERR_INVALID",
          [("opt", OPT_EXTENDED_HEADERS, b"xy")],
          ("reply", OPT_EXTENDED_HEADERS, REP_ERR_INVALID), "continue"),
        H("STRUCTURED_REPLY after EXTENDED_HEADERS: ERR_EXT_HEADER_REQD",
          [("ack", OPT_EXTENDED_HEADERS), ("opt", OPT_STRUCTURED_REPLY, b"")],
          ("reply", OPT_STRUCTURED_REPLY, REP_ERR_EXT_HEADER_REQD), "continue"),
        H("LIST_META_CONTEXT before structured replies: ERR_INVALID",
          [("opt", OPT_LIST_META_CONTEXT, q("data", ["base:allocation"]))],
          ("reply", OPT_LIST_META_CONTEXT, REP_ERR_INVALID), "continue"),
        H("SET_META_CONTEXT before structured replies: ERR_INVALID",
          [("opt", OPT_SET_META_CONTEXT, q("data", ["base:allocation"]))],
          ("reply", OPT_SET_META_CONTEXT, REP_ERR_INVALID), "continue"),
        H("LIST_META_CONTEXT base:allocation",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_LIST_META_CONTEXT, q("data", ["base:allocation"]))],
          ("reply", OPT_LIST_META_CONTEXT, REP_ACK, check_meta(["base:allocation"])), "continue"),
        H("LIST_META_CONTEXT with no query lists base:allocation",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_LIST_META_CONTEXT, q("data", []))],
          ("reply", OPT_LIST_META_CONTEXT, REP_ACK, check_meta(["base:allocation"])), "continue"),
        H("LIST_META_CONTEXT base: lists base:allocation",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_LIST_META_CONTEXT, q("data", ["base:"]))],
          ("reply", OPT_LIST_META_CONTEXT, REP_ACK, check_meta(["base:allocation"])), "continue"),
        H("LIST_META_CONTEXT after EXTENDED_HEADERS",
          [("ack", OPT_EXTENDED_HEADERS), ("opt", OPT_LIST_META_CONTEXT, q("data", ["base:allocation"]))],
          ("reply", OPT_LIST_META_CONTEXT, REP_ACK, check_meta(["base:allocation"])), "continue"),
        H("SET_META_CONTEXT base:allocation",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_SET_META_CONTEXT, q("data", ["base:allocation"]))],
          ("reply", OPT_SET_META_CONTEXT, REP_ACK, check_meta(["base:allocation"])), "continue"),
        H("SET_META_CONTEXT of an unknown context selects nothing",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_SET_META_CONTEXT, q("data", ["nope:thing"]))],
          ("reply", OPT_SET_META_CONTEXT, REP_ACK, check_meta([])), "continue"),
        H("SET_META_CONTEXT unknown export: ERR_UNKNOWN",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_SET_META_CONTEXT, q("nope", ["base:allocation"]))],
          ("reply", OPT_SET_META_CONTEXT, REP_ERR_UNKNOWN), "continue"),
        H("SET_META_CONTEXT query length past the payload: ERR_INVALID",
          [("ack", OPT_STRUCTURED_REPLY),
           ("opt", OPT_SET_META_CONTEXT,
            struct.pack(">I", 4) + b"data" + struct.pack(">II", 1, 100) + b"base:")],
          ("reply", OPT_SET_META_CONTEXT, REP_ERR_INVALID), "continue"),
        H("SET_META_CONTEXT query count past the payload: ERR_INVALID",
          [("ack", OPT_STRUCTURED_REPLY),
           ("opt", OPT_SET_META_CONTEXT,
            struct.pack(">I", 4) + b"data" + struct.pack(">II", 2, 15) + b"base:allocation")],
          ("reply", OPT_SET_META_CONTEXT, REP_ERR_INVALID), "continue"),
        H("LIST_META_CONTEXT truncated payload: ERR_INVALID",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_LIST_META_CONTEXT, struct.pack(">I", 4) + b"da")],
          ("reply", OPT_LIST_META_CONTEXT, REP_ERR_INVALID), "continue"),
        H("GO after STRUCTURED_REPLY advertises DF",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_GO, g("data", ALL_INFOS))],
          ("reply", OPT_GO, REP_ACK, check_go("data", True)), "continue"),
        H("GO after EXTENDED_HEADERS advertises DF",
          [("ack", OPT_EXTENDED_HEADERS), ("opt", OPT_GO, g("data", ALL_INFOS))],
          ("reply", OPT_GO, REP_ACK, check_go("data", True)), "continue"),
        H("GO ro: transmission flags (compact)",
          [("opt", OPT_GO, g("ro", ALL_INFOS))],
          ("reply", OPT_GO, REP_ACK, check_go("ro", False)), "none"),
        H("GO ro after STRUCTURED_REPLY: transmission flags",
          [("ack", OPT_STRUCTURED_REPLY), ("opt", OPT_GO, g("ro", ALL_INFOS))],
          ("reply", OPT_GO, REP_ACK, check_go("ro", True)), "none"),
        H("GO bs64k after EXTENDED_HEADERS: transmission flags",
          [("ack", OPT_EXTENDED_HEADERS), ("opt", OPT_GO, g("bs64k", ALL_INFOS))],
          ("reply", OPT_GO, REP_ACK, check_go("bs64k", True)), "none"),
        H("GO sent one byte at a time",
          [("dribble", struct.pack(">QII", NBD_OPTS_MAGIC, OPT_GO, len(g("data", ALL_INFOS))) +
            g("data", ALL_INFOS), 1)],
          ("reply", OPT_GO, REP_ACK, check_go("data", False)), "continue"),
        H("unknown option 0x1234: ERR_UNSUP",
          [("opt", 0x1234, b"")], ("reply", 0x1234, REP_ERR_UNSUP), "continue"),
        H("unknown option with data: ERR_UNSUP, data skipped",
          [("opt", 0xABCDEF, b"z" * 1000)], ("reply", 0xABCDEF, REP_ERR_UNSUP), "continue"),
        H("unknown option with exactly 64 KiB of data: ERR_UNSUP",
          [("opt", 0x77, b"q" * MAX_OPTION)], ("reply", 0x77, REP_ERR_UNSUP), "continue"),
        H("option length 64 KiB + 1: ERR_TOO_BIG then close",
          [("optlen", OPT_GO, MAX_OPTION + 1, b"")], ("reply", OPT_GO, REP_ERR_TOO_BIG), "closed"),
        H("option length 4 GiB - 1: ERR_TOO_BIG then close",
          [("optlen", 0x99, 0xFFFFFFFF, b"")], ("reply", 0x99, REP_ERR_TOO_BIG), "closed"),
        H("client flags with an unknown bit close",
          [("flags", NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES | (1 << 2))], ("closed",), "none"),
        H("client flags with bit 31 close",
          [("flags", NBD_FLAG_C_FIXED_NEWSTYLE | (1 << 31))], ("closed",), "none"),
        H("bad option magic closes",
          [("raw", struct.pack(">QII", 0x1122334455667788, OPT_LIST, 0))], ("closed",), "none"),
        H("old request magic instead of an option closes",
          [("raw", struct.pack(">IHHQQI", NBD_REQUEST_MAGIC, 0, CMD_READ, 1, 0, 512))],
          ("closed",), "none"),
        H("truncated client flags, then client close",
          [("flags", None), ("raw", b"\0\0")], ("silent",), "none"),
        H("truncated option header, then client close",
          [("raw", struct.pack(">QII", NBD_OPTS_MAGIC, OPT_GO, 10)[:11])], ("silent",), "none"),
        H("truncated option payload, then client close",
          [("optlen", OPT_GO, 20, b"\0\0\0\x04dat")], ("silent",), "none"),
        H("client closes right after the greeting",
          [("flags", None)], ("silent",), "none"),
    ]


def dribble(r, data, piece):
    """Send `data` a few bytes at a time: the daemon must reassemble it."""
    for i in range(0, len(data), piece):
        r.send(data[i:i + piece])
        time.sleep(0.002)


def run_handshake_row(w, row):
    r = RawClient(w.d.sock)
    try:
        steps = list(row.steps)
        cflags = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES
        if steps and steps[0][0] == "flags":
            cflags = steps.pop(0)[1]
        r.greeting(cflags)
        for st in steps:
            if st[0] == "opt":
                r.send_opt(st[1], st[2])
            elif st[0] == "optlen":
                r.send_opt(st[1], st[3], length=st[2])
            elif st[0] == "raw":
                r.send(st[1])
            elif st[0] == "dribble":
                dribble(r, st[1], st[2])
            elif st[0] == "ack":
                r.option(st[1])
                r.structured = True
                r.extended = r.extended or st[1] == OPT_EXTENDED_HEADERS
            else:
                raise AssertionError(st)
        ex = row.expect
        if ex[0] == "closed":
            extra = r.wait_closed()
            expect(extra == b"", "server sent %d bytes before closing: %r" % (len(extra), extra[:40]))
            return
        if ex[0] == "silent":
            r.expect_silence()
            return
        if ex[0] == "export":
            _, export, zeroes = ex
            size, eflags = struct.unpack(">QH", r.recv_exact(10))
            if zeroes:
                expect(r.recv_exact(124) == bytes(124), "EXPORT_NAME padding not zero")
            expect(size == SIZE, "EXPORT_NAME size %d" % size)
            check_eflags(eflags, EXPORTS[export][0], structured=False)
            r.size, r.eflags = size, eflags
            w.sessions[("export-name",)] += 1
            continue_check(w, r, export)
            return
        _, opt, want = ex[:3]
        typ, items, payload = r.opt_replies(opt)
        expect(typ == want, "reply %s, expected %s" % (rep_name(typ), rep_name(want)))
        if typ & REP_FLAG_ERROR:
            expect(not items, "non-final replies before the error")
        if len(ex) > 3:
            ex[3](items)
        if opt == OPT_SET_META_CONTEXT and typ == REP_ACK and items:
            r.meta_ctx = parse_meta_reply(items[0][1])[0]
        if opt == OPT_GO and typ == REP_ACK:
            info = parse_infos(items)
            r.size, r.eflags = info[INFO_EXPORT]
            w.sessions[(r.structured, r.extended, r.meta_ctx is not None)] += 1
        if row.then == "continue":
            continue_check(w, r)
        elif row.then == "closed":
            extra = r.wait_closed()
            expect(extra == b"", "server sent %r after the final reply" % extra[:40])
    except Closed as e:
        raise Mismatch("connection closed unexpectedly (%s)" % e)
    finally:
        r.close()


# ---- Transmission table. ----
#
# kind: how the bad client negotiates: "simple", "structured",
#   "structured+meta", "structured+nometa" (SET_META selected nothing),
#   "extended", "extended+meta".
# send: a list of Req; all but the last must succeed.
# expect: ("err", E) | ("ok", checker or None) | ("closed",) | ("silent",)
# effect: what the row does to the "data" model when it succeeds.

class Req:
    """One request as sent by a row. count: that many copies pipelined in one
    send; dribble: send the bytes in pieces of that size, 2 ms apart."""

    def __init__(self, typ, offset, length, flags=0, payload=None, magic=None,
                 truncate=None, count=1, dribble=None):
        self.typ, self.offset, self.length, self.flags = typ, offset, length, flags
        self.payload = payload
        self.magic = magic
        self.truncate = truncate
        self.count = count
        self.dribble = dribble

    def wire(self, r):
        if self.payload is None:
            payload = b""
            compact_write = self.typ == CMD_WRITE and not r.extended
            ext_payload = r.extended and self.flags & CF_PAYLOAD_LEN
            if compact_write or ext_payload:
                payload = bytes([0xEE]) * self.length
        else:
            payload = self.payload
        cookie, hdr = r.encode_request(self.typ, self.offset, self.length, self.flags)
        if self.magic is not None:
            hdr = struct.pack(">I", self.magic) + hdr[4:]
        r.pending[cookie] = (self.typ, self.offset, self.length)
        return cookie, hdr + payload


T = collections.namedtuple("T", "name kind export send expect effect")


def t(name, kind, send, expect_, export="data", effect=None):
    if isinstance(send, Req):
        send = [send]
    return T(name, kind, export, send, expect_, effect)


def E(e):
    return ("err", e)


def data_is(w, export, off, n):
    def checker(rep):
        expect(rep.data == w.expected(export, off, n),
               "READ [%d,+%d) returned wrong data" % (off, n))
    return checker


def hole_read(w, off, n, df=False):
    def checker(rep):
        expect(rep.data == w.expected("ro", off, n), "READ [%d,+%d) returned wrong data" % (off, n))
        content = [c for c in rep.chunks if c[1] in (RT_OFFSET_DATA, RT_OFFSET_HOLE)]
        if df:
            expect(len(content) == 1, "DF read answered with %d content chunks" % len(content))
            return
        lo, hi = max(off, HOLE[0]), min(off + n, HOLE[1])
        holed = sum(min(o + k, hi) - max(o, lo) for o, k in rep.holes if o < hi and o + k > lo)
        expect(holed == hi - lo, "only %d of the %d hole bytes came as OFFSET_HOLE" % (holed, hi - lo))
    return checker


def empty_ok(rep):
    expect(rep.data == b"", "zero-length READ returned %d bytes" % len(rep.data))


def status_is(off, n, req_one=False, must_reach=None, ext=False):
    def checker(rep):
        expect(rep.ctx is not None, "BLOCK_STATUS without a block status chunk")
        check_extents(rep.extents, off, n, RO_TRUTH, req_one, must_reach)
        want_type = RT_BLOCK_STATUS_EXT if ext else RT_BLOCK_STATUS
        types = {c[1] for c in rep.chunks if c[1] in (RT_BLOCK_STATUS, RT_BLOCK_STATUS_EXT)}
        expect(types == {want_type}, "block status chunk types %r" % types)
    return checker


def transmission_rows(w):
    S = SIZE
    R, WR, FL, TR, CA, WZ, BS = (CMD_READ, CMD_WRITE, CMD_FLUSH, CMD_TRIM, CMD_CACHE,
                                 CMD_WRITE_ZEROES, CMD_BLOCK_STATUS)
    new1 = bytes(random.Random(7).randbytes(4096))
    new2 = bytes(random.Random(8).randbytes(4096))
    new3 = bytes(random.Random(9).randbytes(4096))
    new4 = bytes(random.Random(10).randbytes(1000))
    new5 = bytes(random.Random(11).randbytes(4096))
    rows = [
        # Baselines: the good path works in every mode.
        t("simple READ 4 KiB", "simple", Req(R, 4096, 4096), ("ok", data_is(w, "data", 4096, 4096))),
        t("structured READ 4 KiB", "structured", Req(R, 8192, 4096), ("ok", data_is(w, "data", 8192, 4096))),
        t("extended READ 4 KiB", "extended", Req(R, 12288, 4096), ("ok", data_is(w, "data", 12288, 4096))),
        t("simple READ of length 0 succeeds", "simple", Req(R, 4096, 0), ("ok", empty_ok)),
        t("structured READ of length 0 succeeds", "structured", Req(R, 4096, 0), ("ok", empty_ok)),
        t("extended READ of length 0 succeeds", "extended", Req(R, 4096, 0), ("ok", empty_ok)),
        t("READ of the last 4 KiB", "simple", Req(R, S - 4096, 4096),
          ("ok", data_is(w, "data", S - 4096, 4096))),
        t("FUA on READ is accepted (valid on every command)", "structured",
          Req(R, 0, 4096, CF_FUA), ("ok", data_is(w, "data", 0, 4096))),
        t("structured READ across a hole returns OFFSET_HOLE", "structured",
          Req(R, 500 * KIB, 300 * KIB), ("ok", hole_read(w, 500 * KIB, 300 * KIB)), export="ro"),
        t("structured READ of exactly the hole", "structured",
          Req(R, HOLE[0], HOLE[1] - HOLE[0]), ("ok", hole_read(w, HOLE[0], HOLE[1] - HOLE[0])),
          export="ro"),
        t("extended READ across a hole returns OFFSET_HOLE", "extended",
          Req(R, 500 * KIB, 300 * KIB), ("ok", hole_read(w, 500 * KIB, 300 * KIB)), export="ro"),
        t("DF READ: a single content chunk", "structured",
          Req(R, 500 * KIB, 300 * KIB, CF_DF), ("ok", hole_read(w, 500 * KIB, 300 * KIB, df=True)),
          export="ro"),
        t("BLOCK_STATUS base:allocation (structured)", "structured+meta",
          Req(BS, 0, S), ("ok", status_is(0, S, must_reach=HOLE[1] + 1)), export="ro"),
        t("BLOCK_STATUS REQ_ONE from 0", "structured+meta",
          Req(BS, 0, S, CF_REQ_ONE), ("ok", status_is(0, S, req_one=True)), export="ro"),
        t("BLOCK_STATUS REQ_ONE inside the hole", "structured+meta",
          Req(BS, 600 * KIB, 100 * KIB, CF_REQ_ONE), ("ok", status_is(600 * KIB, 100 * KIB, req_one=True)),
          export="ro"),
        t("BLOCK_STATUS base:allocation (extended, 64-bit descriptors)", "extended+meta",
          Req(BS, 0, S), ("ok", status_is(0, S, must_reach=HOLE[1] + 1, ext=True)), export="ro"),
        t("BLOCK_STATUS REQ_ONE (extended)", "extended+meta",
          Req(BS, 4096, S - 4096, CF_REQ_ONE), ("ok", status_is(4096, S - 4096, req_one=True, ext=True)),
          export="ro"),
        t("extended WRITE with PAYLOAD_LEN", "extended",
          Req(WR, 900 * KIB, 4096, CF_PAYLOAD_LEN, payload=new1), ("ok", None),
          effect=("write", 900 * KIB, new1)),
        t("compact WRITE with FUA", "structured",
          Req(WR, 896 * KIB, 4096, CF_FUA, payload=new2), ("ok", None),
          effect=("write", 896 * KIB, new2)),
        t("WRITE_ZEROES", "structured", Req(WZ, 904 * KIB, 4096), ("ok", None),
          effect=("write", 904 * KIB, bytes(4096))),
        t("WRITE_ZEROES NO_HOLE (extended)", "extended", Req(WZ, 908 * KIB, 4096, CF_NO_HOLE), ("ok", None),
          effect=("write", 908 * KIB, bytes(4096))),
        t("TRIM", "simple", Req(TR, 912 * KIB, 8192), ("ok", None), effect=("undefined", 912 * KIB, 8192)),
        t("FLUSH", "simple", Req(FL, 0, 0), ("ok", None)),
        t("CACHE", "extended", Req(CA, 0, 64 * KIB), ("ok", None)),
        t("DISC closes without a reply", "simple", Req(CMD_DISC, 0, 0), ("closed",)),
        t("READ request sent one byte at a time", "simple", Req(R, 8192, 4096, dribble=1),
          ("ok", data_is(w, "data", 8192, 4096))),
        t("extended WRITE sent in 7-byte pieces", "extended",
          Req(WR, 920 * KIB, 1000, CF_PAYLOAD_LEN, payload=new4, dribble=7), ("ok", None),
          effect=("write", 920 * KIB, new4)),
        t("64 pipelined READs in one send", "structured", Req(R, 65536, 65536, count=64),
          ("ok", data_is(w, "data", 65536, 65536))),
        t("64 pipelined WRITEs in one send", "simple",
          Req(WR, 128 * KIB, 4096, payload=new5, count=64), ("ok", None),
          effect=("write", 128 * KIB, new5)),
        t("64 pipelined 1 MiB READs, then close without reading", "simple",
          Req(R, 0, SIZE, count=64), ("abandon", False)),
        t("64 pipelined 1 MiB READs, then reset", "structured",
          Req(R, 0, SIZE, count=64), ("abandon", True)),
        t("64 pipelined BLOCK_STATUS, then reset", "extended+meta",
          Req(BS, 0, SIZE, count=64), ("abandon", True), export="ro"),

        # Payload sizes.
        t("extended WRITE PAYLOAD_LEN 2^40: hard disconnect", "extended",
          Req(WR, 0, 1 << 40, CF_PAYLOAD_LEN, payload=b""), ("closed",)),
        t("extended WRITE PAYLOAD_LEN 2^40 with data following: hard disconnect", "extended",
          Req(WR, 0, 1 << 40, CF_PAYLOAD_LEN, payload=b"\xEE" * 65536), ("closed",)),
        t("extended WRITE PAYLOAD_LEN 32 MiB + 1: hard disconnect", "extended",
          Req(WR, 0, MAX_PAYLOAD + 1, CF_PAYLOAD_LEN, payload=b""), ("closed",)),
        t("extended READ PAYLOAD_LEN 2^63: hard disconnect", "extended",
          Req(R, 0, 1 << 63, CF_PAYLOAD_LEN, payload=b""), ("closed",)),
        t("extended WRITE PAYLOAD_LEN 32 MiB out of range: ENOSPC, payload consumed", "extended",
          Req(WR, 0, MAX_PAYLOAD, CF_PAYLOAD_LEN), E(ENOSPC)),
        t("compact WRITE 32 MiB + 512: payload discarded, EINVAL", "simple",
          Req(WR, 0, MAX_PAYLOAD + 512), E(EINVAL)),
        t("compact WRITE 32 MiB + 4 KiB, structured: EINVAL", "structured",
          Req(WR, 0, MAX_PAYLOAD + 4096), E(EINVAL)),
        t("compact WRITE 32 MiB + 512 on readonly: EINVAL before EPERM", "simple",
          Req(WR, 0, MAX_PAYLOAD + 512), E(EINVAL), export="ro"),

        # Unknown commands and flags.
        t("unknown command 8", "simple", Req(8, 0, 4096), E(EINVAL)),
        t("unknown command 0xffff (structured)", "structured", Req(0xFFFF, 0, 0), E(EINVAL)),
        t("unknown command 9 (extended)", "extended", Req(9, 0, 1 << 40), E(EINVAL)),
        t("unknown flag bit 15 on READ", "simple", Req(R, 0, 4096, 1 << 15), E(EINVAL)),
        t("unknown flag bit 6 on FLUSH (structured)", "structured", Req(FL, 0, 0, 1 << 6), E(EINVAL)),
        t("unknown flag bit 6 on WRITE: payload consumed", "simple", Req(WR, 0, 4096, 1 << 6), E(EINVAL)),
        t("DF without structured replies", "simple", Req(R, 0, 4096, CF_DF), E(EINVAL)),
        t("DF on WRITE", "structured", Req(WR, 0, 4096, CF_DF), E(EINVAL)),
        t("DF on BLOCK_STATUS", "structured+meta", Req(BS, 0, 4096, CF_DF), E(EINVAL)),
        t("REQ_ONE on READ", "structured", Req(R, 0, 4096, CF_REQ_ONE), E(EINVAL)),
        t("REQ_ONE on READ (simple)", "simple", Req(R, 0, 4096, CF_REQ_ONE), E(EINVAL)),
        t("REQ_ONE on TRIM", "simple", Req(TR, 0, 4096, CF_REQ_ONE), E(EINVAL)),
        t("FAST_ZERO on WRITE: payload consumed", "simple", Req(WR, 0, 4096, CF_FAST_ZERO), E(EINVAL)),
        t("FAST_ZERO on TRIM", "structured", Req(TR, 0, 4096, CF_FAST_ZERO), E(EINVAL)),
        t("NO_HOLE on READ", "structured", Req(R, 0, 4096, CF_NO_HOLE), E(EINVAL)),
        t("NO_HOLE on WRITE: payload consumed", "simple", Req(WR, 0, 4096, CF_NO_HOLE), E(EINVAL)),
        t("PAYLOAD_LEN on compact READ", "simple", Req(R, 0, 4096, CF_PAYLOAD_LEN), E(EINVAL)),
        t("PAYLOAD_LEN on compact WRITE: payload consumed", "structured",
          Req(WR, 0, 4096, CF_PAYLOAD_LEN), E(EINVAL)),
        # The extension says a WRITE MUST carry PAYLOAD_LEN; qemu's client does
        # not set it, and qemu-nbd reads the payload anyway ("noncompliant
        # client, proceed"). nbdcached does the same (proto/request.c), so
        # the data is written; an oversized one is still a hard disconnect.
        t("extended WRITE without PAYLOAD_LEN carries its payload (as qemu-nbd)", "extended",
          Req(WR, 916 * KIB, 4096, payload=new3), ("ok", None), effect=("write", 916 * KIB, new3)),
        t("extended WRITE without PAYLOAD_LEN, length 2^40: hard disconnect", "extended",
          Req(WR, 0, 1 << 40, payload=b""), ("closed",)),
        t("extended BLOCK_STATUS with PAYLOAD_LEN: payload consumed", "extended+meta",
          Req(BS, 0, 8, CF_PAYLOAD_LEN, payload=struct.pack(">II", 1, 4096)), E(EINVAL)),
        t("extended READ with PAYLOAD_LEN: payload consumed", "extended",
          Req(R, 0, 16, CF_PAYLOAD_LEN, payload=b"\xEE" * 16), E(EINVAL)),
        t("extended FLUSH with PAYLOAD_LEN: payload consumed", "extended",
          Req(FL, 0, 100, CF_PAYLOAD_LEN, payload=b"\xEE" * 100), E(EINVAL)),

        # Readonly.
        t("WRITE on readonly: EPERM, payload consumed", "simple", Req(WR, 0, 4096), E(EPERM), export="ro"),
        t("WRITE on readonly (extended): EPERM", "extended",
          Req(WR, 0, 4096, CF_PAYLOAD_LEN), E(EPERM), export="ro"),
        t("TRIM on readonly: EPERM", "simple", Req(TR, 0, 4096), E(EPERM), export="ro"),
        t("WRITE_ZEROES on readonly: EPERM", "structured", Req(WZ, 0, 4096), E(EPERM), export="ro"),
        t("WRITE out of range on readonly: EPERM before ENOSPC", "simple",
          Req(WR, S, 4096), E(EPERM), export="ro"),
        t("FAST_ZERO on WRITE on readonly: EINVAL before EPERM", "simple",
          Req(WR, 0, 4096, CF_FAST_ZERO), E(EINVAL), export="ro"),
        t("FLUSH on readonly succeeds", "simple", Req(FL, 0, 0), ("ok", None), export="ro"),

        # FLUSH arguments.
        t("FLUSH with offset", "simple", Req(FL, 4096, 0), E(EINVAL)),
        t("FLUSH with length", "structured", Req(FL, 0, 1), E(EINVAL)),
        t("FLUSH with a 64-bit length (extended)", "extended", Req(FL, 0, 1 << 40), E(EINVAL)),

        # Oversized reads.
        t("READ 32 MiB + 1, simple: EINVAL", "simple", Req(R, 0, MAX_PAYLOAD + 1), E(EINVAL)),
        t("READ 32 MiB + 1, structured: EOVERFLOW", "structured", Req(R, 0, MAX_PAYLOAD + 1), E(EOVERFLOW)),
        t("READ 2^40, extended: EOVERFLOW", "extended", Req(R, 0, 1 << 40), E(EOVERFLOW)),
        t("READ 32 MiB + 1 past the end: EOVERFLOW before EINVAL", "structured",
          Req(R, S, MAX_PAYLOAD + 1), E(EOVERFLOW)),
        t("READ exactly 32 MiB past the end: EINVAL (range)", "structured",
          Req(R, 0, MAX_PAYLOAD), E(EINVAL)),

        # Range.
        t("READ past the end", "simple", Req(R, S - 512, 1024), E(EINVAL)),
        t("READ at the end", "structured", Req(R, S, 512), E(EINVAL)),
        t("READ with 64-bit wraparound", "simple", Req(R, U64 - 511, 1024), E(EINVAL)),
        t("READ with 64-bit wraparound (extended)", "extended", Req(R, 4096, U64 - 4095), E(EOVERFLOW)),
        t("WRITE past the end: ENOSPC, payload consumed", "simple", Req(WR, S - 512, 1024), E(ENOSPC)),
        t("WRITE with 64-bit wraparound: ENOSPC", "structured", Req(WR, U64 - 511, 1024), E(ENOSPC)),
        t("WRITE past the end (extended): ENOSPC", "extended",
          Req(WR, S, 4096, CF_PAYLOAD_LEN), E(ENOSPC)),
        t("WRITE_ZEROES past the end: ENOSPC", "simple", Req(WZ, S, 1), E(ENOSPC)),
        t("WRITE_ZEROES with 64-bit wraparound (extended): ENOSPC", "extended",
          Req(WZ, 1 << 63, 1 << 63), E(ENOSPC)),
        t("WRITE_ZEROES of 2^64-1 bytes (extended): ENOSPC", "extended", Req(WZ, 1, U64), E(ENOSPC)),
        t("TRIM past the end", "simple", Req(TR, S - 4096, 8192), E(EINVAL)),
        t("TRIM with 64-bit wraparound (extended)", "extended", Req(TR, 4096, U64 - 4095), E(EINVAL)),
        t("CACHE past the end", "structured", Req(CA, S, 4096), E(EINVAL)),
        t("CACHE with 64-bit wraparound", "simple", Req(CA, U64 - 4095, 8192), E(EINVAL)),
        t("BLOCK_STATUS past the end", "structured+meta", Req(BS, S - 4096, 8192), E(EINVAL), export="ro"),
        t("BLOCK_STATUS with 64-bit wraparound (extended)", "extended+meta",
          Req(BS, U64, 2), E(EINVAL), export="ro"),

        # Block status without a context.
        t("BLOCK_STATUS without SET_META_CONTEXT (simple)", "simple", Req(BS, 0, 4096), E(EINVAL)),
        t("BLOCK_STATUS without SET_META_CONTEXT (structured)", "structured", Req(BS, 0, 4096), E(EINVAL)),
        t("BLOCK_STATUS after SET_META_CONTEXT selected nothing", "structured+nometa",
          Req(BS, 0, 4096), E(EINVAL)),
        t("BLOCK_STATUS without SET_META_CONTEXT (extended)", "extended", Req(BS, 0, 4096), E(EINVAL)),

        # Framing violations close that connection only.
        t("bad request magic closes", "simple", Req(R, 0, 4096, magic=0xDEADBEEF), ("closed",)),
        t("extended request magic without extended headers closes", "structured",
          Req(R, 0, 4096, magic=NBD_EXTENDED_REQUEST_MAGIC, payload=b"\0" * 4), ("closed",)),
        t("compact request magic in an extended session closes", "extended",
          Req(R, 0, 4096, magic=NBD_REQUEST_MAGIC), ("closed",)),
        t("simple reply magic as a request closes", "simple",
          Req(R, 0, 4096, magic=NBD_SIMPLE_REPLY_MAGIC), ("closed",)),
        t("truncated request, then client close", "simple", Req(R, 0, 4096, truncate=20), ("silent",)),
        t("truncated extended request, then client close", "extended",
          Req(R, 0, 4096, truncate=28), ("silent",)),
        t("truncated WRITE payload, then client close", "simple",
          Req(WR, 0, 65536, truncate=28 + 1000), ("silent",)),
        t("truncated extended WRITE payload, then client close", "extended",
          Req(WR, 0, 65536, CF_PAYLOAD_LEN, truncate=32 + 65535), ("silent",)),
    ]
    return rows


KINDS = {
    "simple": (False, False, None),
    "structured": (True, False, None),
    "structured+meta": (True, False, ["base:allocation"]),
    "structured+nometa": (True, False, ["nope:thing"]),
    "extended": (False, True, None),
    "extended+meta": (False, True, ["base:allocation"]),
}


def run_transmission_row(w, row):
    structured, extended, meta = KINDS[row.kind]
    r = RawClient(w.d.sock)
    try:
        r.open(row.export, structured, extended, meta)
        w.sessions[(r.structured, r.extended, r.meta_ctx is not None)] += 1
        expect(r.size == SIZE, "GO size %d" % r.size)
        # (The transmission flags are checked by the handshake rows "GO ...".)
        if meta == ["base:allocation"]:
            expect(r.meta_ctx is not None, "SET_META_CONTEXT did not select base:allocation")
        for req in row.send[:-1]:
            rep = r.command(req.typ, req.offset, req.length, req.flags, req.payload or b"")
            expect(rep.error == 0, "setup request failed with %s" % err_name(rep.error))
        req = row.send[-1]
        cookies = []
        wire = b""
        for _ in range(req.count):
            cookie, one = req.wire(r)
            cookies.append(cookie)
            wire += one
        if req.truncate is not None:
            wire = wire[:req.truncate]
        ex = row.expect
        try:
            if req.dribble:
                dribble(r, wire, req.dribble)
            else:
                r.send(wire)
        except Closed:
            if ex[0] != "closed":
                raise
        if ex[0] == "abandon":
            # Leave with replies in flight: the daemon writes into a closed
            # socket (EPIPE, or ECONNRESET after an RST) and must survive.
            if ex[1]:
                r.s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        if ex[0] == "closed":
            extra = r.wait_closed()
            expect(extra == b"", "server sent %d bytes before closing: %r" % (len(extra), extra[:40]))
            return
        if ex[0] == "silent":
            r.expect_silence()
            return
        for cookie in cookies:
            rep = r.read_reply(cookie)
            if ex[0] == "err":
                expect(rep.error == ex[1], "reply %s, expected %s"
                       % (err_name(rep.error), err_name(ex[1])))
                expect(not any(c[1] in (RT_OFFSET_DATA, RT_OFFSET_HOLE) for c in rep.chunks),
                       "error reply carried read data")
            else:
                expect(rep.error == 0, "reply %s, expected success" % err_name(rep.error))
                if req.typ == CMD_BLOCK_STATUS:
                    expect(rep.ctx == r.meta_ctx, "block status for context %r, negotiated %r"
                           % (rep.ctx, r.meta_ctx))
                if ex[1]:
                    ex[1](rep)
        if ex[0] == "ok":
            w.apply(row.effect)
        continue_check(w, r, row.export)
    except Closed as e:
        raise Mismatch("connection closed unexpectedly (%s)" % e)
    finally:
        r.close()


def check_negotiated_log(w):
    """After GO the daemon logs 'negotiated structured=S extended=E meta=M'."""
    want = collections.Counter()
    for key, n in w.sessions.items():
        if len(key) == 3:
            want[key] += n
    deadline = time.time() + 30
    while True:
        got = collections.Counter()
        for m in re.finditer(r"negotiated structured=(\d) extended=(\d) meta=(\d)", w.d.log_text()):
            s, e, mm = (int(x) for x in m.groups())
            got[(bool(s) or bool(e), bool(e), bool(mm))] += 1
        short = {k: (n, got[k]) for k, n in want.items() if got[k] < n}
        if not short or time.time() > deadline:
            break
        time.sleep(0.1)
    return short


def idle_connections(w, n=200):
    """n connections parked mid-handshake must not starve anyone else."""
    socks = []
    try:
        for i in range(n):
            r = RawClient(w.d.sock)
            socks.append(r)
            if i % 3 == 1:
                r.greeting()                                   # flags sent, no option
            elif i % 3 == 2:
                r.greeting()
                r.send(struct.pack(">QII", NBD_OPTS_MAGIC, OPT_GO, 100)[:10])   # half a header
        w.live_check("%d idle connections" % n)
        r = RawClient(w.d.sock)
        socks.append(r)
        r.open("data")
        continue_check(w, r)
    finally:
        for r in socks:
            r.close()
    w.live_check("closing %d idle connections" % n)


def never_reading_client(w, n=2000):
    """A client pipelines n 1 MiB READs and never reads a reply. The daemon
    must bound what it buffers for it and keep serving everyone else."""
    r = RawClient(w.d.sock)
    try:
        r.open("data", structured=True)
        wire = b"".join(r.encode_request(CMD_READ, 0, SIZE)[1] for _ in range(n))
        r.s.setblocking(False)
        deadline = time.time() + 5
        while wire and time.time() < deadline:
            try:
                wire = wire[r.s.send(wire):]
            except BlockingIOError:
                time.sleep(0.01)
        time.sleep(1)
        log("     %d of %d requests sent; daemon RSS %d KiB" % (n - len(wire) // 28, n, w.rss() >> 10))
        w.live_check("a client not reading %d MiB of replies" % n)
    finally:
        r.close()
    w.live_check("closing the client that did not read")


def main():
    checks = nbdtest.Checks(catch=(Mismatch,))
    with nbdtest.tempdir() as tmp:
        files = {}
        r = random.Random(1234)
        for name in EXPORTS:
            p = os.path.join(tmp, name + ".img")
            with open(p, "wb") as f:
                if name == "ro":
                    f.write(r.randbytes(HOLE[0]))
                    f.seek(HOLE[1])
                    f.write(r.randbytes(SIZE - HOLE[1]))
                else:
                    f.write(r.randbytes(SIZE))
            files[name] = p
        # The hole must really be a hole for the hole/status rows to mean anything.
        with open(files["ro"], "rb") as f:
            fd = f.fileno()
            nbdtest.check(os.lseek(fd, 0, os.SEEK_HOLE) == HOLE[0] and
                          os.lseek(fd, HOLE[0], os.SEEK_DATA) == HOLE[1],
                          "test setup: the filesystem did not keep the hole")
        exports = []
        for name, (ro, desc, bs) in EXPORTS.items():
            opts = []
            if ro:
                opts.append("readonly")
            if desc:
                opts.append("description=" + desc)
            if bs:
                opts.append("block-size=%d" % bs)
            exports.append((name, files[name], ",".join(opts)))
        with nbdtest.Daemon(exports, threads=2) as d:
            w = World(d, files)
            w.rss_base = w.rss()
            live = nbdtest.libnbd_handle(d.tcp_uri("data"))
            w.live = live
            w.sessions[(True, False, False)] += 1     # libnbd: structured, no meta
            w.live_check("startup")

            for kind, rows, runner in (("handshake", handshake_rows(w), run_handshake_row),
                                       ("transmission", transmission_rows(w), run_transmission_row)):
                log("--- %s table: %d rows" % (kind, len(rows)))
                for row in rows:
                    checks.run(row.name, runner, w, row, header=False)
                    w.live_check("row %r" % row.name)

            for name, fn in (("200 connections parked mid-handshake", idle_connections),
                             ("a client that never reads its replies", never_reading_client)):
                checks.run(name, fn, w, catch=(Mismatch, Closed))
            short = check_negotiated_log(w)
            checks.expect(not short, "'negotiated structured=S extended=E meta=M' lines missing "
                          "(key: (want, got)): %r" % short)
            live.flush()
            with open(files["data"], "rb") as f:
                backend = bytearray(f.read())
            checks.expect(backend == w.model_as_read(backend),
                          "backend file differs from what was written, after FLUSH")
            live.shutdown()
            log("daemon RSS: start %d KiB, max %d KiB" % (w.rss_base >> 10, w.max_rss >> 10))
            checks.dump_log(d)
    checks.finish("bad-input", unit="row")


if __name__ == "__main__":
    main()
