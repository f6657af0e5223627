"""Local policy files: the source `local`, for hosts without a manager (and for pinning things locally).

Where: `policies.directory` (default /etc/gthulhu-node/policies.d/), files ending in .yaml, .yml or .json
(hidden files and editor leftovers are ignored), read in name order. What a file may hold:
- one intent: `{"id": "vllm", "commandRegex": "^EngineCore", "priority": 10}`;
- a list of intents, or `{"intents": [...]}`;
- upstream Gthulhu's REST request body for a node scheduling policy, as it is:
  `{"nodeNames": [...], "nodeSelectors": [...], "commandRegex": ..., "priority": ..., "executionTime": ...}`.
  Selectors combine as upstream's Manager combines them: nodeNames AND nodeSelectors (Intent.selects_node);
  an entry without any is for this node. An entry with `draSelectors` cannot be evaluated on a node (DRA
  resource slices live in the API server): it is loaded as a failed entry with that reason, never
  applied; an empty `draSelectors` list is no selector.
An entry without `id` gets `<file stem>-<index>` (index from 0 in the file's list).

Reloading: a cheap poll of the directory (one stat per file every `poll_interval_s`, default 1 s) plus an
immediate reload on SIGHUP (`reload()`). Why not inotify: a poll of a handful of files costs nothing
measurable, needs no ctypes binding, and also sees changes inotify misses (bind mounts, a directory that
appears later, files replaced over NFS/config management).

Trust (intents/trust.py): the directory and its files must be owned by root and not group- or
world-writable, symlinks are followed only to such files, and anything else named like a policy file (a
FIFO, a directory) is reported as bad. YAML anchors/aliases and deep nesting are refused
(intents/documents.py), and so is any list past the contract's caps (intents/model.py).

A bad file (unreadable, untrusted, not YAML/JSON, invalid intent, duplicate id) is reported (log line,
counter, the `local` source's errors in status) and does not affect the other files. A file that was good
earlier in this run keeps its last good intents until it is fixed or removed: a typo while editing must not
drop a policy that is in effect. (At start there is no earlier version, so a bad file contributes nothing.)
Failing to read is never taken for "gone": a directory that cannot be listed (EMFILE, EACCES) or is not
trusted keeps every file's last good content, and is reported; only a listing that succeeds and no longer
shows a file removes its intents.

The priority scale turned in 0.2.0 (issue 39: 1 the strongest, as upstream Gthulhu). Policy files are the
admin's and are never rewritten: on the first start of an agent of the new scale (no `priority-scale`
marker in the state directory) every file holding boosted intents is named in a warning
(`policy_files_old_scale`) and in the `local` source's status notes for that run, with the rule that
converts its levels; then the marker is written and later starts are silent (docs/intents.md).
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from gthulhu_node.errors import InvalidInput, Unavailable
from gthulhu_node.intents.documents import DocumentError, load_json, load_yaml
from gthulhu_node.intents.model import Intent, RecordValue, SenderEntry
from gthulhu_node.intents.parse import IntentValidationError, parse_intent
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.intents.store_errors import StoreError
from gthulhu_node.intents.trust import UntrustedError, open_policy_directory, open_policy_file
from gthulhu_node.lifecycle import Health
from gthulhu_node.workers import Flag, WorkerThread, WorkQueue

log = structlog.get_logger(__name__)

SOURCE = "local"
SUFFIXES = (".yaml", ".yml", ".json")
# Upstream's DRA selector: evaluated against the cluster's resource slices, which a node agent cannot see.
DRA_FIELD = "draSelectors"
DRA_REASON = ("draSelectors cannot be evaluated on a node (DRA resource slices live in the Kubernetes API); "
              "not applied: select the node with nodeNames/nodeSelectors instead")
MAX_FILE_BYTES = 4 << 20
# In the state directory: this agent's priority scale is known to the node (docs/intents.md, "Upgrading").
SCALE_MARKER = "priority-scale"
SCALE_NOTE = ("holds boosted intents: since 0.2.0 priorities run upstream Gthulhu's way (1 the strongest, "
              "20 the weakest; 1-9 preempt). If it was written for an earlier release (20 the strongest), "
              "convert each priority p > 0 to 9 - ((p - 1) * 9) // 20 (20 -> 1, 10 -> 5, 1 -> 9), as the "
              "saved intents were; this note shows once, on the first start after the upgrade")
SCALE_RULE = "new = 9 - ((old - 1) * 9) // 20 for old 1-20 (20 -> 1, 10 -> 5, 1 -> 9); 0 stays 0"
Signature = tuple[int, int, int, int, int]


class PolicyFileError(InvalidInput):
    """A policy file that cannot be used; the message names the file and, when known, the field."""


@dataclass(frozen=True, slots=True)
class FileResult:
    intents: tuple[Intent, ...]
    notes: tuple[str, ...] = ()
    failed: tuple[SenderEntry, ...] = ()  # entries kept and reported, never applied (draSelectors)


@dataclass(slots=True)
class LocalFilesStats:
    files: int = 0
    bad_files: int = 0
    reloads: int = 0
    load_errors: int = 0  # total bad-file observations since start (a counter)
    dir_errors: int = 0  # times the directory could not be listed or was not trusted (a counter)
    dir_unreadable: bool = False  # the last look at the directory failed: its last good content is kept


@dataclass(slots=True)
class _FileState:
    signature: Signature | None
    good: FileResult | None
    error: str | None


def parse_document(doc: Any, stem: str) -> FileResult:
    """Turn a parsed YAML/JSON document into intents (see the module docstring for the forms)."""
    notes: list[str] = []
    if isinstance(doc, Mapping) and "intents" in doc:
        extra = sorted(set(doc) - {"intents"})
        if extra:
            raise PolicyFileError(f"{extra[0]}: unknown field next to 'intents'")
        entries, where = doc["intents"], "intents"
        if not isinstance(entries, list):
            raise PolicyFileError("intents: expected a list")
    elif isinstance(doc, list):
        entries, where = doc, ""
    elif isinstance(doc, Mapping):
        entries, where = [doc], ""
    elif doc is None:
        return FileResult(())
    else:
        raise PolicyFileError(
            f"expected an intent, a list of intents or {{intents: [...]}}, got {type(doc).__name__}"
        )
    intents: list[Intent] = []
    failed: list[SenderEntry] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        path = f"{where}[{index}]" if where or len(entries) > 1 or isinstance(doc, list) else ""
        if not isinstance(entry, Mapping):
            raise PolicyFileError(f"{path or 'entry'}: expected an object, got {type(entry).__name__}")
        data = dict(entry)
        dra = data.pop(DRA_FIELD, None)
        data.setdefault("id", f"{stem}-{index}")
        if dra:
            failed.append(_dra_entry(data, index))
            notes.append(f"{path + '.' if path else ''}{DRA_FIELD}: {DRA_REASON}")
            continue
        try:
            intent = parse_intent(data, path)
        except IntentValidationError as exc:
            hint = ""
            if exc.field.endswith("id") and "id" not in entry:
                hint = " (the id defaults to <file stem>-<index>: rename the file or give an id)"
            raise PolicyFileError(f"{exc}{hint}") from None
        if intent.id in seen:
            raise PolicyFileError(f"{path}.id: duplicate id {intent.id!r} in this file")
        seen.add(intent.id)
        intents.append(intent)
    return FileResult(tuple(intents), tuple(notes), tuple(failed))


def _dra_entry(data: Mapping[str, Any], index: int) -> SenderEntry:
    """The failed entry status shows for a DRA-selected policy (its values as written, for people)."""
    record: dict[str, RecordValue] = {
        k: v for k, v in data.items()
        if k in ("commandRegex", "priority", "executionTime") and isinstance(v, str | int)
    }
    return SenderEntry(record=record, key=f"{data['id']}#{index}", failed=DRA_REASON)


def read_file(path: Path) -> FileResult:
    """Check (intents/trust.py), read and parse one policy file. Raises PolicyFileError naming what is
    wrong; a refused file is not read, so its content never reaches the message."""
    try:
        fd, st = open_policy_file(path)
    except UntrustedError as exc:
        raise PolicyFileError(str(exc)) from None
    except OSError as exc:
        raise PolicyFileError(f"cannot read: {exc.strerror or exc}") from None
    try:
        if st.st_size > MAX_FILE_BYTES:
            raise PolicyFileError(f"{st.st_size} bytes, at most {MAX_FILE_BYTES} are read")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise PolicyFileError(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise PolicyFileError(f"more than {MAX_FILE_BYTES} bytes, at most {MAX_FILE_BYTES} are read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyFileError(f"not UTF-8 at byte {exc.start}") from None
    try:
        doc = load_json(text) if path.suffix == ".json" else load_yaml(text)
    except DocumentError as exc:
        raise PolicyFileError(str(exc)) from None
    return parse_document(doc, path.stem)


def read_guarded(path: Path) -> tuple[FileResult | None, str | None]:
    """read_file as the poller and start-up call it: (result, None) or (None, why). This is the policy
    files' decoding boundary: whatever reading one file raises is that file's refusal, never an exception
    that stops the reload of the others (or the agent's start). An error that is not a PolicyFileError
    is a bug in a parser; it is logged with where it was raised, and only its type reaches the log and
    the status, since its words may quote the file."""
    try:
        return read_file(path), None
    except PolicyFileError as exc:
        return None, str(exc)
    except Exception as exc:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        log.error("policy_file_parser_failed", path=str(path), error=type(exc).__name__,
                  raised_at=f"{last.filename}:{last.lineno}")
        return None, f"could not be parsed ({type(exc).__name__}): not loaded"


class PolicyDirError(Unavailable, OSError):
    """The policy directory could not be listed, or is not trusted: nothing can be concluded from it."""


def policy_files(directory: Path) -> list[Path]:
    """The entries of `directory` named like policy files, in name order, whatever their type (read_file
    reports what is not a regular file). Empty when the directory does not exist.

    Raises PolicyDirError when it cannot be listed (EMFILE, EACCES, ...) or someone other than root could
    change it: an error is never "no files", which would remove every local intent.
    """
    try:
        fd = open_policy_directory(directory)
        try:
            names = sorted(os.listdir(fd))
        finally:
            os.close(fd)
    except FileNotFoundError:
        return []
    except UntrustedError as exc:
        raise PolicyDirError(f"{exc}; its files are not read") from None
    except OSError as exc:
        raise PolicyDirError(f"cannot list {directory}: {exc.strerror or exc}") from None
    return [directory / n for n in names if n.endswith(SUFFIXES) and not n.startswith(".")]


def _signature(path: Path) -> Signature | None:
    """What tells a changed file: inode, mtime, size, mode and owner (of the symlink target, if any).
    None when it cannot be examined: the file is then read again (and its error reported)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return (0, 0, 0, 0, 0)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode, st.st_uid)


