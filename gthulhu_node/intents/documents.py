"""Parsing untrusted YAML and JSON documents at a cost bounded by their size, with one kind of error.

This module is the decoding boundary of every document input (policy files, REST bodies, the CLI's
`apply -f`, the state directory): whatever goes wrong while reading a document is a DocumentError whose
message says where and why, never another exception escaping to a loop, a route or start-up.

Why not `yaml.safe_load` / `json.loads` alone:
- YAML anchors and aliases let a 20 KB file expand into gigabytes (`- &a [...]` then `- *a` thousands of
  times: each alias is a reference, but everything after parsing walks it as a copy). No intent document
  needs them, so they are refused, at the first one, before anything is expanded (merge keys, `<<`, with
  them: they exist to copy).
- Size is limited while parsing, not after: nesting (`Limits.depth`), the items of one list or mapping
  (`Limits.items`), all values together (`Limits.nodes`) and one string's length (`Limits.scalar_chars`).
  YAML is built from libyaml's event stream by a small constructor here, so a 100,000-item file is refused
  at the item past the cap, long before PyYAML's node graph (~10 us and ~2 KB a node) would have been built
  for the whole file. JSON is parsed by the C decoder (fast) and then checked without recursion.
- Integers are range-checked on their text before conversion: Python refuses to convert more than 4,300
  digits (a ValueError nobody expects from a parser), and no intent field needs more than 20.
- Text that UTF-8 cannot hold (a lone surrogate, `"\\ud800"`, which JSON's and YAML's escapes can write) is
  refused naming the field: it could be neither stored, nor hashed, nor served.
- libyaml refuses control characters (NUL, ESC, even in a comment) as PyYAML's reader does; that error,
  like every other, names the line and column.
Error messages give the line and column and the parser's words, never a copy of the offending text:
the text may come from a file the reader was not meant to see.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import ScalarNode
from yaml.resolver import Resolver

from gthulhu_node.errors import InvalidInput

# An intent set is {intents: [{nodeSelectors: [{key: ...}]}]}: 4 levels. 32 leaves room for any wrapper.
MAX_DEPTH = 32
# The longest integer text read: uint64 needs 20 digits, an int64 with its sign 20 characters.
INT_TEXT_MAX = 24


@dataclass(frozen=True, slots=True)
class Limits:
    """How much one document may hold; the first value past a limit refuses it."""

    depth: int = MAX_DEPTH
    # items of one list or mapping: 10,000 intents per source (api.max_intents_per_source) leave room for
    # a body's own words (translate.py and the store name that cap precisely)
    items: int = 100_000
    # every list, mapping and scalar together: a full 10,000-intent push is ~70,000; building 250,000
    # YAML values costs ~0.7 s of CPU on the team machine (tests/bench/test_document_bench.py)
    nodes: int = 250_000
    # one string: intent fields are at most a few KB (REST's commandRegex field: 4 KiB)
    scalar_chars: int = 64 << 10


# Documents from people and peers: policy files, REST bodies, `apply -f`.
DOCUMENT_LIMITS = Limits()
# The agent's own state files (root-only directory, written by it): up to 64 sources of 10,000 intents.
STATE_LIMITS = Limits(items=1_000_000, nodes=50_000_000, scalar_chars=1 << 20)


class DocumentError(InvalidInput):
    """A document that cannot be used; the message says where and why (without quoting it)."""


# -- YAML ---------------------------------------------------------------------------------------------

_RESOLVER = Resolver()
_CONSTRUCT = SafeConstructor()
_STR, _INT, _FLOAT, _BOOL, _NULL, _TIMESTAMP, _MERGE = (
    f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "timestamp", "merge")
)
_SEQ, _MAP = "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map"
# SafeConstructor's own conversions, called directly (its construct_object keeps every node it made)
_SCALARS = {_INT: _CONSTRUCT.construct_yaml_int, _FLOAT: _CONSTRUCT.construct_yaml_float,
            _BOOL: _CONSTRUCT.construct_yaml_bool, _TIMESTAMP: _CONSTRUCT.construct_yaml_timestamp}


def _where(event: Any) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _Builder:
    """Python values from a YAML event stream, under `Limits`. One document, YAML 1.1 core types (what
    SafeLoader gives for the same text), no anchors, aliases, merge keys or other tags."""

    def __init__(self, events: Iterator[Any], limits: Limits) -> None:
        self._events = events
        self._limits = limits
        self._nodes = 0

    def document(self) -> Any:
        """The stream's single document (None when empty); DocumentError for anything else."""
        event = next(self._events)  # StreamStart
        event = next(self._events)
        if isinstance(event, yaml.StreamEndEvent):
            return None
        value = self._value(next(self._events), 1)
        next(self._events)  # DocumentEnd
        event = next(self._events)
        if not isinstance(event, yaml.StreamEndEvent):
            raise DocumentError(f"{_where(event)}: expected a single document, found another one")
        return value

    def _count(self, event: Any, depth: int) -> None:
        self._nodes += 1
        if self._nodes > self._limits.nodes:
            raise DocumentError(f"{_where(event)}: more than {self._limits.nodes} values in the document")
        if depth > self._limits.depth and not isinstance(event, yaml.ScalarEvent):
            raise DocumentError(f"{_where(event)}: nested more than {self._limits.depth} levels deep")
        if isinstance(event, yaml.AliasEvent):
            raise DocumentError(f"{_where(event)}: YAML aliases (*name) are not allowed in intent documents")
        if event.anchor is not None:
            raise DocumentError(f"{_where(event)}: YAML anchors (&name) are not allowed in intent documents")

    def _value(self, event: Any, depth: int) -> Any:
        self._count(event, depth)
        if isinstance(event, yaml.ScalarEvent):
            return self._scalar(event)
        tag = event.tag
        if isinstance(event, yaml.SequenceStartEvent):
            if tag not in (None, "!", _SEQ):
                raise _tag_refused(event)
            items: list[Any] = []
            while not isinstance(event := next(self._events), yaml.SequenceEndEvent):
                if len(items) >= self._limits.items:
                    raise DocumentError(f"{_where(event)}: a list of more than {self._limits.items} items")
                items.append(self._value(event, depth + 1))
            return items
        if isinstance(event, yaml.MappingStartEvent):
            if tag not in (None, "!", _MAP):
                raise _tag_refused(event)
            out: dict[Any, Any] = {}
            while not isinstance(key_event := next(self._events), yaml.MappingEndEvent):
                if len(out) >= self._limits.items:
                    raise DocumentError(f"{_where(key_event)}: a mapping of more than {self._limits.items} "
                                        "keys")
                if not isinstance(key_event, yaml.ScalarEvent):
                    raise DocumentError(f"{_where(key_event)}: a key must be a plain value, not a list or "
                                        "mapping")
                if key_event.implicit[0] and key_event.tag is None and key_event.value == "<<":
                    raise DocumentError(f"{_where(key_event)}: YAML merge keys (<<) are not allowed in "
                                        "intent documents")
                key = self._value(key_event, depth + 1)
                out[key] = self._value(next(self._events), depth + 1)
            return out
        raise DocumentError(f"{_where(event)}: unexpected YAML event")  # pragma: no cover (libyaml's order)

    def _scalar(self, event: Any) -> Any:
        value: str = event.value
        if len(value) > self._limits.scalar_chars:
            raise DocumentError(f"{_where(event)}: a value of {len(value)} characters, at most "
                                f"{self._limits.scalar_chars}")
        tag = event.tag
        if tag is None or tag == "!":
            tag = _RESOLVER.resolve(ScalarNode, value, event.implicit) if tag is None else _STR  # type: ignore[no-untyped-call]
        if tag == _STR:
            return value
        if tag == _NULL:
            return None
        construct = _SCALARS.get(tag)
        if construct is None:
            raise _tag_refused(event, tag)
        if tag == _INT and len(value) > INT_TEXT_MAX:
            raise DocumentError(f"{_where(event)}: an integer of {len(value)} characters, at most "
                                f"{INT_TEXT_MAX} are read")
        try:
            return construct(ScalarNode(tag, value, event.start_mark, event.end_mark))
        except (ValueError, TypeError, yaml.YAMLError) as exc:
            raise DocumentError(f"{_where(event)}: not a valid {tag.rsplit(':', 1)[-1]}: "
                                f"{type(exc).__name__}") from None


