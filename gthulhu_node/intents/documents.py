"""Parsing untrusted YAML and JSON documents at a cost bounded by their size.

Why not `yaml.safe_load` / `json.loads` alone:
- YAML anchors and aliases let a 20 KB file expand into gigabytes (`- &a [...]` then `- *a` thousands of
  times: each alias is a reference, but everything after parsing walks it as a copy). No intent document
  needs them, so they are refused, at the first one, before anything is expanded.
- Deep nesting (`[[[[...]]]]`) makes the recursive parsers raise RecursionError, which callers would not
  expect; no intent document is nested deeper than a handful of levels, so more than `MAX_DEPTH` is
  refused with a clear message.
Error messages give the line and column and the parser's words, never a copy of the offending text:
the text may come from a file the reader was not meant to see.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from gthulhu_node.errors import InvalidInput

# An intent set is {intents: [{nodeSelectors: [{key: ...}]}]}: 4 levels. 32 leaves room for any wrapper.
MAX_DEPTH = 32


class DocumentError(InvalidInput):
    """A document that cannot be used; the message says where and why (without quoting it)."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader without anchors and aliases and with a nesting limit."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        where = f"line {event.start_mark.line + 1}, column {event.start_mark.column + 1}"
        if isinstance(event, yaml.AliasEvent):
            raise DocumentError(f"{where}: YAML aliases (*name) are not allowed in intent documents")
        if getattr(event, "anchor", None) is not None:
            raise DocumentError(f"{where}: YAML anchors (&name) are not allowed in intent documents")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise DocumentError(f"{where}: nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _yaml_error(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        words = "; ".join(w for w in (exc.context, exc.problem) if w)
        return where + (words or "invalid YAML")
    return type(exc).__name__


def load_yaml(text: str) -> Any:
    """One YAML document; raises DocumentError."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except DocumentError:
        raise
    except yaml.YAMLError as exc:
        raise DocumentError(f"not valid YAML: {_yaml_error(exc)}") from None
    except RecursionError:
        raise DocumentError(f"not valid YAML: nested more than {MAX_DEPTH} levels deep") from None
    finally:
        loader.dispose()


def load_json(blob: str | bytes) -> Any:
    """One JSON document, at most MAX_DEPTH levels deep; raises DocumentError."""
    try:
        doc = json.loads(blob)
    except json.JSONDecodeError as exc:
        raise DocumentError(f"not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise DocumentError(f"not valid JSON: not UTF-8 at byte {exc.start}") from None
    except RecursionError:
        raise DocumentError(f"not valid JSON: nested more than {MAX_DEPTH} levels deep") from None
    check_depth(doc)
    return doc


def check_depth(doc: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a parsed document nested deeper than `max_depth` (iteratively: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            raise DocumentError(f"nested more than {max_depth} levels deep")
        stack.extend((child, depth + 1) for child in children)
