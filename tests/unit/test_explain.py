"""`explain`: each reason an intent does not govern a thread, the winner and why, with the agent's real
matching objects (PolicySet, CompiledIntent) against a /proc tree on disk (FakeProc)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gthulhu_node import explain
from gthulhu_node.backends.base import Entry
from gthulhu_node.explain import Listed, explain_task, listed_intents, read_subject
from gthulhu_node.intents.model import Intent, SenderEntry
from gthulhu_node.intents.source_set import SourceSet
from gthulhu_node.intents.status import IntentState, IntentStatus
from gthulhu_node.matching import PolicySet
from gthulhu_node.probe.histogram import WaitHistogram
from tests.unit.fakeproc import FakeProc

NODE = "node-a"
POD = "0123abcd-0000-1111-2222-333344445555"


def intent(id: str, regex: str = "^EngineCore", priority: int = 10, slice_ns: int = 0, **kw: Any) -> Intent:
    return Intent.model_validate(
        {"id": id, "commandRegex": regex, "priority": priority, "executionTime": slice_ns, **kw}
    )


@pytest.fixture()
def proc(tmp_path: Path) -> FakeProc:
    fp = FakeProc(tmp_path / "proc")
    fp.add(100, 100, "python3")
    fp.add(100, 101, "EngineCore_DP3")
    fp.set_owner(100, 1000, exe="/usr/bin/python3",
                 cgroup=f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-x.scope\n")
    return fp


def run(proc: FakeProc, intents: list[Intent], *, tid: int = 101, named_only: bool = False,
        statuses: tuple[IntentStatus, ...] = (), in_policy: list[Intent] | None = None,
        entries: tuple[SenderEntry, ...] = (), labels: dict[str, str] | None = None) -> explain.Explanation:
    """Explain `tid` with the policy the agent would build from `intents` (those for this node)."""
    labels = labels or {}
    held = in_policy if in_policy is not None else [i for i in intents if i.selects_node(NODE, labels)]
    policy = PolicySet.build([(f"t/{i.id}", i) for i in held], named_only=named_only)
    sources = {"t": SourceSet("t", 1, tuple(intents), "", 0.0, entries)}
    subject = read_subject(tid, proc.root, tgid=100)
    listed = listed_intents(sources, statuses)
    return explain_task(subject, policy, listed, node_name=NODE, node_labels=labels)


def line(ex: explain.Explanation, key: str) -> explain.IntentLine:
    return next(ln for ln in ex.lines if ln.key == key)


def test_subject_is_read_as_the_agent_reads_it(proc: FakeProc) -> None:
    s = read_subject(101, proc.root, tgid=100)
    assert (s.tid, s.tgid, s.comm) == (101, 100, "EngineCore_DP3")
    assert s.owner is not None and s.owner.uid == 1000 and s.owner.exe == "/usr/bin/python3"
    assert s.pod_uid == POD.replace("-", "")
    assert s.process_comms == ((100, "python3"), (101, "EngineCore_DP3"))


def test_tgid_of_and_missing_tasks(proc: FakeProc) -> None:
    (proc.root / "101").mkdir()
    (proc.root / "101" / "status").write_text("Name:\tEngineCore_DP3\nTgid:\t100\nPid:\t101\n")
    assert explain.tgid_of(101, proc.root) == 100
    with pytest.raises(explain.NoSuchTask):
        explain.tgid_of(4242, proc.root)
    with pytest.raises(explain.NoSuchTask):
        read_subject(4242, proc.root, tgid=100)


def test_matched_winner_why_and_shadows(proc: FakeProc) -> None:
    ex = run(proc, [intent("strong", priority=3), intent("weak", priority=10), intent("nope", "^x$")])
    assert ex.governed and ex.winner == "t/strong"
    assert line(ex, "t/strong").matched and line(ex, "t/weak").matched
    assert ex.shadows == ("t/weak",)
    assert ex.why == ("t/strong beats t/weak on priority (precedence rule 1): priority 3 over 10",)
    nope = line(ex, "t/nope")
    assert (nope.matched, nope.field) == (False, explain.COMMAND)
    assert "'^x$' does not match comm 'EngineCore_DP3'" in nope.reason


def test_tie_break_rules_two_and_three_are_named(proc: FakeProc) -> None:
    two_ms = 2_000_000
    ex = run(proc, [intent("a", slice_ns=0), intent("b", slice_ns=two_ms), intent("c", slice_ns=two_ms)])
    assert ex.winner == "t/b"
    assert ex.shadows == ("t/c", "t/a")
    assert "on executionTime (precedence rule 2)" in ex.why[1]
    assert "t/b sorts before t/c" in ex.why[0] and "precedence rule 3" in ex.why[0]


def test_not_for_this_node(proc: FakeProc) -> None:
    ex = run(proc, [intent("elsewhere", nodeNames=["node-b"]),
                    intent("gpu", nodeSelectors=[{"key": "gpu", "value": "yes"}])], labels={"zone": "a"})
    assert not ex.governed
    for key in ("t/elsewhere", "t/gpu"):
        assert line(ex, key).field == explain.NODE
    assert "'node-a' (zone=a)" in line(ex, "t/gpu").reason


def test_a_manager_entry_that_became_no_intent_is_failed(proc: FakeProc) -> None:
    entry = SenderEntry(record={"commandRegex": "(", "priority": 5}, key="p7#0", failed="invalid regex")
    ex = run(proc, [], entries=(entry,))
    ln = line(ex, "t/p7#0")
    assert (ln.matched, ln.field) == (False, explain.FAILED) and "invalid regex" in ln.reason


def test_failed_or_pending_when_not_in_the_policy_held(proc: FakeProc) -> None:
    broken, waiting = intent("broken"), intent("waiting")
    failed = IntentStatus("t", broken, IntentState.FAILED, "policy could not be built: boom")
    ex = run(proc, [broken, waiting], statuses=(failed,), in_policy=[])
    assert (line(ex, "t/broken").field, line(ex, "t/broken").reason) == (explain.FAILED,
                                                                         "policy could not be built: boom")
    assert line(ex, "t/waiting").field == explain.PENDING
    assert not ex.governed


def test_failed_write_is_a_note_on_a_matched_intent(proc: FakeProc) -> None:
    i = intent("full")
    st = IntentStatus("t", i, IntentState.FAILED, "1 task entries not written: map full")
    ex = run(proc, [i], statuses=(st,))
    ln = line(ex, "t/full")
    assert ln.matched and ln.state == "failed" and "map full" in ln.note
    assert ex.winner == "t/full"


def test_scope_thread_matching_another_thread_of_the_process(proc: FakeProc) -> None:
    ex = run(proc, [intent("py", "^python")])
    ln = line(ex, "t/py")
    assert ln.field == explain.SCOPE and "100 ('python3')" in ln.reason


def test_scope_process_covers_every_thread(proc: FakeProc) -> None:
    ex = run(proc, [intent("py", "^python", scope="process", priority=3), intent("eng", priority=10)])
    assert line(ex, "t/py").matched and ex.winner == "t/py" and ex.winner_scope == "process"
    assert ex.shadows == ("t/eng",)
    none = run(proc, [intent("x", "^nothing$", scope="process")])
    assert line(none, "t/x").field == explain.COMMAND and "scope=process" in line(none, "t/x").reason


def test_pod_uid(proc: FakeProc) -> None:
    other = "ffffffff-0000-1111-2222-333344445555"
    ex = run(proc, [intent("mine", podUID=POD), intent("other", podUID=other)])
    assert line(ex, "t/mine").matched
    assert line(ex, "t/other").field == explain.POD
    assert ex.winner == "t/mine"


@pytest.mark.parametrize(
    ("kw", "field", "words"),
    [
        ({"users": ["0"]}, explain.USERS, "do not include uid 1000"),
        ({"cgroupRegex": "^/system.slice/"}, explain.CGROUP, "does not match cgroup"),
        ({"executableRegex": "^/opt/vllm/", "users": ["1000"]}, explain.EXE, "'/usr/bin/python3'"),
    ],
)
def test_owner_selectors(proc: FakeProc, kw: dict[str, Any], field: str, words: str) -> None:
    ex = run(proc, [intent("sel", **kw)])
    ln = line(ex, "t/sel")
    assert (ln.matched, ln.field) == (False, field) and words in ln.reason
    assert not ex.governed


def test_owner_selectors_that_admit(proc: FakeProc) -> None:
    ex = run(proc, [intent("sel", users=["1000"], cgroupRegex="kubepods", executableRegex="python")])
    assert line(ex, "t/sel").matched and ex.winner == "t/sel"


def test_named_only(proc: FakeProc) -> None:
    ex = run(proc, [intent("anyone"), intent("named", priority=2, users=["1000"])], named_only=True)
    assert line(ex, "t/anyone").field == explain.NAMED_ONLY
    assert ex.winner == "t/named"


def test_owner_unreadable_fails_closed(proc: FakeProc) -> None:
    (proc.root / "100" / "status").unlink()
    (proc.root / "100" / "cgroup").unlink()
    ex = run(proc, [intent("sel", users=["1000"]), intent("plain", priority=1)])
    assert line(ex, "t/sel").field == explain.OWNER
    assert ex.winner == "t/plain"


def test_noop_wins_and_says_so(proc: FakeProc) -> None:
    ex = run(proc, [intent("quiet", priority=0)])
    assert ex.winner == "t/quiet" and "noop" in line(ex, "t/quiet").note


def test_listed_intents_keep_every_source_and_order() -> None:
    a = SourceSet("a", 1, (intent("x"),), "", 0.0)
    b = SourceSet("b", 1, (intent("y"),), "", 0.0,
                  (SenderEntry(record={}, key="z#1", failed="bad"),))
    got = listed_intents({"b": b, "a": a}, ())
    assert [(g.key, g.failed) for g in got] == [("a/x", ""), ("b/z#1", "bad"), ("b/y", "")]
    assert isinstance(got[0], Listed)


def test_held_for_reads_the_reconcilers_entries_and_the_backends(proc: FakeProc) -> None:
    from gthulhu_node.backends.base import Entry
    from gthulhu_node.backends.dryrun import DryRunBackend
    from gthulhu_node.reconciler import Reconciler
    from gthulhu_node.tasks.procfs import snapshot

    backend = DryRunBackend()
    backend.start()
    policy = PolicySet.build([("t/eng", intent("eng", slice_ns=2_000_000))])
    r = Reconciler(backend, policy=policy, proc_root=proc.root)
    r.apply_snapshot(snapshot(proc.root))
    (held,) = explain.held_for(r, [(101, 100, 1)])
    assert held.backend == "dry-run" and held.agent_winner == "t/eng" and held.read_back == ""
    (tid_entry,) = held.entries
    want = Entry(10, 2_000_000, 100)
    assert (tid_entry.key, tid_entry.owner) == ("tid:101", "t/eng")
    assert tid_entry.desired == tid_entry.applied == tid_entry.read_back == want
    del backend.table[next(iter(backend.table))]  # someone else's change: the read-back says so
    assert explain.held_for(r, [(101, 100, 1)])[0].entries[0].read_back is None
    assert explain.held_for(r, [(100, 100, 1)])[0].entries == ()  # the leader is not governed
    backend.stop()


def test_preview_follows_named_only_like_the_agent(proc: FakeProc) -> None:
    """The preview builds its policy with the agent's `named_only` setting: an intent naming no owner
    does not govern a non-root thread there (before, a preview said it would)."""
    from gthulhu_node.preview import preview

    mine = [intent("anyone")]
    loose = preview("t", mine, node_name=NODE, node_labels={}, proc_root=proc.root)
    strict = preview("t", mine, node_name=NODE, node_labels={}, proc_root=proc.root, named_only=True)
    assert [m.tid for m in loose.matches] == [101]
    assert strict.matches == () and strict.intents[0].matched_tasks == 0


def test_held_for_says_when_the_backend_cannot_be_read(proc: FakeProc) -> None:
    """An ejected backend holds nothing readable: the answer says so instead of an empty read-back."""
    from gthulhu_node.backends.dryrun import DryRunBackend
    from gthulhu_node.reconciler import Reconciler
    from gthulhu_node.tasks.procfs import snapshot

    backend = DryRunBackend()
    backend.start()
    r = Reconciler(backend, policy=PolicySet.build([("t/eng", intent("eng"))]), proc_root=proc.root)
    r.apply_snapshot(snapshot(proc.root))
    backend.eject("watchdog timeout")
    (held,) = explain.held_for(r, [(101, 100, 1)])
    assert held.read_back == "not read back: the backend is ejected (watchdog timeout)"
    assert held.entries[0].read_back is None and held.entries[0].applied is not None


def test_what_eevdf_cannot_express(proc: FakeProc) -> None:
    """EEVDF clamps a slice request to 100 us - 100 ms without an error: explain says what the thread gets."""
    long = run(proc, [intent("eng", slice_ns=200_000_000, priority=10)])
    note = explain.eevdf_limits(long)
    assert "executionTime 200000000 ns is outside the kernel's slice range" in note
    assert "it runs with 100000000 ns" in note and "priority 10 is a nice level" in note
    assert explain.eevdf_limits(run(proc, [intent("eng", slice_ns=2_000_000, priority=0)])) == ""
    assert explain.eevdf_limits(run(proc, [intent("eng", regex="^nothing$")])) == ""


# ---- the agent's own threads, and the run-queue probe ------------------------------------------------


def held(boosted_tgid: int, *entries: explain.HeldEntry, backend: str = "sched_ext",
         read_back: str = "") -> explain.Held:
    return explain.Held(backend, entries, read_back, boosted_tgid=boosted_tgid)


def test_the_agents_own_threads_are_boosted_by_the_scheduler_not_an_intent(proc: FakeProc) -> None:
    """lookup_strategy gives the agent's process AGENT_RANK when neither map holds an entry for it: its
    threads have a strategy without an intent, and only while no entry is held for them."""
    subject = read_subject(101, proc.root, tgid=100)
    boost = explain.agent_boost(subject, held(100))
    assert "the agent's own thread" in boost and "not an intent" in boost and "process 100" in boost
    assert explain.agent_boost(subject, held(0)) == ""  # eevdf, dry-run, or the agent not protected
    assert explain.agent_boost(subject, held(999)) == ""  # another process than the agent's
    entry = explain.HeldEntry("tgid:100", "t/python", None, None, Entry(3, 0, 100))
    assert explain.agent_boost(subject, held(100, entry)) == ""  # an intent's entry comes first
    unread = explain.agent_boost(subject, held(100, read_back="not read back: the backend is ejected"))
    assert unread.endswith("(unless an entry is held for it: not read back: the backend is ejected)")


def test_an_agent_thread_counts_as_governed_for_the_exit_status() -> None:
    from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
    from gthulhu_node.commands.explain import EXIT_GOVERNED, EXIT_NOT_GOVERNED, describe, exit_status

    mine = pb.ThreadExplanation(tid=5, tgid=5, comm="gthulhu-node", agent_boost="the agent's own thread: x")
    other = pb.ThreadExplanation(tid=6, tgid=6, comm="idle")
    assert exit_status([mine]) == EXIT_GOVERNED
    assert exit_status([mine, other]) == EXIT_NOT_GOVERNED
    assert "governed by the agent's own boost, not an intent: the agent's own thread: x" in describe(mine)
    assert "not governed" in describe(other)


class Probe:
    def __init__(self, state: str = "running", reason: str = "",
                 hists: dict[str, WaitHistogram] | None = None) -> None:
        self.state, self.reason, self.hists = state, reason, hists or {}

    def histograms(self) -> dict[str, WaitHistogram]:
        return self.hists


def test_the_probe_figures_are_the_winning_intents_or_say_why_not() -> None:
    hist = WaitHistogram.from_values([1_000_000, 3_000_000])
    got = explain.probe_waits(Probe(hists={"t/eng": hist}), "t/eng")
    assert (got.intent, got.waits, got.mean_ns) == ("t/eng", 2, 2_000_000) and got.p99_ns > 0
    assert "no per-thread figures" in got.note
    assert explain.probe_waits(None, "t/eng").note == "not running: probe.enabled is false"
    assert explain.probe_waits(Probe("unavailable", "no BCC"), "t/eng").note == \
        "not running (unavailable: no BCC)"
    assert "none for this one" in explain.probe_waits(Probe(), "").note
    empty = explain.probe_waits(Probe(), "t/eng")
    assert empty.waits == 0 and "no wait of t/eng's threads measured yet" in empty.note


def test_short_waits_are_shown_in_microseconds_not_as_zero_ms() -> None:
    from gthulhu_node.commands.explain import _ms

    assert (_ms(0), _ms(3_400), _ms(999_999), _ms(1_500_000)) == (
        "0.00 ms", "3.4 us", "1,000.0 us", "1.50 ms")