def _tag_refused(event: Any, tag: str | None = None) -> DocumentError:
    return DocumentError(f"{_where(event)}: the YAML tag {tag or event.tag} is not allowed in intent "
                         "documents")


def _yaml_error(exc: yaml.YAMLError, text: str) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        words = "; ".join(w for w in (exc.context, exc.problem) if w)
        return where + (words or "invalid YAML")
    if isinstance(exc, yaml.reader.ReaderError):  # a control character, or bytes that are not UTF-8
        char = exc.character
        what = f"character #x{char:04x}" if isinstance(char, int) else "a character"
        before = text.encode(errors="replace")[: exc.position]  # libyaml counts bytes of UTF-8
        line, column = before.count(b"\n") + 1, exc.position - before.rfind(b"\n")
        return f"line {line}, column {column}: {what} is not allowed ({exc.reason})"
    return type(exc).__name__


def load_yaml(text: str, limits: Limits = DOCUMENT_LIMITS) -> Any:
    """One YAML document; raises DocumentError (and nothing else)."""
    loader = None
    try:
        loader = yaml.CSafeLoader(text)  # encodes the text: a lone surrogate fails here already
        doc = _Builder(_events(loader), limits).document()
    except DocumentError:
        raise
    except yaml.YAMLError as exc:
        raise DocumentError(f"not valid YAML: {_yaml_error(exc, text)}") from None
    except UnicodeEncodeError as exc:
        raise DocumentError(f"not valid YAML: character {exc.start} is not valid Unicode text (a lone "
                            "surrogate)") from None
    except (StopIteration, ValueError, TypeError, RecursionError, MemoryError) as exc:
        raise DocumentError(f"not valid YAML: {type(exc).__name__}") from None
    finally:
        if loader is not None:
            loader.dispose()
    _check_text(text, doc, _YAML_SURROGATE)
    return doc


