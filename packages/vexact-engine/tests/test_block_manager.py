"""The block manager's bookkeeping: reference counts, prefix-cache keys, eviction order, reset."""

from __future__ import annotations

import pytest

from vexact_engine import SamplingParams
from vexact_engine.block_manager import BlockManager
from vexact_engine.sequence import Sequence


def _seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(), seed=0, arrival=0)


def _admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler does on admission: take the cached prefix, allocate the rest, register full pages."""
    prefix = bm.match_prefix(seq)
    assert bm.can_allocate_with_prefix(seq, prefix, seq.num_tokens)
    bm.take_prefix(seq, prefix)
    bm.allocate(seq, seq.num_tokens)
    bm.cache_full_blocks(seq, seq.num_tokens)
    return prefix


def test_shared_pages_are_reference_counted_and_stay_cached_when_freed():
    bm = BlockManager(8, 4)
    a = _seq("a", list(range(10)))  # pages [0-3] [4-7] [8, 9]
    assert _admit(bm, a) == [] and bm.num_cached == 2 and bm.num_free == 5
    b = _seq("b", list(range(9)))  # shares a's two full pages; computes only token 8
    assert _admit(bm, b) == a.block_table[:2] and b.num_computed_tokens == 8
    assert [bm.ref_counts[p] for p in a.block_table[:2]] == [2, 2] and bm.num_free == 4
    c = _seq("c", list(range(8)))  # the page holding the last token is never reused
    full = a.block_table[:2]
    assert bm.match_prefix(c) == full[:1]
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8 and bm.num_cached == 2  # all free; the full pages still cached (evictable)
    assert bm.match_prefix(_seq("d", list(range(12)))) == full
    assert bm.match_prefix(_seq("e", [0, 1, 2, 9, 4, 5, 6, 7, 8])) == []  # one token off in the first page


def test_eviction_takes_plain_pages_first_then_least_recently_freed_leaves_first():
    bm = BlockManager(4, 2)
    a = _seq("a", [1, 2, 3, 4, 5])  # pages: [1, 2] [3, 4] [5]
    _admit(bm, a)
    pages = list(a.block_table)
    bm.free(a)
    x = _seq("x", [9])
    bm.allocate(x, 1)  # a never-cached page comes first: the cache is untouched
    assert x.block_table[0] not in pages[:2] and bm.num_cached == 2
    y = _seq("y", [8, 8, 8, 8])
    bm.allocate(y, 4)  # two more pages: the plain one, then the cached leaf [3, 4] (freed before its parent)
    assert pages[1] in y.block_table and pages[0] not in y.block_table and bm.num_cached == 1
    assert bm.match_prefix(_seq("z", [1, 2, 3, 4, 5])) == [pages[0]]


def test_reset_forgets_every_page_and_ids_are_never_reused():
    bm = BlockManager(6, 2)
    a = _seq("a", [1, 2, 3, 4, 5])
    _admit(bm, a)
    bm.reset_prefix_cache()
    assert bm.num_cached == 0 and bm.match_prefix(_seq("b", [1, 2, 3, 4, 5])) == []
    bm.free(a)
    assert bm.num_free == 6 and len(bm.free_blocks) == 6
    off = BlockManager(6, 2, enable_prefix_caching=False)
    _admit(off, _seq("a", [1, 2, 3, 4, 5]))
    assert off.num_cached == 0 and off.match_prefix(_seq("b", [1, 2, 3, 4, 5])) == []


def test_a_sequence_holding_pages_cannot_take_a_prefix():
    bm = BlockManager(4, 2)
    a = _seq("a", [1, 2, 3])
    bm.allocate(a, 3)
    with pytest.raises(RuntimeError, match="already holds pages"):
        bm.take_prefix(a, [])


@pytest.mark.parametrize("page", [1, 4, 16, 128])
def test_slots_of_a_range_are_the_slots_of_its_positions(page):
    """``slots(seq, start, end)`` (a prefill chunk's KV slots, a page at a time) == ``slot`` of each position, for
    ranges starting and ending mid-page, on a page boundary, within one page, and empty."""
    bm = BlockManager(640 // page + 8, page)
    seq = Sequence("a", list(range(600)), SamplingParams(), 0, 0)
    bm.allocate(seq, 3)  # a page in front, then the sequence's pages out of order
    other = Sequence("b", [1] * 40, SamplingParams(), 0, 1)
    bm.allocate(other, 40)
    bm.allocate(seq, 600)
    for start, end in [(0, 600), (5, 517), (page, 3 * page), (page - 1, page + 1), (7, 8), (9, 9), (599, 600)]:
        assert bm.slots(seq, start, end) == [bm.slot(seq, p) for p in range(start, end)], (start, end)
