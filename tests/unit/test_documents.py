"""The documents' decoding boundary (intents/documents.py): every hostile document is a DocumentError
naming where and why, never another exception; ordinary YAML reads as PyYAML's SafeLoader reads it."""

from __future__ import annotations

import contextlib
import json
import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gthulhu_node.intents.documents import (
    INT_TEXT_MAX,
    DocumentError,
    Limits,
    check_size,
    load_json,
    load_yaml,
)

# (document, words the refusal says). Each one raised something other than DocumentError before
# (ReaderError, ValueError of Python's int-digit limit) or was accepted (surrogates, NaN, tags, merges).
HOSTILE_YAML = [
    ("id: a\x00\ncommandRegex: x\n", "line 1, column 6: character #x0000 is not allowed"),
    ("# \x1b[31m red\nid: a\n", "line 1, column 3: character #x001b is not allowed"),
    ("priority: " + "9" * 5000 + "\n",
     f"line 1, column 11: an integer of 5000 characters, at most {INT_TEXT_MAX}"),
    ("priority: 0x" + "f" * 5000 + "\n", "an integer of 5002 characters"),
    ("priority: 1" + ":59" * 2000 + "\n", "an integer of 6001 characters"),
    ('id: "\\ud800"\n', "line 1, column 8"),
    ("a: 1\n<<: {b: 2}\n", "line 2, column 1: YAML merge keys (<<) are not allowed"),
    ("a: !!python/object/apply:os.system [true]\n", "the YAML tag tag:yaml.org,2002:python/object/apply:os"),
    ("a: !!binary aGVsbG8=\n", "the YAML tag tag:yaml.org,2002:binary is not allowed"),
    ("a: 1\n---\nb: 2\n", "line 2, column 1: expected a single document"),
    ("? [a]\n: 1\n", "a key must be a plain value"),
    ("- &a x\n- *a\n", "YAML anchors (&name) are not allowed"),
    ("[" * 40 + "]" * 40, "nested more than 32 levels deep"),
]
HOSTILE_JSON = [
    ('{"priority": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
    ('{"policies": [{"policyID": "x\\ud800"}]}', "policies[0].policyID: not valid Unicode text"),
    ('{"\\udc00": 1}', "<key>: not valid Unicode text"),
    ('{"priority": NaN}', "NaN is not a JSON number"),
    ('{"priority": -Infinity}', "-Infinity is not a JSON number"),
    ('{"id": "a\x00"}', "line 1, column 10: Invalid control character"),
    (b'{"id": "\xff"}', "not UTF-8 at byte 8"),
    ("[" * 100_000 + "]" * 100_000, "nested more than 32 levels deep"),
]


@pytest.mark.parametrize(("text", "words"), HOSTILE_YAML, ids=range(len(HOSTILE_YAML)))
def test_hostile_yaml_is_refused_naming_where(text: str, words: str) -> None:
    with pytest.raises(DocumentError) as caught:
        load_yaml(text)
    assert words in str(caught.value)


@pytest.mark.parametrize(("blob", "words"), HOSTILE_JSON, ids=range(len(HOSTILE_JSON)))
def test_hostile_json_is_refused_naming_where(blob: str | bytes, words: str) -> None:
    with pytest.raises(DocumentError) as caught:
        load_json(blob)
    assert words in str(caught.value)


@pytest.mark.parametrize("load", [load_yaml, load_json])
def test_limits_refuse_while_parsing(load: object) -> None:
    """Past a limit the document is refused at the value that crosses it, naming the limit."""
    small = Limits(items=10, nodes=50, scalar_chars=8)
    assert callable(load)
    with pytest.raises(DocumentError, match="a list of more than 10 items"):
        load("[" + ",".join("1" * 11) + "]", small)
    with pytest.raises(DocumentError, match="a mapping of more than 10 keys"):
        load("{" + ",".join(f'"k{i}": 1' for i in range(11)) + "}", small)
    with pytest.raises(DocumentError, match="more than 50 values in the document"):
        load("[" + ",".join("[1,1,1,1]" for _ in range(10)) + "]", small)
    with pytest.raises(DocumentError, match="a value of 9 characters, at most 8"):
        load('["123456789"]', small)
    assert load('{"a": [1, "12345678"]}', small) == {"a": [1, "12345678"]}


def test_ordinary_yaml_reads_as_safe_load_reads_it() -> None:
    text = ("a: [1, 0x10, 0o7, 1_000, 1:30, -5, 1.5, .inf, yes, no, On, ~, null, '', 2001-12-14, !!str 5, "
            "!!int '7', \"q\", 'it''s']\nb: {c: d, 'e f': [g]}\nc: |\n  two\n  lines\n")
    assert load_yaml(text) == yaml.safe_load(text)
    assert load_yaml("") is None and load_yaml("# only a comment\n") is None


# -- property-based: the parsers against random input ---------------------------------------------------

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=400))
def test_random_bytes_are_a_document_or_a_document_error(blob: bytes) -> None:
    for load in (lambda b: load_json(b), lambda b: load_yaml(b.decode("utf-8", "surrogateescape"))):
        with contextlib.suppress(DocumentError):
            load(blob)


@FAST
@given(st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=300))
def test_random_unicode_with_surrogates_is_a_document_or_a_document_error(text: str) -> None:
    """Any code point, surrogates included, in raw text and in escapes."""
    escaped = json.dumps(text)  # ensure_ascii: surrogates become \\udxxx escapes
    for load, doc in ((load_json, text), (load_json, '{"a": ' + escaped + "}"), (load_yaml, text),
                      (load_yaml, "a: " + escaped + "\n")):
        try:
            value = load(doc)
        except DocumentError:
            continue
        json.dumps(value, ensure_ascii=False, default=str).encode()  # what was accepted can be stored


@FAST
@given(st.text("0123456789", min_size=1, max_size=6000), st.sampled_from(["", "-", "+", "0x", "0b"]))
def test_huge_integers_are_range_checked_before_conversion(digits: str, prefix: str) -> None:
    """Python refuses to convert more than 4,300 digits; nothing past INT_TEXT_MAX characters is
    converted at all (YAML reads `0b9` or `+12` as other things than integers: then they are strings)."""
    text = prefix + digits
    for load, doc in ((load_yaml, f"priority: {text}\n"), (load_json, f'{{"priority": {text}}}')):
        try:
            got = load(doc)
        except DocumentError:
            continue
        assert isinstance(got["priority"], str | float) or len(text) <= INT_TEXT_MAX


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64) | st.text(string.printable, max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(string.ascii_letters, max_size=8),
                                                                 inner, max_size=6),
    max_leaves=60,
)


@FAST
@given(JSONISH, st.integers(min_value=1, max_value=60))
def test_deep_and_wide_structures_obey_the_limits(doc: object, depth: int) -> None:
    """What both parsers accept is the document (YAML as SafeLoader reads it); what they refuse is past
    a limit, and check_size, walking the parsed value, agrees."""
    nested: object = doc
    for _ in range(depth):
        nested = [nested]
    limits = Limits(items=5, nodes=200)
    within = True
    try:
        check_size(nested, limits)
    except DocumentError:
        within = False
    for load, text in ((load_json, json.dumps(nested)), (load_yaml, yaml.safe_dump(nested))):
        try:
            got = load(text, limits)
        except DocumentError:
            assert not within
            continue
        assert within and got == nested