def _events(loader: Any) -> Iterator[Any]:
    while loader.check_event():
        yield loader.get_event()


# -- JSON ---------------------------------------------------------------------------------------------


def _json_int(text: str) -> int:
    if len(text) > INT_TEXT_MAX:
        raise DocumentError(f"not valid JSON: an integer of {len(text)} digits, at most {INT_TEXT_MAX} are "
                            "read")
    return int(text)


def _json_constant(name: str) -> Any:
    raise DocumentError(f"not valid JSON: {name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_int=_json_int, parse_constant=_json_constant)


def load_json(blob: str | bytes, limits: Limits = DOCUMENT_LIMITS) -> Any:
    """One JSON document within `limits`; raises DocumentError (and nothing else)."""
    try:
        text = blob.decode("utf-8") if isinstance(blob, bytes) else blob
        # Every value but the first follows a comma or an opening bracket: an upper bound of the values,
        # counted in C before the decoder builds them all (4 MB of `[1,1,1],` would take 54 MB).
        most = text.count(",") + text.count("[") + text.count("{") + 1
        if most > limits.nodes and _count_values(text) > limits.nodes:
            raise DocumentError(f"more than {limits.nodes} values in the document")
        doc = _DECODER.decode(text)
    except DocumentError:
        raise
    except json.JSONDecodeError as exc:
        raise DocumentError(f"not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise DocumentError(f"not valid JSON: not UTF-8 at byte {exc.start}") from None
    except RecursionError:
        raise DocumentError(f"not valid JSON: nested more than {limits.depth} levels deep") from None
    except (ValueError, TypeError, MemoryError) as exc:
        raise DocumentError(f"not valid JSON: {type(exc).__name__}") from None
    check_size(doc, limits)
    _check_text(text, doc, _JSON_SURROGATE)
    return doc


def _count_values(text: str) -> int:
    """The values of a JSON text, without building them: commas and opening brackets outside strings
    (+1). Only called when the cheap bound is over the limit (a body of many commas in its strings)."""
    outside = _JSON_STRING.sub('""', text)
    return outside.count(",") + outside.count("[") + outside.count("{") + 1


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def check_depth(doc: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a parsed document nested deeper than `max_depth` (iteratively: no recursion to exhaust)."""
    check_size(doc, Limits(depth=max_depth, items=2**62, nodes=2**62, scalar_chars=2**62))


def check_size(doc: Any, limits: Limits) -> None:
    """Refuse a parsed document past `limits` (iteratively: no recursion to exhaust). A collection past
    `items` is refused by its length, before anything in it is visited, so the walk costs at most
    `limits.nodes` steps whatever the document."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > limits.nodes:
            raise DocumentError(f"more than {limits.nodes} values in the document")
        if isinstance(node, str):
            if len(node) > limits.scalar_chars:
                raise DocumentError(f"a value of {len(node)} characters, at most {limits.scalar_chars}")
            continue
        if isinstance(node, dict):
            children: Any = node.values()
            what = "a mapping of more than {} keys"
        elif isinstance(node, list):
            children = node
            what = "a list of more than {} items"
        else:
            continue
        if depth > limits.depth:
            raise DocumentError(f"nested more than {limits.depth} levels deep")
        if len(children) > limits.items:
            raise DocumentError(what.format(limits.items))
        if isinstance(node, dict):
            stack.extend((key, depth + 1) for key in node)
        stack.extend((child, depth + 1) for child in children)


# -- text that UTF-8 cannot hold ----------------------------------------------------------------------

# Escapes that can write a surrogate code point; decoded UTF-8 never holds one, so a document whose text
# has none of these cannot hold one either, and only the rare one that does is walked.
_JSON_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_YAML_SURROGATE = re.compile(r"\\(?:u[dD][89a-fA-F]|U0000[dD][89a-fA-F])")


def _check_text(text: str, doc: Any, escapes: re.Pattern[str]) -> None:
    if not escapes.search(text) and utf8_ok(text):
        return
    where = unencodable_path(doc)
    if where is not None:
        raise DocumentError(f"{where or 'the document'}: not valid Unicode text (a lone surrogate such as "
                            "\\ud800)")


def utf8_ok(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def unencodable_path(doc: Any, prefix: str = "") -> str | None:
    """The path (`intents[2].commandRegex`) of the first string, key or value, in `doc` that cannot be
    encoded as UTF-8; None when there is none. Iterative: no recursion to exhaust."""
    stack: list[tuple[Any, str]] = [(doc, prefix)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not utf8_ok(node):
                return path
        elif isinstance(node, Mapping):
            for key in node:
                if isinstance(key, str) and not utf8_ok(key):
                    return f"{path}.<key>" if path else "<key>"
            stack.extend((value, f"{path}.{key}" if path else str(key))
                         for key, value in reversed(list(node.items())))
        elif isinstance(node, list | tuple):
            stack.extend((item, f"{path}[{n}]") for n, item in reversed(list(enumerate(node))))
    return None
