#!/usr/bin/env python3
"""List Rust functions longer than a limit in the workspace's library code.

Scans `*/src/**/*.rs` under the workspace root and prints one line per
function longer than the limit, `path:line name length`, shortest first.
A function's length runs from the line holding its `fn` keyword to the line
of its closing brace, both included.

Left out, because length there is not a readability problem we police:
`#[cfg(test)]` items (test modules above all), files named `tests.rs` or
under a `tests/` directory, files a `#[cfg(test)] mod x;` pulls in, and
generated code (anything under `target/`; proto's generated output lives in
`OUT_DIR`, so under `target/` too).

Exit status: 1 when some listed function lacks a reason, that is a `///`
doc-comment line containing `long:` among the comments and attributes right
above it; 0 otherwise. Functions with a reason are still listed, marked
`(long: given)`, so they stay visible.

Usage: scripts/long-fns.py [--max N] [--root DIR] [PATH ...]
PATH (files or directories) narrows the scan; the default is the whole
workspace.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

IDENT = re.compile(r"[A-Za-z0-9_]")


def blank_literals(src: str) -> str:
    """Return `src` with comments, string and char literals replaced by spaces.

    Newlines are kept, so offsets and line numbers still match the original.
    Braces inside literals and comments thus stop counting.
    """
    out = list(src)
    n = len(src)
    i = 0

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        nxt = src[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c in "rbc" and (i == 0 or not IDENT.match(src[i - 1])):
            # Raw strings r"..", r#".."#, br"..", cr"..", and b".." / c"..".
            m = re.compile(r'(?:br|cr|r)(#*)"|[bc]"').match(src, i)
            if not m:
                i += 1
                continue
            if m.group(0).endswith('"') and m.group(1) is not None:
                close = '"' + m.group(1)
                j = src.find(close, m.end())
                j = n if j < 0 else j + len(close)
            else:
                j = end_of_string(src, m.end())
            blank(i, j)
            i = j
        elif c == '"':
            j = end_of_string(src, i + 1)
            blank(i, j)
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if nxt == "\\":
                j = src.find("'", i + 3)
                j = n if j < 0 else j + 1
                blank(i, j)
                i = j
            elif i + 2 < n and src[i + 2] == "'":
                blank(i, i + 3)
                i += 3
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def end_of_string(src: str, j: int) -> int:
    """Offset just past the closing quote of a string whose body starts at j."""
    n = len(src)
    while j < n:
        if src[j] == "\\":
            j += 2
        elif src[j] == '"':
            return j + 1
        else:
            j += 1
    return n


def matching_brace(clean: str, open_at: int) -> int:
    """Offset of the `}` matching the `{` at open_at (or len on imbalance)."""
    depth = 0
    for k in range(open_at, len(clean)):
        if clean[k] == "{":
            depth += 1
        elif clean[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(clean)


def item_body(clean: str, start: int) -> tuple[int, int] | None:
    """The body `{`..`}` of the item starting at `start`, or None for `;`.

    Skips over parentheses and brackets, so `-> [u8; 4]` is not an end.
    """
    depth = 0
    for k in range(start, len(clean)):
        ch = clean[k]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0 and ch == ";":
            return None
        elif depth == 0 and ch == "{":
            return k, matching_brace(clean, k)
    return None


CFG_TEST = re.compile(r"#\[cfg\((?![^\]]*\bnot\s*\()[^\]]*\btest\b[^\]]*\)\]")
TEST_MOD_FILE = re.compile(
    r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;"
)
FN = re.compile(r"\bfn\s+(?:r#)?([A-Za-z_]\w*)")


def test_ranges(clean: str) -> list[tuple[int, int]]:
    """Offset ranges of `#[cfg(test)]` items that have a body."""
    ranges = []
    for m in CFG_TEST.finditer(clean):
        body = item_body(clean, m.end())
        if body:
            ranges.append((m.start(), body[1]))
    return ranges


def has_reason(lines: list[str], fn_line: int) -> bool:
    """Whether the doc comments right above line fn_line (0-based) say `long:`."""
    k = fn_line - 1
    while k >= 0:
        s = lines[k].strip()
        if s.startswith("///") or s.startswith("#[") or s.startswith("#!["):
            if s.startswith("///") and "long:" in s:
                return True
            k -= 1
        elif s.startswith("//") or (s and not s.startswith("pub") and s.endswith("]")):
            # Plain comments and the tail of a multi-line attribute.
            k -= 1
        else:
            return False
    return False


def scan_file(path: str, limit: int) -> list[tuple[str, int, str, int, bool]]:
    with open(path, encoding="utf-8") as f:
        src = f.read()
    clean = blank_literals(src)
    lines = src.split("\n")
    skip = test_ranges(clean)
    found = []
    for m in FN.finditer(clean):
        if any(a <= m.start() <= b for a, b in skip):
            continue
        body = item_body(clean, m.end())
        if not body:
            continue
        first = clean.count("\n", 0, m.start())
        last = clean.count("\n", 0, body[1])
        length = last - first + 1
        if length > limit:
            found.append((path, first + 1, m.group(1), length, has_reason(lines, first)))
    return found


def test_module_files(path: str, clean: str) -> set[str]:
    """Files that `#[cfg(test)] mod x;` declarations in `path` pull in."""
    base, name = os.path.split(path)
    if name not in ("lib.rs", "main.rs", "mod.rs"):
        base = os.path.join(base, name[:-3])
    out = set()
    for m in TEST_MOD_FILE.finditer(clean):
        out.add(os.path.normpath(os.path.join(base, m.group(1) + ".rs")))
        out.add(os.path.normpath(os.path.join(base, m.group(1), "mod.rs")))
    return out


def rust_files(root: str, paths: list[str]) -> list[str]:
    """The workspace's `*/src/**/*.rs` files (under `paths` when given)."""
    files = []
    for top in sorted(os.listdir(root)):
        src = os.path.join(root, top, "src")
        if top == "target" or top.startswith(".") or not os.path.isdir(src):
            continue
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = sorted(d for d in dirnames if d not in ("tests", "target"))
            for name in sorted(filenames):
                if name.endswith(".rs") and name != "tests.rs":
                    files.append(os.path.join(dirpath, name))
    if paths:
        wanted = [os.path.abspath(p) for p in paths]
        files = [
            f
            for f in files
            if any(os.path.abspath(f) == w or os.path.abspath(f).startswith(w + os.sep) for w in wanted)
        ]
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max", type=int, default=80, help="longest allowed function, in lines")
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("paths", nargs="*", help="files or directories to narrow the scan to")
    args = ap.parse_args()
    root = os.path.normpath(args.root)
    files = rust_files(root, args.paths)
    excluded: set[str] = set()
    for f in files:
        with open(f, encoding="utf-8") as fh:
            excluded |= test_module_files(f, blank_literals(fh.read()))
    found = []
    for f in files:
        if os.path.normpath(f) not in excluded:
            found.extend(scan_file(f, args.max))
    found.sort(key=lambda r: (r[3], r[0], r[1]))
    bad = 0
    for path, line, name, length, reason in found:
        rel = os.path.relpath(path, root)
        print(f"{rel}:{line} {name} {length}" + ("  (long: given)" if reason else ""))
        bad += not reason
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
