"""L3: KV blocks in a disk directory, one checksummed file per block, surviving restarts.

A file's name is ``blake2b(model fingerprint + chain hash)``: the fingerprint covers the weights,
dtype, KV dtype, block size and TP layout, and the chain hash covers every token before the block
and the tenant's ``cache_salt``, so another model's or tenant's file is never even looked up. A
file holds a header (magic, fingerprint, hash, token ids, payload length), the payload and a
blake2b checksum of all of it; a read verifies everything and a file that fails is deleted and
treated as a miss, never served. Writes go to a temp file renamed into place (atomic), so a crash
mid-write (kill -9) or a second engine on the same directory never exposes a partial file. A full
disk (ENOSPC/EDQUOT) stops writes with one warning until an eviction frees room.

The hash key must survive restarts too: unless ``$PAGEDLLM_HASH_KEY`` is set, the directory keeps a
random one in ``hash.key`` (mode 0600), shared by every engine using it. Methods may be called from
the tier's copy thread and the engine thread at once: the index is under a lock.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import struct
import threading
from array import array

from pagedllm.kv.tier_policy import LRUPolicy, ReusePolicy

log = logging.getLogger(__name__)

MAGIC = b"PGKVBLK1"
SUFFIX = ".kvb"
_TMP = ".tmp-"
_HEAD = struct.Struct("<8s32s16sI")  # magic, fingerprint, chain hash, number of token ids
_CHECKSUM = 16


def directory_hash_key(path: str) -> bytes:
    """The directory's persistent hash key, made once (O_EXCL: two engines starting together agree)."""
    os.makedirs(path, exist_ok=True)
    key_file = os.path.join(path, "hash.key")
    try:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    for _ in range(100):  # the creator may still be writing its 32 bytes
        with open(key_file, "rb") as f:
            key = f.read()
        if len(key) == 32:
            return key
        threading.Event().wait(0.01)
    raise ValueError(f"kv_disk_path: {key_file} is not a 32-byte key; remove it")


