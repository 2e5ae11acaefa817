"""A model of PyTorch's CUDA caching allocator, to predict what a CUDA training step reserves from a replay
made anywhere (a CPU machine included): the allocator's rounding, its two pools, segment sizes, block
splitting, best-fit reuse of cached blocks and the merging of freed neighbours.

A fake-tensor replay counts the bytes each storage holds (rounded to the allocator's 512-byte block on
CUDA: ``torch.cuda.max_memory_allocated``). What the device must really hold is what the allocator
*reserves* from the driver (``torch.cuda.max_memory_reserved``): whole segments, kept cached after their
blocks are freed and reused for later requests only when a free block is large enough. :class:`CachingAllocator`
replays the same sequence of allocations and frees through the allocator's rules (c10/cuda/
CUDACachingAllocator.cpp, default configuration: no ``max_split_size_mb``, no ``expandable_segments``, one
stream):

* a request is rounded up to a multiple of 512 bytes (at least 512);
* requests of at most 1 MiB are served from the small pool, whose segments are 2 MiB; larger ones from the
  large pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB
  otherwise;
* the smallest cached free block of the pool that holds the request is used (best fit, then lowest address);
  it is split when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool);
* a freed block merges with free neighbours of its segment; segments are never returned to the driver
  unless an allocation would exceed the device's memory: then every wholly free segment is released and the
  allocation retried (``release_cached_blocks``), and only if that fails is it out of memory.

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) the allocator maps
2 MiB pages into one growing segment per pool instead; :func:`simulate` models that as the live bytes of each
pool rounded up to 2 MiB at every moment (no fragmentation between segments).

Not modelled: several streams (blocks are cached per stream), CUDA graphs' private pools, the
``garbage_collection_threshold`` and ``roundup_power2_divisions`` options, and memory the CUDA context,
cuBLAS/cuDNN workspaces and NCCL take outside the allocator.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "MIN_LARGE_ALLOC", "LARGE_BUFFER", "ROUND_LARGE",
           "round_size", "segment_size", "CachingAllocator", "AllocatorPeaks", "OutOfMemory", "simulate"]

MIN_BLOCK = 512                 # kMinBlockSize: every request is rounded up to a multiple of this
SMALL_SIZE = 1 << 20            # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 << 20          # kSmallBuffer: the small pool's segment size
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc: large requests below this share a 20 MiB segment
LARGE_BUFFER = 20 << 20         # kLargeBuffer
ROUND_LARGE = 2 << 20           # kRoundLarge: larger segments are the request rounded up to this


def round_size(n: int) -> int:
    """Bytes the allocator hands out for a request of ``n`` bytes (``round_size``)."""
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def segment_size(n: int) -> int:
    """Bytes the allocator asks the driver for when no cached block holds a (rounded) request of ``n``."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-n // ROUND_LARGE) * ROUND_LARGE


class OutOfMemory(RuntimeError):
    """The modelled allocator could not serve a request within the device's memory, even after releasing
    its cached segments."""


@dataclass
class _Block:
    addr: int
    size: int
    small: bool
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None

    def key(self):
        return (self.size, self.addr)


@dataclass
class AllocatorPeaks:
    """What a sequence of allocations and frees makes the allocator hold (bytes)."""

    #: the largest sum of allocated (rounded) blocks: ``torch.cuda.max_memory_allocated``
    allocated: int = 0
    #: the largest sum of segments held from the driver: ``torch.cuda.max_memory_reserved``
    reserved: int = 0
    #: segments asked from the driver, and released back (on memory pressure)
    segments: int = 0
    released: int = 0
    #: set when the budget could not be met (the request that failed, in bytes)
    oom_request: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def oom(self) -> bool:
        return self.oom_request is not None


