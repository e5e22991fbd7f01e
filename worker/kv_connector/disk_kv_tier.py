"""`DiskKVTier`: one rank's KV blocks in files, `<root>/<layout fingerprint>/<block hash>.kv`.

Writes and deletes run on one writer thread, in the order they were asked for, so a step never
waits on the disk; a block read while its write is still queued comes from the queue. On exit
the queue is drained (bounded by `FLUSH_TIMEOUT_S`); a process killed mid-write leaves only a
temporary file, which is never loaded (and removed at the next start once it is old).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from pathlib import Path

from core_engine.worker.kv_connector.kv_block_file import (
    SUFFIX,
    TEMP_SUFFIX,
    KVBlockFileError,
    block_file_name,
    read_block_file,
    read_block_header,
    write_block_file,
)
from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0
# A temporary file older than this belongs to no running writer: a process died writing it.
STALE_TEMP_FILE_S = 3600.0


class DiskKVTier:
    """Files of one layout under `root`; `read` raises `KVBlockFileError` for a block that is
    missing or must not be loaded (and deletes a file found damaged)."""

    def __init__(self, root: str | Path, layout: KVBlockLayout) -> None:
        self.layout = layout
        self.folder = Path(root) / layout.fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self._pending: dict[bytes, bytes] = {}  # hash -> payload queued for writing
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    def path_of(self, block_hash: bytes) -> Path:
        return self.folder / block_file_name(block_hash)

    def write(self, block_hash: bytes, payload: bytes) -> None:
        with self._lock:
            self._pending[block_hash] = payload
        self._queue.put(("write", block_hash))

    def delete(self, block_hash: bytes) -> None:
        self._queue.put(("delete", block_hash))

    def read(self, block_hash: bytes) -> bytes:
        with self._lock:
            payload = self._pending.get(block_hash)
        if payload is not None:
            return payload
        path = self.path_of(block_hash)
        try:
            return read_block_file(path, self.layout, block_hash)
        except KVBlockFileError:
            if path.exists():
                path.unlink(missing_ok=True)
            raise

    def scan(self) -> list[bytes]:
        """The hashes of this layout's whole files, least recently written first; damaged files
        and old temporary ones are removed."""
        found = []
        for path in self.folder.iterdir():
            if path.name.endswith(TEMP_SUFFIX):
                _remove_if_stale(path)
                continue
            block_hash = _hash_of(path)
            if block_hash is None:
                continue
            try:
                read_block_header(path, self.layout, block_hash)
                found.append((path.stat().st_mtime, block_hash))
            except (KVBlockFileError, OSError) as exc:
                logger.warning("KV disk tier: ignoring %s (%s)", path, exc)
                path.unlink(missing_ok=True)
        return [block_hash for _, block_hash in sorted(found)]

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Waits until every queued write and delete is done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        if not self._writer.is_alive():
            return
        if not self.flush():
            logger.warning("KV disk tier: writes still queued after %.0f s", FLUSH_TIMEOUT_S)
        self._queue.put(None)
        self._writer.join(timeout=1.0)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            operation, block_hash = item
            try:
                if operation == "write":
                    self._write_pending(block_hash)
                else:
                    self.path_of(block_hash).unlink(missing_ok=True)
            except OSError as exc:  # a full disk loses blocks, it stops nothing
                logger.warning(
                    "KV disk tier: %s of %s failed: %s", operation, block_hash.hex(), exc
                )
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write_pending(self, block_hash: bytes) -> None:
        with self._lock:
            payload = self._pending.get(block_hash)
        if payload is None:
            return
        try:
            write_block_file(self.path_of(block_hash), self.layout, block_hash, payload)
        finally:
            with self._lock:
                if self._pending.get(block_hash) is payload:
                    del self._pending[block_hash]


def _hash_of(path: Path) -> bytes | None:
    if not path.name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(path.name[: -len(SUFFIX)])
    except ValueError:
        return None


def _remove_if_stale(path: Path) -> None:
    try:
        if time.time() - path.stat().st_mtime > STALE_TEMP_FILE_S:
            path.unlink(missing_ok=True)
    except OSError:
        pass
