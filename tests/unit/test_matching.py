"""Matching: RE2 unanchored search on comm and docs/watching.md's precedence, rule by rule."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from gthulhu_node import matching
from gthulhu_node.intents.model import Intent
from gthulhu_node.matching import PolicySet, normalize_pod_uid, pod_uid_of, precedence_rank

VLLM = "^EngineCore(_DP[0-9]+)?$"


def intent(id: str, regex: str = VLLM, priority: int = 10, slice_ns: int = 0, **kw: Any) -> Intent:
    return Intent.model_validate(
        {"id": id, "commandRegex": regex, "priority": priority, "executionTime": slice_ns, **kw}
    )


def winner_key(ps: PolicySet, comm: str) -> str | None:
    w = ps.winner(comm)
    return None if w is None else w.key


@pytest.mark.parametrize(
    ("comm", "matches"),
    [
        ("EngineCore", True),
        ("EngineCore_DP0", True),
        ("EngineCore_DP12", True),
        ("python3.12", False),  # the process's own name: the pattern names worker threads
        ("EngineCore_DPx", False),
        ("xEngineCore", False),
        ("EngineCore_DP0 ", False),
    ],
)
def test_vllm_pattern_on_comm(comm: str, matches: bool) -> None:
    ps = PolicySet.build([("local/vllm", intent("vllm"))])
    assert (winner_key(ps, comm) == "local/vllm") is matches


def test_search_is_unanchored() -> None:
    ps = PolicySet.build([("local/core", intent("core", "Core"))])
    assert winner_key(ps, "EngineCore_DP0") == "local/core"
    assert winner_key(ps, "CoreWorker") == "local/core"
    assert winner_key(ps, "core") is None  # case-sensitive, like upstream


def test_stronger_priority_wins() -> None:
    """Upstream's scale (issue 39): the lower number is the stronger; before, 6 won over 5."""
    ps = PolicySet.build(
        [("a/weak", intent("weak", priority=6, slice_ns=50_000)), ("b/strong", intent("strong", priority=5))]
    )
    assert winner_key(ps, "EngineCore") == "b/strong"
    no_boost = PolicySet.build([("a/none", intent("none", priority=0, slice_ns=50_000)),
                                ("b/weakest", intent("weakest", priority=20))])
    assert winner_key(no_boost, "EngineCore") == "b/weakest"


def test_equal_priority_smaller_nonzero_slice_wins() -> None:
    ps = PolicySet.build(
        [
            ("a/zero", intent("zero", priority=5, slice_ns=0)),
            ("b/big", intent("big", priority=5, slice_ns=4_000_000)),
            ("c/small", intent("small", priority=5, slice_ns=1_000_000)),
        ]
    )
    assert winner_key(ps, "EngineCore") == "c/small"


def test_nonzero_slice_beats_default_slice() -> None:
    ps = PolicySet.build(
        [
            ("a/zero", intent("zero", priority=5)),
            ("z/slice", intent("slice", priority=5, slice_ns=1_000_000_000)),
        ]
    )
    assert winner_key(ps, "EngineCore") == "z/slice"


def test_full_tie_smaller_source_id_wins() -> None:
    ps = PolicySet.build([("manager/b", intent("b")), ("local/z", intent("z")), ("manager/a", intent("a"))])
    assert winner_key(ps, "EngineCore") == "local/z"


def test_result_does_not_depend_on_input_order() -> None:
    items = [
        ("a/1", intent("1", priority=3, slice_ns=100_000)),
        ("b/2", intent("2", priority=3, slice_ns=100_000)),
        ("c/3", intent("3", priority=3)),
        ("d/4", intent("4", priority=4, slice_ns=50_000)),  # weaker than 3
    ]
    winners = {winner_key(PolicySet.build(perm), "EngineCore") for perm in itertools.permutations(items)}
    assert winners == {"a/1"}


def test_match_lists_every_candidate_by_scope_strongest_first() -> None:
    ps = PolicySet.build(
        [
            ("a/t1", intent("t1", priority=9)),
            ("a/t2", intent("t2", priority=1)),
            ("a/p", intent("p", "Engine", priority=4, scope="process")),
            ("a/other", intent("other", "^worker$")),
        ]
    )
    m = ps.match("EngineCore_DP1")
    assert [c.key for c in m.thread] == ["a/t2", "a/t1"]
    assert [c.key for c in m.process] == ["a/p"]
    assert ps.match("EngineCore_DP1") is m  # cached per comm
    assert not ps.match("python3.12").any


def test_noop_intent_matches_but_loses_to_any_strategy() -> None:
    ps = PolicySet.build(
        [("a/noop", intent("noop", priority=0)), ("z/slice", intent("slice", priority=0, slice_ns=60_000))]
    )
    assert winner_key(ps, "EngineCore") == "z/slice"
    only = PolicySet.build([("a/noop", intent("noop", priority=0))])
    w = only.winner("EngineCore")
    assert w is not None and w.is_noop


def test_rank_orders_exactly_as_the_contract() -> None:
    assert precedence_rank("b/x", intent("x", priority=1)) < precedence_rank("a/x", intent("x", priority=2))
    assert precedence_rank("b/x", intent("x", priority=1, slice_ns=50_000)) < precedence_rank(
        "a/x", intent("x", priority=1)
    )


