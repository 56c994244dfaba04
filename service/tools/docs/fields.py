"""The comments that document a class's fields in its source: the comment lines right above a
field (`#:` or `#`) and a `# ...` at the end of its line. Called by the config and event pages,
whose Structs carry their documentation that way (msgspec fields have no docstrings)."""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize


def field_comments(cls: type) -> dict[str, str]:
    """Each documented field of `cls` and of the classes it inherits from, by name (the class
    nearest `cls` wins, as for the field itself)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue  # builtins and msgspec's own bases have no source to read
        out.update(_own_comments(source))
    return out


def _own_comments(source: str) -> dict[str, str]:
    lines = source.splitlines()
    trailing = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip()[:1] != "#"
    }
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 2
        while row >= 0 and lines[row].lstrip().startswith("#"):
            above.insert(0, lines[row].lstrip().removeprefix("#:").removeprefix("#").strip())
            row -= 1
        text = " ".join([*above, trailing.get(node.lineno, "")]).strip()
        if text:
            out[node.target.id] = text
    return out


def own_doc(cls: type) -> str:
    """`cls`'s own docstring on one line, or "" (never one it inherits: msgspec's `Struct` has a
    long one)."""
    doc = cls.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split()) if doc else ""
