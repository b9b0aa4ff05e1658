#!/usr/bin/python3
"""resize_reload: NBD_CMD_RESIZE acts on the export its connection
negotiated, never on one found again by name (issue 40, defect 6;
nbdcached(8), RESIZE).

One daemon with a config file, reloaded through the control socket
between the steps; every file is 16 MiB of random bytes, and a raw client
(tests/integration/bad_input.py's) sends NBD_CMD_RESIZE:

  replaced  x over x.img with allow-resize; a connection opens x (and
            sees NBD_FLAG_SEND_RESIZE); a reload removes x; another
            reload adds x again over other.img, without allow-resize, and
            a client of the new x opens it. The old connection sends
            NBD_CMD_RESIZE to 4096 bytes: ESHUTDOWN (its export is gone),
            other.img keeps its size and bytes, x.img too, and the new x's
            client still reads its bytes. (Before the fix the resize found
            the new x by name: other.img was cut to 4096 bytes.)
  rights    p over p.img with allow-resize; a connection opens p; a reload
            turns allow-resize off (same backend: a new version of p). The
            connection's NBD_CMD_RESIZE to 32 MiB: EPERM, p.img unchanged
            (allow-resize is checked on p as it is now). A reload turns it
            on again, with a new description: the same connection's
            NBD_CMD_RESIZE to 32 MiB succeeds and p.img has 32 MiB (the
            current version of the export it negotiated).
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
import bad_input as raw  # noqa: E402

MIB = 1 << 20
SIZE = 16 * MIB
CMD_RESIZE = 8                  # the resize extension's command
FLAG_SEND_RESIZE = 1 << 9       # ... and its transmission flag

CHECKS = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed))
expect = CHECKS.expect


def write_config(path, sections):
    """sections: [(name, backend, {key: value})]."""
    text = "[generic]\ncache-size = 64M\n"
    for name, backend, keys in sections:
        text += "\n[%s]\nbackend = %s\n" % (name, backend)
        for k, v in keys.items():
            text += "%s = %s\n" % (k, v)
    with open(path + ".new", "w") as f:
        f.write(text)
    os.rename(path + ".new", path)


def reload(d, what):
    r = nbdtest.control_request(d.control, {"command": "reload"})
    log("reload (%s): %r" % (what, {k: v for k, v in r.items() if v}))
    nbdtest.require(r.get("ok"), "reload (%s): %r" % (what, r))
    return r


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def replaced(d, conf, imgs, keep):
    before = {k: (os.path.getsize(p), digest(p)) for k, p in imgs.items()}
    old = raw.RawClient(d.sock)
    old.open("x")
    expect(old.eflags & FLAG_SEND_RESIZE, "x (allow-resize) lacks NBD_FLAG_SEND_RESIZE")
    write_config(conf, keep)
    r = reload(d, "x removed")
    nbdtest.require(r.get("removed") == ["x"], "x not removed: %r" % r)
    write_config(conf, keep + [("x", imgs["other"], {})])
    r = reload(d, "x added over other.img")
    nbdtest.require(r.get("added") == ["x"], "x not added: %r" % r)
    new = raw.RawClient(d.sock)
    new.open("x")
    expect(not new.eflags & FLAG_SEND_RESIZE, "the new x advertises NBD_FLAG_SEND_RESIZE")
    c = old.request(CMD_RESIZE, 4096, 0)
    rep = old.read_reply(c)
    log("NBD_CMD_RESIZE to 4096 on the removed x's connection: error %d (%s)"
        % (rep.error, raw.err_name(rep.error)))
    expect(rep.error == raw.ESHUTDOWN,
           "NBD_CMD_RESIZE on a connection whose export a reload removed: error %d (%s), "
           "not ESHUTDOWN" % (rep.error, raw.err_name(rep.error)))
    for k, p in imgs.items():
        size = os.path.getsize(p)
        expect(size == before[k][0], "%s: %d bytes after the old connection's RESIZE, not %d"
               % (os.path.basename(p), size, before[k][0]))
    expect(digest(imgs["other"]) == before["other"][1], "other.img's bytes changed")
    expect(digest(imgs["x"]) == before["x"][1], "x.img's bytes changed")
    expect(nbdtest.export_size(d, "x") == SIZE, "the new x is %d bytes"
           % nbdtest.export_size(d, "x"))
    with open(imgs["other"], "rb") as f:
        want = f.read(65536)
    c = new.request(raw.CMD_READ, 0, 65536)
    rep = new.read_reply(c)
    expect(rep.error == 0 and rep.data == want, "the new x's client: READ error %d, or other "
           "bytes" % rep.error)
    c = new.request(raw.CMD_READ, SIZE - 4096, 4096)
    expect(new.read_reply(c).error == 0, "the new x's client: READ of its last block")
    new.close()
    old.close()


def rights(d, conf, imgs, keep):
    base = [s for s in keep if s[0] != "p"]
    c = raw.RawClient(d.sock)
    c.open("p")
    expect(c.eflags & FLAG_SEND_RESIZE, "p (allow-resize) lacks NBD_FLAG_SEND_RESIZE")
    write_config(conf, base + [("p", imgs["p"], {"allow-resize": "false"})])
    r = reload(d, "p without allow-resize")
    nbdtest.require(r.get("changed") == ["p"], "p not changed: %r" % r)
    k = c.request(CMD_RESIZE, 32 * MIB, 0)
    rep = c.read_reply(k)
    log("NBD_CMD_RESIZE after allow-resize was turned off: error %d (%s)"
        % (rep.error, raw.err_name(rep.error)))
    expect(rep.error == raw.EPERM, "NBD_CMD_RESIZE after a reload turned allow-resize off: "
           "error %d (%s), not EPERM" % (rep.error, raw.err_name(rep.error)))
    expect(os.path.getsize(imgs["p"]) == SIZE, "p.img is %d bytes" % os.path.getsize(imgs["p"]))
    expect(nbdtest.export_size(d, "p") == SIZE, "p is %d bytes" % nbdtest.export_size(d, "p"))
    write_config(conf, base + [("p", imgs["p"], {"allow-resize": "true",
                                                 "description": "p again"})])
    r = reload(d, "p with allow-resize again")
    nbdtest.require(r.get("changed") == ["p"], "p not changed: %r" % r)
    k = c.request(CMD_RESIZE, 32 * MIB, 0)
    rep = c.read_reply(k)
    expect(rep.error == 0, "NBD_CMD_RESIZE with allow-resize on again: error %d (%s)"
           % (rep.error, raw.err_name(rep.error)))
    expect(os.path.getsize(imgs["p"]) == 32 * MIB, "p.img is %d bytes, not 32 MiB"
           % os.path.getsize(imgs["p"]))
    expect(nbdtest.export_size(d, "p") == 32 * MIB, "p is %d bytes, not 32 MiB"
           % nbdtest.export_size(d, "p"))
    c.close()


def main():
    with nbdtest.tempdir() as tmp:
        imgs = {}
        for i, name in enumerate(("x", "other", "p")):
            imgs[name] = os.path.join(tmp, name + ".img")
            nbdtest.random_file(imgs[name], SIZE, seed=i + 1)
        conf = os.path.join(tmp, "nbdcached.conf")
        keep = [("p", imgs["p"], {"allow-resize": "true"})]
        write_config(conf, keep + [("x", imgs["x"], {"allow-resize": "true"})])
        with nbdtest.running_daemon([], extra=["--config", conf]) as d:
            CHECKS.run("replaced", replaced, d, conf, imgs, keep)
            CHECKS.run("rights", rights, d, conf, imgs, keep)
            CHECKS.dump_log(d)
    CHECKS.finish("resize_reload")


if __name__ == "__main__":
    main()