class LocalPolicies:
    """Keeps the store's `local` source equal to the good content of the policy files."""

    def __init__(self, directory: Path, store: IntentStore, *, poll_interval_s: float = 1.0) -> None:
        self.directory = directory
        self._store = store
        self._poll = poll_interval_s
        self._lock = threading.Lock()  # the file table, for readers (errors, notes, stats)
        # One reload at a time, from reading the files to the store's apply: SIGHUP's reload and the
        # poller's run on different threads, and the set read first must not be applied last.
        self._reload_lock = threading.Lock()
        self._files: dict[Path, _FileState] = {}
        # files whose good content could not be combined with the others (id clash, total limit)
        self._combine_errors: dict[Path, str] = {}
        self._stats = LocalFilesStats()
        self._dir_error = ""
        self._scale_notes: dict[Path, str] = {}
        self._poller = WorkerThread("policy-files", self._run, join_timeout_s=5)

    def errors(self) -> dict[str, str]:
        """Bad files now: path -> reason."""
        with self._lock:
            out = {str(p): s.error for p, s in self._files.items() if s.error}
            if self._dir_error:
                out[str(self.directory)] = f"{self._dir_error} (the last good content stays in effect)"
            out.update({str(p): e for p, e in self._combine_errors.items() if str(p) not in out})
            return out

    def notes(self) -> list[str]:
        with self._lock:
            return ([f"{p}: {n}" for p, s in self._files.items() if s.good for n in s.good.notes]
                    + [f"{p}: {n}" for p, n in sorted(self._scale_notes.items())])

    def check_scale(self) -> list[Path]:
        """After the first reload of a start: on the first start of this scale on the node (no SCALE_MARKER
        in the state directory), name the files holding boosted intents (warning and status notes), then
        write the marker. Returns the files named. Without a state directory there is nowhere to remember
        it: nothing is done."""
        state_dir = self._store.state_dir
        if state_dir is None or (state_dir / SCALE_MARKER).exists():
            return []
        with self._lock:
            boosted = sorted(p for p, s in self._files.items()
                             if s.good and any(i.priority > 0 for i in s.good.intents))
            self._scale_notes = dict.fromkeys(boosted, SCALE_NOTE)
        if boosted:
            log.warning("policy_files_old_scale", files=[str(p) for p in boosted], rule=SCALE_RULE,
                        detail="priorities now run upstream's way (1 the strongest); files are not rewritten")
        try:
            (state_dir / SCALE_MARKER).write_text("1 strongest (upstream Gthulhu's scale, since 0.2.0)\n")
        except OSError as exc:
            log.error("priority_scale_marker_unwritable", path=str(state_dir / SCALE_MARKER), error=str(exc))
        return boosted

    def stats(self) -> LocalFilesStats:
        with self._lock:
            self._stats.files = len(self._files)
            self._stats.dir_unreadable = bool(self._dir_error)
            self._stats.bad_files = len(
                {p for p, s in self._files.items() if s.error} | set(self._combine_errors)
            )
            return LocalFilesStats(**{k: getattr(self._stats, k) for k in LocalFilesStats.__slots__})

    def reload(self, *, force: bool = True) -> bool:
        """Re-read the directory and push the result to the store. Returns whether the store changed.

        `force` re-reads every file (SIGHUP); otherwise only files whose signature changed are read.
        A directory that cannot be listed (or is not trusted) changes nothing: every file keeps its last
        good content, and the error is reported (log, `dir_errors`, the `local` source's errors).
        """
        with self._reload_lock:
            return self._reload(force)

    def _reload(self, force: bool) -> bool:
        with self._lock:
            self._stats.reloads += 1
            try:
                current = policy_files(self.directory)
            except PolicyDirError as exc:
                self._stats.dir_errors += 1
                if self._dir_error != str(exc):
                    log.error("policy_dir_unreadable", directory=str(self.directory), error=str(exc),
                              kept_files=len(self._files))
                self._dir_error = str(exc)
                return False
            if self._dir_error:
                log.info("policy_dir_readable_again", directory=str(self.directory))
            self._dir_error = ""
            changed_any = set(self._files) != set(current)
            for path in current:
                sig = _signature(path)
                old = self._files.get(path)
                if not force and old is not None and sig is not None and old.signature == sig:
                    continue
                result, error = read_guarded(path)
                new = _FileState(sig, result if result is not None else (old.good if old else None), error)
                if error:
                    self._stats.load_errors += 1
                    if old is None or old.error != error:
                        log.error(
                            "policy_file_invalid",
                            path=str(path),
                            error=error,
                            kept_previous=bool(old and old.good),
                        )
                if old is None or new != old:
                    changed_any = True
                self._files[path] = new
            for gone in set(self._files) - set(current):
                del self._files[gone]
                log.info("policy_file_removed", path=str(gone))
            combined = self._combine()
            failed = [e for p, fs in sorted(self._files.items()) if fs.good and p not in self._combine_errors
                      for e in fs.good.failed]
        try:
            outcome = self._store.apply(SOURCE, 0, combined, allow_reserved=True, entries=failed)
        except (IntentValidationError, StoreError, OSError) as exc:
            log.error("policy_files_refused", directory=str(self.directory), error=str(exc))
            with self._lock:
                self._stats.load_errors += 1
            return False
        if outcome.changed or changed_any:
            log.info("policy_files_loaded", directory=str(self.directory), intents=len(combined))
        return outcome.changed

    def _combine(self) -> list[Intent]:
        """All files' intents in name order; a file whose ids collide with an earlier file's is bad."""
        taken: dict[str, Path] = {}
        combined: list[Intent] = []
        errors: dict[Path, str] = {}
        limit = self._store.max_intents_per_source
        for path in sorted(self._files):
            fs = self._files[path]
            if fs.good is None:
                continue
            clash = next((i.id for i in fs.good.intents if i.id in taken), None)
            if clash is not None:
                errors[path] = f"id {clash!r} is also defined in {taken[clash].name}; not loaded"
                continue
            if len(combined) + len(fs.good.intents) > limit:
                errors[path] = f"more than {limit} local intents in total; not loaded"
                continue
            for intent in fs.good.intents:
                taken[intent.id] = path
            combined.extend(fs.good.intents)
        for path, error in errors.items():
            if self._combine_errors.get(path) != error:
                log.error("policy_file_invalid", path=str(path), error=error, kept_previous=False)
        self._combine_errors = errors
        return combined

    name = "policy-files"  # a lifecycle Component (gthulhu_node/lifecycle.py)

    def start(self) -> None:
        self.start_polling()

    def health(self) -> Health:
        with self._lock:
            error = self._dir_error
        return Health(not error, error)

    def start_polling(self) -> None:
        """Poll the directory for changes in a background thread (load once with `reload` first)."""
        if self._poll <= 0:
            return
        self._poller.start()

    def stop(self) -> None:
        self._poller.stop()

    def _run(self, stop: Flag) -> None:
        """The `policy-files` thread: a look at the directory every poll interval until stopped."""
        WorkQueue(period_s=self._poll).serve(stop, self._poll_once)

    def _poll_once(self) -> None:
        try:
            if self._dirty():
                self.reload(force=False)
        except Exception:
            log.exception("policy_files_poll_failed", directory=str(self.directory))

    def _dirty(self) -> bool:
        try:
            current = policy_files(self.directory)
        except PolicyDirError:
            return True  # reload() reports it (once) and keeps everything
        with self._lock:
            if self._dir_error or set(current) != set(self._files):
                return True
            return any((sig := _signature(p)) is None or sig != self._files[p].signature for p in current)
