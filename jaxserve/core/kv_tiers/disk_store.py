"""The disk tier: one file per KV block under a private directory that engine processes on a host share.

    <disk_kv_path>/<model identity>-<dtype>/<key[:2]>/<key>.kv      (key: the block's 32-byte sha256, hex)

A file is a fixed header then the block's bytes (the host pool's slot, as it is):

    magic 8s | header size u32 | 0 u32 | payload bytes u64 | key 32s | model identity 32s | dtype 16s |
    blake2b-256 of the payload 32s                                     (little-endian; no pickle anywhere)

Writers publish atomically: a private temp file (0600, O_EXCL) is written, fsynced and renamed onto the
block's name, so a reader sees a whole file or none, and a writer killed mid-write leaves only a temp file
that is never read (and is removed once stale). A reader checks every header field and the checksum: any
mismatch or a short file is a miss and the file is deleted, never wrong KV. The model identity (a digest of
the model's config and weights, the dtype and the cache layout) is in the path and the header, so another
model never reads these blocks. The directory is this user's only (0700, refused when another user owns it
or can write it: jaxserve.private_dir); the size cap evicts the least recently used files by mtime (a hit
touches its file).
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from pathlib import Path

import numpy as np

from jaxserve.private_dir import private_directory

MAGIC = b"JAXSKV01"
HEADER = struct.Struct("<8sIIQ32s32s16s32s")
KEY_BYTES = 32
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 600.0  # a temp file this old belongs to a writer that died
_EVICT_TO = 0.9  # eviction brings the store down to this share of its cap


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskKVStore:
    def __init__(self, path: str, capacity_bytes: int, model_id: bytes, dtype: str, block_shape: tuple[int, ...]):
        """`model_id`: 32 bytes naming the model, its weights and the cache layout (kv_transfer.model_identity)."""
        if len(model_id) != 32:
            raise ValueError(f"model_id must be 32 bytes, got {len(model_id)}")
        self.dtype = np.dtype(dtype)
        self.block_shape = tuple(block_shape)
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.file_bytes = HEADER.size + self.block_bytes
        if capacity_bytes < self.file_bytes:
            raise ValueError(f"cache.disk_kv_gib holds {capacity_bytes} bytes, less than one block's file "
                             f"({self.file_bytes} bytes); raise cache.disk_kv_gib")
        self.capacity_bytes = capacity_bytes
        self.model_id = model_id
        self._dtype_field = self.dtype.name.encode().ljust(16, b"\0")
        fix = "set cache.disk_kv_path to a directory of your own (or null to turn the disk tier off)"
        root = private_directory(path, option="cache.disk_kv_path", fix=fix)
        self.directory = private_directory(str(root / f"{model_id.hex()[:32]}-{self.dtype.name}"),
                                           option="cache.disk_kv_path", fix=fix)
        self._lock = threading.Lock()
        self.num_corrupt = 0  # files that failed their checks (deleted)
        self.num_evictions = 0
        self._bytes = self._scan(remove_stale=True)[1]

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / f"{name}.kv"

    def contains(self, key: bytes) -> bool:
        return len(key) == KEY_BYTES and self._path(key).is_file()

    def write(self, key: bytes, block: np.ndarray) -> bool:
        """Publishes one block (False: it was on disk already, now touched as recently used)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"disk-tier keys are {KEY_BYTES}-byte sha256 block hashes, got {len(key)} bytes")
        path = self._path(key)
        if path.is_file():
            _touch(path)
            return False
        payload = np.ascontiguousarray(block, self.dtype)
        if payload.shape != self.block_shape:
            raise ValueError(f"block of shape {payload.shape} for a store of {self.block_shape} blocks")
        data = memoryview(payload).cast("B")
        header = HEADER.pack(MAGIC, HEADER.size, 0, len(data), key, self.model_id, self._dtype_field,
                             checksum(data))
        with self._lock:
            full = self._bytes + self.file_bytes > self.capacity_bytes
        if full:  # room is made before the file appears, so the directory never holds more than the cap
            self._evict(room=self.file_bytes)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{path.name}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._bytes += self.file_bytes
        return True

    def read(self, key: bytes) -> np.ndarray | None:
        """The block stored under `key`, or None (absent, or failed a check: then the file is deleted)."""
        if len(key) != KEY_BYTES:
            return None
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            raw = f.read(self.file_bytes + 1)
        ok = (info.st_uid == os.getuid() and not info.st_mode & 0o077 and len(raw) == self.file_bytes)
        if ok:
            magic, size, _, num_bytes, file_key, model_id, dtype, digest = HEADER.unpack_from(raw)
            payload = memoryview(raw)[HEADER.size:]
            ok = (magic == MAGIC and size == HEADER.size and num_bytes == self.block_bytes and file_key == key
                  and model_id == self.model_id and dtype == self._dtype_field and checksum(payload) == digest)
        if not ok:
            self.num_corrupt += 1
            self._remove(path)
            return None
        _touch(path)
        return np.frombuffer(raw, self.dtype, offset=HEADER.size).reshape(self.block_shape)

    def _remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            return  # another process removed it first
        with self._lock:
            self._bytes = max(0, self._bytes - size)

    def _scan(self, remove_stale: bool = False) -> tuple[list[tuple[float, int, Path]], int]:
        """(every block file as (mtime, size, path), their total size); stale temp files are removed."""
        files, total, now = [], 0, time.time()
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    if remove_stale and now - info.st_mtime > _STALE_TMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                files.append((info.st_mtime, info.st_size, Path(entry.path)))
                total += info.st_size
        return files, total

    def _evict(self, room: int = 0) -> None:
        """Deletes the least recently used files until the store, plus `room` bytes about to be written, is
        under its cap (other processes' files included: the directory is one store)."""
        files, total = self._scan(remove_stale=True)
        files.sort()
        target = min(self.capacity_bytes * _EVICT_TO, self.capacity_bytes - room)
        for _, size, path in files:
            if total <= target:
                break
            path.unlink(missing_ok=True)
            total -= size
            self.num_evictions += 1
        with self._lock:
            self._bytes = total

    @property
    def used_bytes(self) -> int:
        return self._bytes


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # evicted meanwhile (by another process)
