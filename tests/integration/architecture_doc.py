#!/usr/bin/python3
"""architecture_doc: docs/architecture.md still matches the sources.

No daemon is started: this reads docs/architecture.md and the C sources.

  - functions: every `name(` inside inline code (`...`) or a fenced code
    block of the document is a citation of a function; each must be
    DEFINED as a function or a function-like macro in some .c or .h file
    under daemon/, proto/, client/ or include/. A man-page reference such
    as `write(2)` (a digit between the parentheses) is not a citation;
    names in plain prose are not checked, which is how the document
    mentions functions of other libraries (libevent, libc) without
    parentheses.

    What counts as a definition (checked on the source text, comments
    included; no preprocessing, no parsing of types):
      * a line that starts in column 0 (not with '#', '{', '}', '/' or
        '*'), made only of identifier characters, blanks and '*' up to
        `name(` -- the return type and qualifiers, possibly empty when
        the type sits on the line before -- whose parenthesised
        parameter list (balanced, possibly over several lines) is
        followed, after blanks, by '{'. That takes static, static inline
        and extern functions alike, and leaves out prototypes (';' after
        the list) and calls (indented, or followed by ';').
      * `#define name(` with no blank before the '(' (a function-like
        macro), at any indentation.
    A function defined with an attribute or a macro between its
    parameter list and its '{', or whose return type holds other
    characters (parentheses: a function returning a function pointer),
    is not recognised; none is cited today.

  - the module map: every backticked path (a token with a '/' or ending
    in .c or .h) in the section whose heading contains "Module map" must
    exist in the repository, and every source file (.c, .h) under
    daemon/, proto/, client/ and include/ must be listed there (a FAILURE
    otherwise: a new or split file means a new row). File names (*.c, *.h)
    appear nowhere else in the document, except in the section whose
    heading contains "Layers", which is about files (it describes the
    layers scripts/check-layers enforces, by their files and patterns);
    so splitting files means updating those two sections only.

Exit 0 when every check passes, 1 listing every failure.
"""

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

DOC = os.path.join(nbdtest.TOP, "docs", "architecture.md")
SOURCE_DIRS = ("daemon", "proto", "client", "include")

CHECKS = nbdtest.Checks()
expect = CHECKS.expect

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CITE = re.compile(r"(?<![A-Za-z0-9_.>])(" + IDENT + r")\((?!\d+\))")
DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(" + IDENT + r")\(", re.M)
# Column 0, a prefix of type words and stars (maybe none), then name(.
DEF_START = re.compile(r"^(?![#{}/*])([A-Za-z_0-9 \t*]*?)(?<![A-Za-z0-9_])(" + IDENT + r")\(",
                       re.M)
FILE_NAME = re.compile(r"(?<![A-Za-z0-9_./-])([A-Za-z0-9_./-]+\.[ch])(?![A-Za-z0-9_])")


def source_files():
    for d in SOURCE_DIRS:
        top = os.path.join(nbdtest.TOP, d)
        for root, _, files in os.walk(top):
            for f in sorted(files):
                if f.endswith((".c", ".h")):
                    yield os.path.join(root, f)


def defined_names(text):
    """Names defined as functions or function-like macros in one file."""
    names = set(DEFINE.findall(text))
    for m in DEF_START.finditer(text):
        prefix, name = m.group(1), m.group(2)
        if prefix.strip() in ("return", "else") or name in ("if", "while", "for", "switch"):
            continue
        # Balanced parameter list from the '(' on, then the next non-blank.
        i = m.end()  # just past '('
        depth = 1
        while i < len(text) and depth:
            if text[i] == "(":
                depth += 1
            elif text[i] == ")":
                depth -= 1
            i += 1
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if i < len(text) and text[i] == "{":
            names.add(name)
    return names


def split_doc(text):
    """(code, sections): the text of inline code spans and fenced blocks,
    and {heading: body} of the level-2 sections."""
    code = []
    prose = []
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            code.append(line)
        else:
            prose.append(line)
            code.extend(re.findall(r"`([^`]+)`", line))
    sections = {}
    heading = ""
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
            sections[heading] = ""
        else:
            sections[heading] = sections.get(heading, "") + line + "\n"
    return code, sections


def check_functions(code):
    cited = []
    for chunk in code:
        for name in CITE.findall(chunk):
            if name not in cited:
                cited.append(name)
    defined = set()
    for path in source_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            defined |= defined_names(f.read())
    missing = [n for n in cited if n not in defined]
    log("%d function(s) cited, %d names defined in %s" % (len(cited), len(defined),
                                                           ", ".join(SOURCE_DIRS)))
    expect(len(cited) >= 50, "only %d functions cited: is the extraction broken?" % len(cited))
    expect(len(defined) >= 500, "only %d definitions found: is the scan broken?" % len(defined))
    expect(not missing, "cited but not defined in %s: %s" % ("/, ".join(SOURCE_DIRS) + "/",
                                                             ", ".join(missing)))
    for n in missing:
        log("  not defined: %s()" % n)


def check_module_map(sections):
    heads = [h for h in sections if "Module map" in h]
    if not expect(len(heads) == 1, "expected one section titled 'Module map', found %r" % heads):
        return
    body = sections[heads[0]]
    listed = []
    for token in re.findall(r"`([^`]+)`", body):
        if "/" in token or FILE_NAME.fullmatch(token):
            if " " not in token and token not in listed:
                listed.append(token)
    log("module map: %d path(s)" % len(listed))
    expect(len(listed) >= 10, "only %d paths in the module map" % len(listed))
    absent = [p for p in listed if not os.path.exists(os.path.join(nbdtest.TOP, p))]
    expect(not absent, "module map cites files that do not exist: %s" % ", ".join(absent))
    for p in absent:
        log("  no such file: %s" % p)
    # File names belong to the module map and the layers section only.
    for head, text in sections.items():
        if head in heads or "Layers" in head:
            continue
        names = sorted(set(FILE_NAME.findall(text)))
        expect(not names, "section %r names files (keep them in the module map): %s"
               % (head or "(preamble)", ", ".join(names)))
    # Every source file has its row.
    unlisted = [os.path.relpath(p, nbdtest.TOP) for p in source_files()
                if os.path.relpath(p, nbdtest.TOP) not in listed]
    expect(not unlisted, "source files not in the module map: %s" % ", ".join(unlisted))
    for p in unlisted:
        log("  not in the module map: %s" % p)


def main():
    if not os.path.exists(DOC):
        nbdtest.fail("%s is missing" % DOC)
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    code, sections = split_doc(text)
    CHECKS.run("functions cited are defined", check_functions, code)
    CHECKS.run("module map", check_module_map, sections)
    CHECKS.finish("architecture_doc")


if __name__ == "__main__":
    main()