@pytest.mark.parametrize(
    ("regex", "message"),
    [
        ("(", "not valid RE2 syntax"),
        ("a(?=b)", "not valid RE2 syntax"),  # lookahead: not RE2
        ("x" * 257, "257 bytes, at most 256"),
        ("", "empty"),
        ("((a{100}){100}){100}", "not valid RE2 syntax"),  # program too large for RE2's memory bound
    ],
)
def test_invalid_patterns_refused_at_validation(regex: str, message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        intent("bad", regex)
    assert message in str(exc.value)
    assert "commandRegex" in str(exc.value) or "command_regex" in str(exc.value)


def test_duplicate_keys_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        PolicySet.build([("a/x", intent("x")), ("a/x", intent("x"))])


def test_pod_uid_from_cgroup_both_drivers() -> None:
    uid = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    systemd = (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        "kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-abc.scope\n"
    )
    cgroupfs = f"0::/kubepods/besteffort/pod{uid}/0123456789abcdef\n"
    assert pod_uid_of(systemd) == normalize_pod_uid(uid)
    assert pod_uid_of(cgroupfs) == normalize_pod_uid(uid)
    assert pod_uid_of("0::/user.slice/user-0.slice/session-1.scope\n") is None


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("^EngineCore_DP1000000$", "needs at least 20 characters, but a thread name (comm) has at most 15"),
        ("a\x00b", "contains NUL"),
        (r"worker\x00", "contains NUL"),
    ],
)
def test_patterns_that_can_never_match_a_comm_are_warned_about(pattern: str, words: str) -> None:
    """They used to be accepted without a word."""
    from gthulhu_node.intents.model import pattern_warnings

    Intent.model_validate({"id": "a", "commandRegex": pattern})  # still valid
    assert any(words in w for w in pattern_warnings(pattern))
    assert pattern_warnings("^EngineCore_DP[0-9]+$") == ()


def test_re2_errors_are_plain_words() -> None:
    """They used to show Python's b'...' around RE2's message."""
    from gthulhu_node.intents.parse import IntentValidationError, parse_intent

    with pytest.raises(IntentValidationError) as exc:
        parse_intent({"id": "a", "commandRegex": "(ab"})
    assert str(exc.value) == "commandRegex: commandRegex '(ab' is not valid RE2 syntax: missing ): (ab"


# Patterns of every kind the contract allows, against names of every kind a comm can be.
SET_PATTERNS = [
    VLLM, "^worker-[0-9]+$", "worker", "(?i)^PYTHON", "^$", ".", "^.{15}$", "^kworker/[0-9]+:[0-9]+H?$",
    "ä", "\\bgc\\b", "^(a|b)+c?$", "[^a-z]", "^x*$", "Core_DP1$", "^\\d", "(?s).", "^[[:upper:]]+$",
]
SET_COMMS = [
    "", "EngineCore", "EngineCore_DP12", "worker-7", "Python3", "kworker/3:1H", "gc", "jvm gc thread",
    "häh", "\ufffd\ufffd", "aab", "c", "xxxxxxxxxxxxxxx", "UPPER", "9lives", "a b", "x" * 15,
]


def per_pattern(ps: PolicySet, comm: str) -> list[str]:
    """The answer one search per intent gives (what matching did before RE2 sets)."""
    return [c.key for c in ps.ordered if c.pattern.search(comm) is not None]


def matched(ps: PolicySet, comm: str) -> list[str]:
    m = ps.match(comm)
    return sorted((c.key for c in (*m.thread, *m.process)), key=lambda k: ps.by_key[k].rank)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_pattern_sets_answer_as_one_search_per_intent(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many intents per pattern, both scopes, sets split in chunks: the same intents match, same order."""
    monkeypatch.setattr(matching, "SET_CHUNK", chunk)
    monkeypatch.setattr(matching, "_last_patterns", None)  # built anew with this chunk size
    intents = [
        (f"s/{n}", intent(str(n), regex=p, priority=n % 21, scope="process" if n % 3 == 0 else "thread"))
        for n, p in enumerate(SET_PATTERNS * 3)
    ]
    ps = PolicySet.build(intents)
    assert ps._patterns.loose == 0
    for comm in SET_COMMS:
        assert matched(ps, comm) == per_pattern(ps, comm), comm
        m = ps.match(comm)
        assert all(c.scope.value == "process" for c in m.process) and all(c.scope.value == "thread"
                                                                          for c in m.thread)


def test_a_set_whose_dfa_fails_falls_back_to_searching_each_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    """RE2::Set::Match says "no match" when its DFA cannot run: a set that fails its check after
    compiling must not be used, or every name would silently match nothing."""
    monkeypatch.setattr(matching, "SET_MAX_MEM", 1 << 10)
    monkeypatch.setattr(matching, "_last_patterns", None)
    ps = PolicySet.build([(f"s/{n}", intent(str(n), regex=p)) for n, p in enumerate(SET_PATTERNS)])
    assert ps._patterns.loose == len(SET_PATTERNS)
    for comm in SET_COMMS:
        assert matched(ps, comm) == per_pattern(ps, comm), comm


def test_a_policy_change_that_keeps_the_patterns_reuses_their_sets() -> None:
    """Compiling the sets of 10,000 patterns is most of a policy build: a re-push with other priorities
    (or ids) keeps them, and must still rank by the new values."""
    first = PolicySet.build([(f"s/{n}", intent(str(n), regex=p, priority=1))
                             for n, p in enumerate(SET_PATTERNS)])
    second = PolicySet.build([(f"s/{n}", intent(str(n), regex=p, priority=1 + n % 20))
                              for n, p in enumerate(SET_PATTERNS)])
    assert second._patterns is first._patterns
    for comm in SET_COMMS:
        assert matched(second, comm) == per_pattern(second, comm), comm
