"""Weight transport: named buckets; packed buckets (layout, exact round trip, refusals), the gloo broadcast."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from vexact_models import (
    BucketPacker,
    CheckpointError,
    NamedBuckets,
    TensorSpec,
    WeightSyncGroup,
    broadcast_weights,
    expected_tensors,
    load_bucket,
    named_buckets,
    random_model,
    receive_weights,
    send_buckets,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from vexact_models.weight_sync import ALIGN


def _named(model, dtype=torch.float32):
    return [(n, t.detach().to(dtype)) for n, t in expected_tensors(model).items()]


def _pack_all(named, bucket_bytes):
    packer = BucketPacker(bucket_bytes, "cpu")
    out = []
    for b in packer.buckets(named):
        out.append((packer.buffers[b.index][: b.nbytes].clone(), b.specs))
    return out


def test_named_buckets_stay_within_the_bound_and_a_larger_tensor_travels_alone():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate([3, 3, 2, 10, 1, 4])]
    buckets = list(named_buckets(named, bucket_bytes=16))  # 8 bf16 elements
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1", "t2"], ["t3"], ["t4", "t5"]]
    by_hand = NamedBuckets(16)
    closed = [b for b in (by_hand.add(n, t) for n, t in named) if b is not None] + [by_hand.finish()]
    assert [[n for n, _ in b] for b in closed] == [[n for n, _ in b] for b in buckets]
    assert by_hand.finish() is None and list(named_buckets([], 16)) == []
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer, got 0"):
        NamedBuckets(0)


def test_packing_casts_once_splits_large_tensors_by_rows_and_round_trips_bitwise():
    src = random_model(tiny_qwen3_config(torch_dtype="float32"), seed=1)
    dst = random_model(tiny_qwen3_config(), seed=2)
    named = _named(src)
    embed_bytes = 272 * 64 * 2
    buckets = _pack_all(named, embed_bytes // 3)  # the embedding takes 4 buckets
    for buf, specs in buckets:
        assert all(s.offset % ALIGN == 0 and s.offset + s.nbytes <= buf.numel() for s in specs)
    pieces = [s for _, specs in buckets for s in specs if s.name == "model.embed_tokens.weight"]
    assert len(pieces) == 4 and [p.rows[0] for p in pieces] == [0, 90, 180, 270] and pieces[-1].completes
    loaded = []
    for buf, specs in buckets:
        loaded += load_bucket(dst, buf, specs)
    assert sorted(loaded) == sorted(n for n, _ in named)
    for name, t in expected_tensors(dst).items():
        assert torch.equal(t, dict(named)[name].to(torch.bfloat16)), name  # the cast FSDP applies (RNE)


def test_stacked_experts_go_whole_or_per_expert():
    cfg = tiny_qwen3_moe_config()
    src, dst = random_model(cfg, seed=1), random_model(cfg, seed=2)
    stacked = [(n, p.detach()) for n, p in src.named_parameters()]  # experts as [E, ...] tensors
    loaded = []
    for buf, specs in _pack_all(stacked, 8 << 10):
        loaded += load_bucket(dst, buf, specs)
    assert sorted(loaded) == sorted(expected_tensors(dst))
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters(), strict=True))


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda s: s._replace(name="model.layers.9.nope.weight"), "no tensor of that name"),
        (lambda s: s._replace(shape=(s.shape[0] + 1, *s.shape[1:])), "shape"),
        (lambda s: s._replace(dtype=torch.float16), "dtype torch.float16 != the engine's torch.bfloat16"),
        (lambda s: s._replace(offset=s.offset + 10**9), "not an aligned range"),
        (lambda s: s._replace(rows=(0, 10**6)), "rows"),
    ],
)
def test_a_bad_spec_is_refused_by_name_and_nothing_is_copied(bad, match):
    src = random_model(tiny_qwen3_config(), seed=1)
    dst = random_model(tiny_qwen3_config(), seed=2)
    before = {n: t.clone() for n, t in expected_tensors(dst).items()}
    (buf, specs), *_ = _pack_all(_named(src, torch.bfloat16), 1 << 20)
    specs = [*specs[:-1], bad(specs[-1])]
    with pytest.raises(CheckpointError, match=match):
        load_bucket(dst, buf, specs)
    assert all(torch.equal(t, before[n]) for n, t in expected_tensors(dst).items())  # not even the good ones


def test_bad_arguments():
    model = random_model(tiny_qwen3_config(), seed=1)
    with pytest.raises(TypeError, match="uint8"):
        load_bucket(model, torch.zeros(8), [])
    with pytest.raises(TypeError, match="TensorSpec"):
        load_bucket(model, torch.zeros(8, dtype=torch.uint8), [("x", (1,), torch.bfloat16, 0)])
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketPacker(10, "cpu")
    with pytest.raises(TypeError, match="floating"):
        list(BucketPacker(1024, "cpu").buckets([("ids", torch.arange(4))]))
    with pytest.raises(ValueError, match="one row takes 2048 bytes"):
        list(BucketPacker(1024, "cpu").buckets([("w", torch.zeros(2, 1024))]))
    assert TensorSpec("w", (4, 8), torch.bfloat16, 0, (1, 3)).nbytes == 2 * 8 * 2


def test_send_buckets_keeps_one_bucket_in_flight_on_two_buffers():
    packer = BucketPacker(1024, "cpu")
    events = []

    def submit(bucket):
        events.append(("submit", bucket.index))
        return bucket.index

    def wait(index):
        events.append(("wait", index))

    named = [(f"w{i}", torch.randn(200)) for i in range(6)]  # 400 bytes each: two per bucket
    assert send_buckets(named, packer, submit, wait) == 6
    # bucket i+1 is packed while i is out; i is waited for before i+1 goes out (and before its buffer is reused)
    assert events == [("submit", 0), ("wait", 0), ("submit", 1), ("wait", 1), ("submit", 0), ("wait", 0)]


def test_send_buckets_waits_for_submits_that_return_nothing():
    """A submit returning None (a fire-and-forget send) is still waited for: the benchmark's first IPC path did that
    and the packer overwrote a buffer the engine was still reading (its weights came out wrong on the H100)."""
    packer = BucketPacker(1024, "cpu")
    waits = []
    named = [(f"w{i}", torch.randn(200)) for i in range(6)]
    assert send_buckets(named, packer, lambda bucket: None, waits.append) == 6
    assert waits == [None, None, None]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_broadcast_reaches_every_receiver_bitwise():
    """Rank 0 broadcasts (two buffers in turn), two receivers load; threads of one process, one gloo group."""
    src = random_model(tiny_qwen3_config(torch_dtype="float32"), seed=1)
    dsts = [random_model(tiny_qwen3_config(), seed=2 + r) for r in range(2)]
    port, results, errors = _port(), {}, []

    def member(rank):
        try:
            group = WeightSyncGroup("127.0.0.1", port, rank, 3, timeout_s=60)
            if rank == 0:
                results[0] = broadcast_weights(group, _named(src), 6 << 10)
            else:
                results[rank] = receive_weights(group, lambda b, s: load_bucket(dsts[rank - 1], b, s))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results[0] > len(expected_tensors(src))  # the embedding went in several pieces
    for dst in dsts:
        for name, t in expected_tensors(dst).items():
            assert torch.equal(t, expected_tensors(src)[name].to(torch.bfloat16)), name
