"""The prompt cache: the KV of sequences that left their slots, kept in host RAM up to a byte budget
(`glmcore serve --cache-ram`), so a conversation that comes back after others used its slot is restored
(BatchSession.import_prefix) instead of prefilled again.

Entries are whole sequences (their ids and one KVBlob), found through chained hashes of their fixed-size
blocks of ids, as vLLM's automatic prefix caching and llama.cpp's prompt cache key them: block i's key
hashes block i's ids and block i-1's key, so one key stands for the whole prefix up to its block. A
prompt's deepest key present finds the entries sharing its prefix up to that block boundary; the ids are
then compared, so what is restored is exactly the common prefix (a partial match counts at least down to
a block boundary, and a hash collision can never restore foreign KV). Least recently used entries go
first when the budget is full; a saved sequence supersedes the entries it extends (a conversation's
earlier turns).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..backend import KVBlob

BLOCK_TOKENS = 16        # ids per hashed block (vLLM's default block size)
DEFAULT_CACHE_MIB = 8192  # `glmcore serve --cache-ram`'s default: llama.cpp's (0 turns the cache off)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class CachedPrefix:
    """One saved sequence: its ids, its KV, and the chained keys of its full blocks."""
    tokens: tuple[int, ...]
    blob: KVBlob
    keys: list[bytes]


@dataclass(frozen=True)
class Match:
    entry: CachedPrefix
    n: int               # how many leading ids of the asked prompt the entry holds


@dataclass
class CacheStats:
    hits: int = 0        # placements restored from the cache
    misses: int = 0      # placements for which the cache held nothing longer than the slots did
    restored_tokens: int = 0
    saved: int = 0       # sequences stored
    evicted: int = 0     # entries dropped for the budget (superseded ones are not counted)
    refused: int = 0     # sequences larger than the whole budget, not stored


@dataclass
class PromptCache:
    budget: int                                    # bytes of KV blobs kept at most
    block: int = BLOCK_TOKENS
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self):
        self.entries: OrderedDict[int, CachedPrefix] = OrderedDict()     # id(entry) -> entry, LRU first
        self.index: dict[bytes, list[CachedPrefix]] = {}                  # block key -> entries holding it
        self.nbytes = 0

    def block_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The chained key of each full block of tokens."""
        ids = np.asarray(tokens[:len(tokens) // self.block * self.block], dtype=np.int64)
        keys, parent = [], b""
        for i in range(0, ids.size, self.block):
            parent = hashlib.blake2b(parent + ids[i:i + self.block].tobytes(), digest_size=16).digest()
            keys.append(parent)
        return keys

    def _best(self, tokens: Sequence[int], keys: list[bytes] | None = None) -> Match | None:
        keys = self.block_keys(tokens) if keys is None else keys
        for key in reversed(keys):
            holders = self.index.get(key)
            if holders:
                best = max(holders, key=lambda e: common_prefix(e.tokens, tokens))
                return Match(best, common_prefix(best.tokens, tokens))
        return None

    def lookup(self, tokens: Sequence[int], longer_than: int) -> Match | None:
        """The entry holding the longest prefix of tokens, if it is longer than `longer_than` (what the
        slots hold already): a hit, and the entry becomes the most recently used. Else a miss, None."""
        found = self._best(tokens)
        if found is None or found.n <= longer_than:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.restored_tokens += found.n
        self.entries.move_to_end(id(found.entry))
        return found

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds all of tokens already (saving them again would add nothing)."""
        found = self._best(tokens)
        return found is not None and found.n == len(tokens)

    def worth_saving(self, tokens: Sequence[int]) -> bool:
        """A sequence of at least one full block that no entry holds yet."""
        return self.budget > 0 and len(tokens) >= self.block and not self.covers(tokens)

    def put(self, tokens: Sequence[int], blob: KVBlob) -> bool:
        """Store blob (the KV of tokens[:blob.n]), evicting least recently used entries to stay within the
        budget; entries it extends go. False (nothing stored) when it alone exceeds the budget."""
        tokens = tuple(int(t) for t in tokens[:blob.n])
        keys = self.block_keys(tokens)
        if not keys:                 # shorter than a block: no key could ever find it
            return False
        if blob.nbytes > self.budget:
            self.stats.refused += 1
            return False
        for old in list(self.index.get(keys[0], ())):
            if len(old.tokens) <= len(tokens) and tokens[:len(old.tokens)] == old.tokens:
                self._remove(old)
        while self.nbytes + blob.nbytes > self.budget:
            self._remove(next(iter(self.entries.values())))
            self.stats.evicted += 1
        entry = CachedPrefix(tokens, blob, keys)
        self.entries[id(entry)] = entry
        for key in keys:
            self.index.setdefault(key, []).append(entry)
        self.nbytes += blob.nbytes
        self.stats.saved += 1
        return True

    def _remove(self, entry: CachedPrefix) -> None:
        del self.entries[id(entry)]
        for key in entry.keys:
            holders = self.index[key]
            holders.remove(entry)
            if not holders:
                del self.index[key]
        self.nbytes -= entry.blob.nbytes

    def clear(self) -> None:
        for entry in list(self.entries.values()):
            self._remove(entry)

    def __len__(self) -> int:
        return len(self.entries)

