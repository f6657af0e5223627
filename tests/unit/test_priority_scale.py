"""The priority scale runs upstream Gthulhu's way (issue 39): 1 the strongest, 20 the weakest, 0 no boost.

Every place that orders priorities goes through gthulhu_node.limits (strength, boost_levels_strongest_first):
the precedence among overlapping intents, the eevdf backend's nice, the Manager's note on priority 0, and the
migration of state saved on the old scale (20 the strongest).
"""

from __future__ import annotations

import itertools

from gthulhu_node.backends.eevdf_policy import nice_for_priority
from gthulhu_node.intents.parse import parse_intent
from gthulhu_node.limits import (
    PREEMPT_TIER_LAST,
    PRIORITY_MAX,
    boost_levels_strongest_first,
    migrate_pre_issue39,
    preempts,
    strength,
    stronger,
)
from gthulhu_node.matching import precedence_rank
from gthulhu_node.rest.translate import PRIORITY_ZERO_NOTE, honourable


def test_levels_run_from_1_the_strongest_to_20_the_weakest() -> None:
    levels = boost_levels_strongest_first()
    assert levels == list(range(1, PRIORITY_MAX + 1))
    assert [strength(p) for p in levels] == sorted((strength(p) for p in levels), reverse=True)
    assert stronger(1, 10) and stronger(10, 20) and stronger(20, 0)
    assert not stronger(5, 5) and not stronger(0, 20)
    assert strength(0) == 0 and strength(PRIORITY_MAX + 1) == 0


def test_tiers() -> None:
    assert [p for p in range(PRIORITY_MAX + 1) if preempts(p)] == list(range(1, PREEMPT_TIER_LAST + 1))


def test_the_stronger_priority_wins_an_overlap() -> None:
    """A Manager user's "engine 1, tokenizer 10": the engine wins where both match; before, the 10."""
    engine = parse_intent({"id": "engine", "commandRegex": "x", "priority": 1})
    tokenizer = parse_intent({"id": "tokenizer", "commandRegex": "x", "priority": 10})
    weakest = parse_intent({"id": "weak", "commandRegex": "x", "priority": 20})
    none = parse_intent({"id": "none", "commandRegex": "x", "priority": 0, "executionTime": 1_000_000})
    ranked = sorted([none, weakest, tokenizer, engine], key=lambda i: precedence_rank(f"m/{i.id}", i))
    assert [i.id for i in ranked] == ["engine", "tokenizer", "weak", "none"]


def test_eevdf_nice_is_strongest_at_1_and_never_weaker_for_a_stronger_level() -> None:
    assert nice_for_priority(1) == -20 and nice_for_priority(PRIORITY_MAX) == -5
    nices = [nice_for_priority(p) for p in boost_levels_strongest_first()]
    assert nices == sorted(nices)  # strongest first: nice only rises (weakens) along the list


def test_migration_rule_of_saved_state() -> None:
    """new = 9 - ((old - 1) * 9) // 20: old 20 -> 1, old 1 -> 9, 0 stays 0; order kept, all preempting."""
    table = {old: migrate_pre_issue39(old) for old in range(PRIORITY_MAX + 1)}
    assert table[0] == 0 and table[20] == 1 and table[1] == 9
    assert table[10] == 5 and table[15] == 3 and table[5] == 8
    assert all(preempts(new) for old, new in table.items() if old)  # every old level preempted
    olds = list(range(1, PRIORITY_MAX + 1))  # the old scale's weakest first
    assert all(strength(table[a]) <= strength(table[b]) for a, b in itertools.pairwise(olds))
    assert len({table[o] for o in olds}) == PREEMPT_TIER_LAST  # every level of the tier is used


def test_a_manager_entry_at_0_is_told_what_upstreams_kernel_mode_would_do() -> None:
    values = honourable(0, 2_000_000)
    assert values.priority == 0 and PRIORITY_ZERO_NOTE in values.warnings
    assert "strongest" in PRIORITY_ZERO_NOTE and "kernel mode" in PRIORITY_ZERO_NOTE
    assert honourable(1, 0).warnings == ()
