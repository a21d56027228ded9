"""The node's cache of name records: the newest valid record per name, kept on disk.

A node answers ``get(name)`` from this cache, so records it published or accepted keep
being served after a restart. Records are self-authenticating; the cache only decides
which one to keep.

Rules:

1. Only verified records enter (the caller verifies; :meth:`NameCache.load` re-verifies
   what it reads back, so a damaged or expired file is dropped, never served).
2. Per name, a record replaces the held one only if it supersedes it
   (:func:`p2p.names.record.supersedes`); an older one is refused with OLDER. Offering
   the held record again is accepted and changes nothing.
3. Bounded: at most ``MAX_CACHED_RECORDS`` names in all and ``MAX_RECORDS_PER_PUBLISHER``
   per publisher; this node's own publications are never refused or evicted. Another
   publisher's record is held until its expiry or ``MAX_HOLD_S`` after its signed
   publication time, whichever is sooner (a record that never expires is held a week
   unless republished), and then dropped, on disk too.
5. When the cache is full, expired records go first; then a new record evicts one held
   record of a lower or equal rank, where rank is: names this node asked for (resolved,
   or published here by its user) above records peers pushed. Among those the victim is
   a record of the publisher holding the most of that rank, least recently used
   (``get``); within one rank a publisher evicts only from a publisher holding more than
   it will. So a flood from free keys can churn only the pushed records of the greediest
   flooders and never takes a name this node asked for or a small publisher's name; an
   evicted record's file is deleted, so a restart loads only what survived.
4. On disk: ``<store>/names/<64 hex of the record key>``, each the record's canonical
   bytes, written through blobstore's one durable write helper (temp in the store's
   ``tmp/``, fsync, rename, fsync dir), so a crash leaves the old record or the new one.
   Writes are serialised and always write the *current* best, so two racing writes can
   never leave an older record on disk. Across processes (``blob publish`` or
   ``blob train run --publish`` beside ``blob serve``) each write holds
   ``<store>/locks/names`` (the store's private lock directory: no other user can take
   it) and first reads the saved file: a record there that is as new or newer than this
   process's is adopted, not overwritten.
6. A name's rank survives a restart: a name this node asked for has an empty marker file
   ``<store>/names/asked/<64 hex>`` (written through the same helper, deleted with the
   record), and :meth:`NameCache.load` reads the markers before the records, so a flood
   pushed before or after a restart still cannot evict a name this node resolved.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from blobstore import StoreBusy
from blobstore.durable import os_errors, try_lock_fd, write_file_atomic
from p2p.names.record import (
    MAX_NAME_RECORD_SIZE,
    NameRecord,
    NameRejected,
    supersedes,
    verify,
)

log = logging.getLogger(__name__)

# A node is an index for its own runs and those it follows; thousands of names is a
# busy catalog, and 4096 records of at most 5 KiB bound the cache to 20 MiB.
MAX_CACHED_RECORDS = 4096
# One publisher (one key, and keys are free) cannot fill the cache on its own; the same
# bound caps a catalog listing.
MAX_RECORDS_PER_PUBLISHER = 256
# Another publisher's record is held at most this long after its signed publication time
# (rule 3): a publisher that wants its name kept republishes it (a new seq) within a week.
MAX_HOLD_S = 7 * 24 * 3600
NAMES_DIR = "names"
ASKED_DIR = "asked"  # inside NAMES_DIR: one empty marker per name this node asked for
_FILE_MODE = 0o644
NAMES_LOCK = "names"  # in the store's locks/ directory
# Another process holds the names lock only for one small durable write (milliseconds);
# waiting longer means it is stuck, and the caller should hear so rather than hang.
NAMES_LOCK_TIMEOUT = 10.0
_LOCK_POLL = 0.005


@dataclass(frozen=True)
class Offer:
    """What the cache did with an offered record."""

    accepted: bool
    changed: bool
    reason: str = ""


class NameCache:
    """The newest record per name key; persisted under ``directory`` when given."""

    def __init__(
        self,
        directory: Path | None = None,
        tmp_dir: Path | None = None,
        lock_file: Path | None = None,
        *,
        max_records: int = MAX_CACHED_RECORDS,
        max_per_publisher: int = MAX_RECORDS_PER_PUBLISHER,
    ) -> None:
        self.max_records = max_records
        self.max_per_publisher = max_per_publisher
        self.directory = directory
        self.tmp_dir = tmp_dir
        self.lock_file = lock_file
        self._records: dict[bytes, NameRecord] = {}
        self._own: set[bytes] = set()
        # Names this node asked for (rule 5), and the use counter of each held name.
        self._asked: set[bytes] = set()
        self._used: dict[bytes, int] = {}
        self._uses = 0
        self._mutex = threading.Lock()
        self._write_lock = threading.Lock()
        self._dir_stamp: int | None = None
        # name -> (inode, mtime, size) of each saved file as last loaded: a reload reads
        # and verifies only files that are new or replaced (each save is a new file), so
        # a peer that alternates pushes and listings cannot make every listing re-verify
        # the whole cache.
        self._loaded: dict[str, tuple[int, int, int]] = {}

    @classmethod
    def for_store_root(cls, root: Path, tmp_dir: Path, **limits: int) -> NameCache:
        """The cache saved in a store (``limits``: ``max_records``, ``max_per_publisher``)."""
        return cls(root / NAMES_DIR, tmp_dir, root / "locks" / NAMES_LOCK, **limits)

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: bytes) -> NameRecord | None:
        record = self._records.get(key)
        if record is not None:
            self._uses += 1
            self._used[key] = self._uses
        return record

    def by_publisher(self, publisher: str) -> list[NameRecord]:
        with self._mutex:
            found = [r for r in self._records.values() if r.publisher == publisher]
        return sorted(found, key=lambda r: r.name)[:MAX_RECORDS_PER_PUBLISHER]

    def offer(
        self, record: NameRecord, *, now: float, own: bool = False, asked: bool = False
    ) -> Offer:
        """Keep ``record`` (already verified) if it is the newest for its name (rules 2,
        3, 5). ``own``: this node's publication; ``asked``: a name this node asked for.
        Returns whether it was accepted and whether the held record changed."""
        key = record.key
        with self._mutex:
            if not own and key not in self._own and now >= self._held_until(record):
                return Offer(accepted=False, changed=False, reason="expired")
            held = self._records.get(key)
            if held is not None:
                if held == record:
                    if own:
                        self._own.add(key)
                    if asked:
                        self._asked.add(key)
                    return Offer(accepted=True, changed=False)
                if not supersedes(record, held):
                    return Offer(
                        accepted=False,
                        changed=False,
                        reason=f"older than the held record (seq {held.seq})",
                    )
            else:
                full = self._full_for(record.publisher)
                if full and not own:
                    self._drop_expired(now)
                    full = self._full_for(record.publisher)
                if full and not own and not full.endswith("for this publisher"):
                    victim = self._victim(record.publisher, asked or key in self._asked)
                    if victim is not None:
                        self._forget(victim)
                        self._unlink(victim)
                        full = ""
                if full and not own:
                    return Offer(accepted=False, changed=False, reason=f"full ({full})")
            self._records[key] = record
            self._uses += 1
            self._used.setdefault(key, self._uses)
            if own:
                self._own.add(key)
            if asked:
                self._asked.add(key)
        return Offer(accepted=True, changed=True)

    def _held_until(self, record: NameRecord) -> float:
        """When another publisher's record stops being held (rule 3)."""
        cap = record.time + MAX_HOLD_S
        return cap if record.expires is None else min(record.expires, cap)

    def _full_for(self, publisher: str) -> str:
        if len(self._records) >= self.max_records:
            return f"{self.max_records} names held"
        count = sum(1 for r in self._records.values() if r.publisher == publisher)
        if count >= self.max_per_publisher:
            return f"{self.max_per_publisher} names held for this publisher"
        return ""

    def _victim(self, publisher: str, asked: bool) -> bytes | None:
        """The record a newcomer of rank ``asked`` by ``publisher`` may evict (rule 5)."""
        ranks: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}
        for key, record in self._records.items():
            if key not in self._own:
                ranks[key in self._asked][record.publisher] += 1
        for rank in (False, True):
            if rank and not asked:
                return None
            holdings = ranks[rank]
            if not holdings:
                continue
            greedy, held = holdings.most_common(1)[0]
            if rank == asked and held <= holdings[publisher] + 1:
                return None
            candidates = [
                (self._used.get(key, 0), key)
                for key, record in self._records.items()
                if record.publisher == greedy
                and key not in self._own
                and (key in self._asked) == rank
            ]
            return min(candidates)[1]
        return None

    def _forget(self, key: bytes) -> None:
        self._records.pop(key, None)
        self._own.discard(key)
        self._asked.discard(key)
        self._used.pop(key, None)

    def _drop_expired(self, now: float) -> None:
        for key, record in list(self._records.items()):
            if record.expires is not None and now >= record.expires:
                expired = True
            else:
                expired = key not in self._own and now >= self._held_until(record)
            if expired:
                self._forget(key)
                self._unlink(key)

    # --- disk --------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        assert self.directory is not None
        return self.directory / key.hex()

    def _asked_path(self, key: bytes) -> Path:
        assert self.directory is not None
        return self.directory / ASKED_DIR / key.hex()

    def persist_asked(self, key: bytes) -> None:
        """Save that this node asked for ``key`` (rule 6), if it did and it is not saved
        yet. Blocking: run it in a thread."""
        if self.directory is None or self.tmp_dir is None or key not in self._asked:
            return
        marker = self._asked_path(key)
        if marker.exists():
            return
        with os_errors(f"saving the rank of name record {key.hex()[:12]}"):
            marker.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomic(marker, b"", tmp_dir=self.tmp_dir, replace=True, mode=_FILE_MODE)

    def persist(self, key: bytes, *, now: float) -> None:
        """Write the current record for ``key`` durably (rule 4), unless the saved file
        already holds it or a newer one (another process wrote it; it is adopted).
        Blocking: run it in a thread. Raises blobstore's typed errors for local I/O
        failures."""
        if self.directory is None or self.tmp_dir is None:
            return
        with self._write_lock:
            record = self._records.get(key)
            if record is None:
                return
            with os_errors(f"saving the name record {record.ref}"), self._process_lock():
                self.directory.mkdir(exist_ok=True)
                path = self._path(key)
                saved = self._load_one(path, now) if path.exists() else None
                if saved is not None and saved.key == key and not supersedes(record, saved):
                    self.offer(saved, now=now, own=key in self._own)
                    return
                write_file_atomic(
                    self._path(key),
                    record.encode(),
                    tmp_dir=self.tmp_dir,
                    replace=True,
                    mode=_FILE_MODE,
                )
        self.persist_asked(key)

    @contextlib.contextmanager
    def _process_lock(self) -> Iterator[None]:
        """Hold ``lock_file`` (when set) against other processes' writes; StoreBusy
        after ``NAMES_LOCK_TIMEOUT`` seconds."""
        if self.lock_file is None:
            yield
            return
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            deadline = time.monotonic() + NAMES_LOCK_TIMEOUT
            while not try_lock_fd(fd):
                if time.monotonic() >= deadline:
                    raise StoreBusy(
                        f"{self.lock_file} has been held by another process for over "
                        f"{NAMES_LOCK_TIMEOUT:g} s; is a blob command stuck?"
                    )
                time.sleep(_LOCK_POLL)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _unlink(self, key: bytes) -> None:
        if self.directory is None:
            return
        for path in (self._path(key), self._asked_path(key)):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _saved_asked(self) -> set[str]:
        """The file names of the records this node asked for, by their markers (rule 6)."""
        assert self.directory is not None
        try:
            with os.scandir(self.directory / ASKED_DIR) as entries:
                return {e.name for e in entries if e.is_file(follow_symlinks=False)}
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def load(self, *, now: float, own_publisher: str | None = None) -> int:
        """Read the records saved under ``directory`` (rule 1), also those another
        process (``blob publish`` beside ``blob serve``) wrote since the last load;
        returns how many were new or newer. Files that do not verify, or expired, are
        deleted. Records by ``own_publisher`` count as this node's own (rule 3)."""
        if self.directory is None:
            return 0
        changed = 0
        with os_errors(f"reading name records in {self.directory}"):
            try:
                stamp = self.directory.stat().st_mtime_ns
                entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
            except FileNotFoundError:
                return 0
            self._dir_stamp = stamp
            asked = self._saved_asked()
            loaded: dict[str, tuple[int, int, int]] = {}
            for entry in entries[: self.max_records * 2]:
                if entry.name == ASKED_DIR:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                seen = (st.st_ino, st.st_mtime_ns, st.st_size)
                if self._loaded.get(entry.name) == seen and self._holds(entry.name, now):
                    loaded[entry.name] = seen
                    continue
                offer = self._offer_file(
                    Path(entry.path), now, own_publisher, asked=entry.name in asked
                )
                if offer.accepted:
                    loaded[entry.name] = seen
                if offer.changed:
                    changed += 1
            self._loaded = loaded
        return changed

    def _holds(self, file_name: str, now: float) -> bool:
        """Whether the live record of the file named ``file_name`` is held."""
        try:
            record = self._records.get(bytes.fromhex(file_name))
        except ValueError:
            return False
        return record is not None and (record.expires is None or now < record.expires)

    def load_if_changed(self, *, now: float, own_publisher: str | None = None) -> int:
        """:meth:`load` if a file was added or replaced since the last one (a rename
        into the directory changes its mtime), else nothing. Blocking."""
        if self.directory is None:
            return 0
        try:
            stamp = self.directory.stat().st_mtime_ns
        except OSError:
            return 0
        if stamp == self._dir_stamp:
            return 0
        return self.load(now=now, own_publisher=own_publisher)

    def reload_key(self, key: bytes, *, now: float, own_publisher: str | None = None) -> None:
        """Offer the saved file of one name, if any (another process may have written a
        newer record). Blocking: one small read."""
        if self.directory is None:
            return
        path = self._path(key)
        if path.exists():
            self._offer_file(path, now, own_publisher)

    def _offer_file(
        self, path: Path, now: float, own_publisher: str | None, *, asked: bool = False
    ) -> Offer:
        record = self._load_one(path, now)
        if record is None or record.key.hex() != path.name:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return Offer(accepted=False, changed=False, reason="unusable file")
        return self.offer(record, now=now, own=record.publisher == own_publisher, asked=asked)

    def _load_one(self, path: Path, now: float) -> NameRecord | None:
        try:
            with path.open("rb") as f:
                data = f.read(MAX_NAME_RECORD_SIZE + 1)
        except OSError as exc:
            log.warning("cannot read name record %s: %s", path, exc)
            return None
        try:
            return verify(data, now=now)
        except NameRejected as exc:
            log.warning("dropping saved name record %s: %s", path.name, exc)
            return None