class DiskTier:
    """Files under ``path`` up to ``capacity_bytes``, evicted by ``policy``."""

    def __init__(self, path: str, capacity_bytes: int, fingerprint: bytes,
                 policy: LRUPolicy | ReusePolicy) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"kv_disk_size: must be > 0 bytes, got {capacity_bytes}")
        if len(fingerprint) != 32:
            raise ValueError("fingerprint: must be 32 bytes")
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.policy = policy
        self._lock = threading.Lock()
        self._size: dict[str, int] = {}  # file name -> bytes, every block file in the directory
        self.used_bytes = 0
        self.full = False  # the disk said ENOSPC: no writes until an eviction frees room
        self.num_corrupt = 0  # files that failed verification (deleted, never served)
        self._remove_dead_temps()
        self._index_existing()

    # ---- names -----------------------------------------------------------------------------

    def _name(self, block_hash: int) -> str:
        return hashlib.blake2b(self.fingerprint + block_hash.to_bytes(16, "little"), digest_size=20).hexdigest() + SUFFIX

    def _file(self, block_hash: int) -> str:
        return os.path.join(self.path, self._name(block_hash))

    def _index_existing(self) -> None:
        """Files left by earlier runs (any model's) count against the capacity, oldest first to go."""
        found = []
        for name in os.listdir(self.path):
            if name.endswith(SUFFIX):
                try:
                    st = os.stat(os.path.join(self.path, name))
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, name, st.st_size))
        for _, name, size in sorted(found):
            self._size[name] = size
            self.used_bytes += size
            self.policy.touch(name, depth=0, hits=0)

    def _remove_dead_temps(self) -> None:
        """Temp files of crashed writers (their pid is gone) are removed; live writers' stay."""
        for name in os.listdir(self.path):
            if not name.startswith(_TMP):
                continue
            pid = name[len(_TMP):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                _unlink(os.path.join(self.path, name))

    # ---- index -----------------------------------------------------------------------------

    def contains(self, block_hash: int) -> bool:
        """Known here, or written by another engine (or an earlier run) on this directory."""
        with self._lock:
            if self._name(block_hash) in self._size:
                return True
        return os.path.exists(self._file(block_hash))

    def __len__(self) -> int:
        return len(self._size)

    # ---- write -----------------------------------------------------------------------------

    def write(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes, depth: int = 0,
              hits: int = 1) -> bool:
        """Store one block; False when it was not written (disk full, or already there)."""
        name = self._name(block_hash)
        if self.contains(block_hash):
            with self._lock:
                if name in self._size:
                    self.policy.touch(name, depth, hits)
            return False
        body = _HEAD.pack(MAGIC, self.fingerprint, block_hash.to_bytes(16, "little"), len(token_ids))
        body += array("q", token_ids).tobytes() + struct.pack("<Q", len(payload)) + payload
        blob = body + hashlib.blake2b(body, digest_size=_CHECKSUM).digest()
        self._make_room(len(blob))
        if self.full:
            return False
        tmp = os.path.join(self.path, f"{_TMP}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._file(block_hash))  # atomic: readers see the whole file or none
        except OSError as e:
            _unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                log.warning("KV disk tier %s is full (%s): demotion to disk stops until blocks are evicted",
                            self.path, e.strerror)
                self.full = True
                return False
            raise
        with self._lock:
            if name not in self._size:  # (another engine may have renamed the same block in meanwhile)
                self._size[name] = len(blob)
                self.used_bytes += len(blob)
            self.policy.touch(name, depth, hits)
        return True

    def _make_room(self, nbytes: int) -> None:
        with self._lock:
            over = self.used_bytes + nbytes - self.capacity_bytes
            victims: list[str] = []
            while over > 0 and len(victims) < len(self._size):
                more = self.policy.victims(len(victims) + 1)[len(victims):]
                if not more:
                    break
                victims += more
                over -= self._size[more[0]]
            for h in victims:
                self._forget(h)
            if over > 0:
                self.full = True  # one file larger than the whole tier
                return
        for name in victims:
            _unlink(os.path.join(self.path, name))
        if victims:
            self.full = False

    def _forget(self, name: str) -> None:
        self.used_bytes -= self._size.pop(name)
        self.policy.remove(name)

    # ---- read ------------------------------------------------------------------------------

    def read(self, block_hash: int, token_ids: tuple[int, ...]) -> bytes | None:
        """The payload stored for this block, or None: missing, or failed verification (then deleted)."""
        name = self._name(block_hash)
        path = os.path.join(self.path, name)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            with self._lock:
                if name in self._size:
                    self._forget(name)
            return None
        payload = self._verify(blob, block_hash, token_ids)
        with self._lock:
            if payload is None:
                self.num_corrupt += 1
                if name in self._size:
                    self._forget(name)
            else:
                if name not in self._size:  # another engine wrote it since this one started: adopt it
                    self._size[name] = len(blob)
                    self.used_bytes += len(blob)
                self.policy.touch(name)
        if payload is None:
            log.warning("KV disk tier: %s failed verification; deleted, not served", os.path.basename(path))
            _unlink(path)
        return payload

    def _verify(self, blob: bytes, block_hash: int, token_ids: tuple[int, ...]) -> bytes | None:
        n_tok = len(token_ids)
        start = _HEAD.size + 8 * n_tok + 8
        if len(blob) < start + _CHECKSUM:
            return None
        if hashlib.blake2b(blob[:-_CHECKSUM], digest_size=_CHECKSUM).digest() != blob[-_CHECKSUM:]:
            return None
        magic, fp, h, n = _HEAD.unpack_from(blob)
        if (magic, fp, h, n) != (MAGIC, self.fingerprint, block_hash.to_bytes(16, "little"), n_tok):
            return None
        if blob[_HEAD.size:start - 8] != array("q", token_ids).tobytes():
            return None
        (size,) = struct.unpack_from("<Q", blob, start - 8)
        if len(blob) != start + size + _CHECKSUM:
            return None
        return blob[start:start + size]

    # ---- start-up and checks -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless the byte count and the policy match the index."""
        with self._lock:
            if sum(self._size.values()) != self.used_bytes:
                raise AssertionError(f"disk tier: used_bytes {self.used_bytes} != sum of files {sum(self._size.values())}")
            if self.policy.keys() != set(self._size):
                raise AssertionError("disk tier: eviction policy disagrees with the index")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
