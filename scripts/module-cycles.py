#!/usr/bin/env python3
"""Fail when a library crate's top-level modules use each other in a cycle.

For every crate of the workspace, a module A depends on a module B when code (not a
comment) in A's files names `crate::B`, lists B in `crate::{B::X, …}`, or names an item
the crate root re-exports from B (`crate::X` after `pub use B::X`). A cycle (A uses B, B uses A, possibly through
others) means neither module can be read or tested without the other; the cure is
usually one shared type moved into a lower module. Test code (`#[cfg(test)] mod tests`,
`tests.rs`, files under `tests/`) is left out.

Usage: scripts/module-cycles.py   (exit 1 and the cycles when there are any)
"""

from __future__ import annotations

import collections
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def crates() -> list[str]:
    """Folders of the workspace with a `src/` (libraries and binaries alike)."""
    return sorted(
        d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d, "src"))
    )


def group_items(code: str, start: int) -> list[str]:
    """The top-level items of the brace group opening at `code[start]` (`{a::X, b}`)."""
    depth, item, items = 0, "", []
    for ch in code[start:]:
        if ch == "{":
            depth += 1
            if depth == 1:
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                items.append(item)
                break
        if depth == 1 and ch == ",":
            items.append(item)
            item = ""
        else:
            item += ch
    return [i.strip() for i in items if i.strip()]


def root_names(src: str, modules: set[str]) -> dict[str, str]:
    """Names the crate root re-exports (`pub use module::{A, B}`), mapped to their module."""
    path = next(
        (os.path.join(src, f) for f in ("lib.rs", "main.rs") if os.path.exists(os.path.join(src, f))),
        None,
    )
    if path is None:
        return {}
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    names: dict[str, str] = {}
    for match in re.finditer(r"pub use ([a-z_][a-z0-9_]*)::", text):
        module = match.group(1)
        if module not in modules:
            continue
        rest = text[match.end():]
        if rest.startswith("{"):
            listed = group_items(rest, 0)
        else:
            listed = [re.match(r"[A-Za-z0-9_:]+(?: as [A-Za-z0-9_]+)?", rest).group(0)]
        for item in listed:
            name = item.split(" as ")[-1].split("::")[-1].strip()
            names[name] = module
    return names


def used_modules(code: str, modules: set[str], names: dict[str, str]) -> set[str]:
    """Modules that `code` reaches: `crate::m`, `crate::{m::X, …}`, `crate::Name`."""
    used: set[str] = set()

    def first(path: str) -> None:
        head = path.split("::")[0].strip()
        if head in modules:
            used.add(head)
        elif head in names:
            used.add(names[head])

    for match in re.finditer(r"crate::(\{|[A-Za-z_][A-Za-z0-9_]*)", code):
        if match.group(1) == "{":
            for item in group_items(code, match.start(1)):
                first(item)
        else:
            first(match.group(1))
    return used


def edges_of(src: str) -> dict[str, set[str]]:
    modules = {
        name[:-3] if name.endswith(".rs") else name
        for name in os.listdir(src)
        if name not in ("lib.rs", "main.rs")
    }
    names = root_names(src, modules)
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for folder, _, files in os.walk(src):
        for name in files:
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, src)[:-3].split(os.sep)
            if not name.endswith(".rs") or parts[0] in ("lib", "main"):
                continue
            if name == "tests.rs" or "tests" in parts:
                continue
            with open(path, encoding="utf-8") as handle:
                text = re.split(r"#\[cfg\(test\)\]\s*mod tests", handle.read())[0]
            code = "\n".join(
                line for line in text.split("\n") if not line.strip().startswith("//")
            )
            edges[parts[0]] |= used_modules(code, modules, names) - {parts[0]}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    bad = 0
    for crate in crates():
        edges = edges_of(os.path.join(ROOT, crate, "src"))
        for component in cycles(edges):
            bad += 1
            uses = "; ".join(
                f"{a} uses {', '.join(sorted(edges[a] & set(component)))}" for a in component
            )
            print(f"{crate}: modules in a cycle: {uses}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