class CachingAllocator:
    """The caching allocator's state: segments, their blocks, and the free blocks of each pool (sorted by
    size, then address). ``budget``: bytes the driver can give (None: unlimited)."""

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.free_small: list[tuple[int, int]] = []
        self.free_large: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}  # free blocks by key
        self.segments: dict[int, tuple[_Block, int]] = {}  # segment start address -> (first block, size)
        self.allocated = 0
        self.reserved = 0
        self.peaks = AllocatorPeaks()
        self._next_addr = 0

    # -- the pools ------------------------------------------------------------------------------------
    def _pool(self, small: bool) -> list[tuple[int, int]]:
        return self.free_small if small else self.free_large

    def _insert_free(self, b: _Block) -> None:
        b.free = True
        bisect.insort(self._pool(b.small), b.key())
        self.blocks[b.key()] = b

    def _remove_free(self, b: _Block) -> None:
        pool = self._pool(b.small)
        i = bisect.bisect_left(pool, b.key())
        del pool[i]
        del self.blocks[b.key()]

    # -- malloc / free --------------------------------------------------------------------------------
    def malloc(self, n: int) -> _Block:
        size = round_size(n)
        small = size <= SMALL_SIZE
        pool = self._pool(small)
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = self.blocks[pool[i]]
            self._remove_free(block)
        else:
            block = self._new_segment(size, small)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = _Block(block.addr + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert_free(tail)
        block.free = False
        self.allocated += block.size
        self.peaks.allocated = max(self.peaks.allocated, self.allocated)
        return block

    def _new_segment(self, size: int, small: bool) -> _Block:
        seg = segment_size(size)
        if self.budget is not None and self.reserved + seg > self.budget:
            self.release_cached()
            if self.reserved + seg > self.budget:
                self.peaks.oom_request = size
                raise OutOfMemory(f"{size} bytes requested, {self.reserved} reserved, budget {self.budget}")
        addr = self._next_addr
        self._next_addr += seg + SMALL_BUFFER  # segments never touch: blocks merge only inside one
        block = _Block(addr, seg, small)
        self.segments[addr] = (block, seg)
        self.reserved += seg
        self.peaks.segments += 1
        self.peaks.reserved = max(self.peaks.reserved, self.reserved)
        return block

    def free(self, block: _Block) -> None:
        self.allocated -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                self._remove_free(nb)
                if nb is block.prev:  # merge into the previous block
                    nb.size += block.size
                    nb.next = block.next
                    if block.next is not None:
                        block.next.prev = nb
                    block = nb
                else:
                    block.size += nb.size
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
        self._insert_free(block)

    def release_cached(self) -> None:
        """Return every wholly free segment to the driver (what the allocator does before reporting OOM)."""
        for addr, (first, seg) in list(self.segments.items()):
            if first.free and first.next is None and first.prev is None and first.size == seg:
                self._remove_free(first)
                del self.segments[addr]
                self.reserved -= seg
                self.peaks.released += 1


def simulate(events: Iterable[tuple[int, object]], *, budget: int | None = None,
             expandable_segments: bool = False) -> AllocatorPeaks:
    """Replay ``events`` through the allocator model: ``(+bytes, key)`` allocates a block for storage ``key``,
    ``(-bytes, key)`` frees it (a free of a key never allocated here is ignored: the storage was made before
    the events began). Returns the peaks; with ``budget``, ``oom_request`` is set at the first request that
    cannot be served even after releasing cached segments (the events stop there)."""
    if expandable_segments:
        return _simulate_expandable(events, budget)
    alloc = CachingAllocator(budget)
    live: dict[object, _Block] = {}
    try:
        for n, key in events:
            if n > 0:
                if key in live:  # a storage counted twice: keep the first block
                    continue
                live[key] = alloc.malloc(n)
            elif n < 0:
                b = live.pop(key, None)
                if b is not None:
                    alloc.free(b)
    except OutOfMemory:
        pass
    return alloc.peaks


def _simulate_expandable(events, budget) -> AllocatorPeaks:
    peaks = AllocatorPeaks(notes=["expandable segments: each pool's live bytes rounded up to 2 MiB pages"])
    live: dict[object, int] = {}
    pools = {True: 0, False: 0}
    for n, key in events:
        if n > 0:
            if key in live:
                continue
            size = round_size(n)
            live[key] = size
            pools[size <= SMALL_SIZE] += size
        elif n < 0 and key in live:
            size = live.pop(key)
            pools[size <= SMALL_SIZE] -= size
            continue
        else:
            continue
        allocated = pools[True] + pools[False]
        reserved = sum(-(-v // ROUND_LARGE) * ROUND_LARGE for v in pools.values())
        peaks.allocated = max(peaks.allocated, allocated)
        if budget is not None and reserved > budget:
            peaks.oom_request = live[key]
            break
        peaks.reserved = max(peaks.reserved, reserved)
    return peaks
