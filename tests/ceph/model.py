"""A byte model of an export driven by random commands from several libnbd
connections: WRITE (some FUA), TRIM and WRITE_ZEROES (both read back as
zeros: the rbd backend zeroes partial objects too), FLUSH and READs checked
against the model as they go.

    m = Model(size, seed)
    m.run(handles, ops, log)          # raises Mismatch at the first wrong byte
    m.check_bytes(data, what)         # the whole image against the model
"""
import random

import nbd

KiB = 1 << 10
MiB = 1 << 20


class Mismatch(Exception):
    pass


def first_diff(a, b):
    n = min(len(a), len(b))
    for i in range(0, n, 4096):
        if a[i:i + 4096] != b[i:i + 4096]:
            for j in range(i, min(i + 4096, n)):
                if a[j] != b[j]:
                    return j
    return n if len(a) != len(b) else -1


class Model:
    def __init__(self, size, seed, big_ranges=True):
        self.size = size
        self.data = bytearray(size)
        self.r = random.Random(seed)
        self.big = big_ranges
        self.counts = {}
        self.checked = 0
        self.history = []  # (kind, offset, length, handle index) of each change
        self.handles = []

    def _range(self, limit):
        r = self.r
        n = r.choice((512, 4 * KiB, 4 * KiB, 64 * KiB, r.randrange(1, limit // 512 + 1) * 512))
        n = min(n, limit)
        off = r.randrange(0, (self.size - n) // 512 + 1) * 512
        return off, n

    def op(self, h):
        r = self.r
        kind = r.choices(("read", "write", "trim", "zero", "flush"), (30, 40, 8, 8, 6))[0]
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "read":
            off, n = self._range(512 * KiB)
            got = h.pread(n, off)
            want = bytes(self.data[off:off + n])
            self.checked += n
            if got != want:
                d = first_diff(got, want)
                raise Mismatch("READ of %d bytes at %d: byte %d (offset %d) is %#x, the model "
                               "says %#x" % (n, off, d, off + d, got[d], want[d]))
        elif kind == "write":
            off, n = self._range(1 * MiB)
            buf = r.randbytes(n)
            fua = r.random() < 0.2
            h.pwrite(buf, off, nbd.CMD_FLAG_FUA if fua else 0)
            self.data[off:off + n] = buf
            self.note("write" + (" fua" if fua else ""), off, n, h)
        elif kind in ("trim", "zero"):
            limit = 12 * MiB if self.big and r.random() < 0.3 else 256 * KiB
            off, n = self._range(limit)
            if kind == "trim":
                h.trim(n, off)
            else:
                h.zero(n, off)
            self.data[off:off + n] = bytes(n)
            self.note(kind, off, n, h)
        else:
            h.flush()
            self.note("flush", 0, 0, h)

    def note(self, kind, off, n, h):
        self.history.append((kind, off, n, self.handles.index(h) if h in self.handles else -1))

    def touched(self, pos):
        """The changes that covered byte pos, oldest first, as text."""
        return "; ".join("#%d %s [%d, +%d) on conn %d" % (i, k, o, n, c)
                         for i, (k, o, n, c) in enumerate(self.history)
                         if o <= pos < o + n) or "none"

    def run(self, handles, ops):
        self.handles = list(handles)
        for _ in range(ops):
            self.op(self.r.choice(handles))

    def check_bytes(self, got, what):
        self.checked += len(got)
        if bytes(got) != bytes(self.data):
            d = first_diff(bytes(got), bytes(self.data))
            raise Mismatch("%s: byte %d is %#x, the model says %#x (changes there: %s)" %
                           (what, d, got[d] if d < len(got) else -1,
                            self.data[d] if d < len(self.data) else -1, self.touched(d)))

    def check_zero_extents(self, h, what):
        """Every range block status says reads as zeros (STATE_ZERO) must be
        zeros in the model. Returns how many bytes it said so of."""
        zeros = []
        pos = 0
        for _ in range(10000):
            if pos >= self.size:
                break
            seen = [pos]

            def cb(metacontext, offset, entries, err):
                p = offset
                for i in range(0, len(entries), 2):
                    if entries[i + 1] & nbd.STATE_ZERO:
                        zeros.append((p, entries[i]))
                    p += entries[i]
                seen[0] = max(seen[0], p)
                return 0

            h.block_status(min(self.size - pos, 64 * MiB), pos, cb)
            if seen[0] <= pos:
                raise Mismatch("%s: block status made no progress at %d" % (what, pos))
            pos = seen[0]
        zero_bytes = 0
        for off, n in zeros:
            end = min(off + n, self.size)
            if off < end and any(self.data[off:end]):
                raise Mismatch("%s: block status says [%d, %d) reads as zeros; the model "
                               "has data there" % (what, off, end))
            zero_bytes += max(0, end - off)
        return zero_bytes
