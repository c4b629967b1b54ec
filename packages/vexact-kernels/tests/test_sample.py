"""The fused draw (``sample_from_hidden``): Gumbel-max with counter-based Philox noise, in one pass over the lm_head.

Checks: the torch Philox twin equals a plain-Python Philox-4x32-10 (checked against Random123's known answers, and
so Triton's ``philox_impl``), one call per four columns; the Triton kernel (interpreter on CPU, the GPU at real
shapes) draws the reference's tokens and reports, bit for bit, the fused logprobs kernel's logprob of the drawn token
(the trainer's number); skipping the noise of tiles that cannot win changes no draw, nor does drawing the noise of
only the real rows' part of the row block at small T; a row's draw does not depend on the other rows; the draws follow
``softmax(logits / T)``.
"""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available

interp = pytest.mark.skipif(
    not (triton_available() and interpreting()), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)"
)


def _philox_py(counter: tuple[int, int, int, int], key: tuple[int, int]) -> list[int]:
    """The four output words of Philox-4x32-10."""
    c, k = list(counter), list(key)
    for _ in range(10):
        p_b, p_a = 0xCD9E8D57 * c[2], 0xD2511F53 * c[0]
        c = [(p_b >> 32) ^ c[1] ^ k[0], p_b & 0xFFFFFFFF, (p_a >> 32) ^ c[3] ^ k[1], p_a & 0xFFFFFFFF]
        k = [(k[0] + 0x9E3779B9) & 0xFFFFFFFF, (k[1] + 0xBB67AE85) & 0xFFFFFFFF]
    return c


def _uniform_py(col: int, seed: int) -> float:
    """The uniform of one column: word ``col % 4`` of counter ``(col // 4, 0, 0, 0)``, key = the seed's halves."""
    word = _philox_py((col // 4, 0, 0, 0), (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))[col % 4]
    return ((word >> 9) + 0.5) * 2.0**-23


def test_python_philox_is_philox_4x32_10():
    """Random123's known-answer vectors for philox4x32 with 10 rounds."""
    assert _philox_py((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert _philox_py((2**32 - 1,) * 4, (2**32 - 1,) * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert _philox_py(*pi) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_gumbel_uniform_is_philox_4x32_10_and_inside_the_open_interval():
    seeds = torch.tensor([0, 1, 123456789012345, (1 << 63) - 1], dtype=torch.int64)
    u = vk.gumbel_uniform(seeds, 5001)  # not a multiple of 4: the last counter serves one column
    assert u.shape == (4, 5001)
    for i, seed in enumerate(seeds.tolist()):
        for col in (0, 1, 2, 3, 4, 7, 777, 4999, 5000):
            want = torch.tensor(_uniform_py(col, seed), dtype=torch.float32)
            assert torch.equal(u[i, col], want), (seed, col)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    # the four words of a counter are independent: neighbouring columns are uncorrelated, whichever word they take
    for k in range(4):
        a, b = u[:, k::4][:, :1249].flatten(), u[:, k + 1 :: 4][:, :1249].flatten()
        assert abs(float(torch.corrcoef(torch.stack((a, b)))[0, 1])) < 0.05, k
    # the numpy words (CPU) == the torch-limb words (every other device)
    from vexact_kernels.sample import _philox_words_np, _philox_words_torch

    for vocab in (5001, 5000, 3, 1):
        assert torch.equal(
            torch.from_numpy(_philox_words_np(seeds.numpy(), vocab)), _philox_words_torch(seeds, vocab)
        ), vocab
    # a row's noise is its seed's alone, and a shorter vocabulary is a prefix
    assert torch.equal(vk.gumbel_uniform(seeds[2:3], 5001), u[2:3])
    assert torch.equal(vk.gumbel_uniform(seeds, 1003), u[:, :1003])
    with pytest.raises(TypeError, match="int64"):
        vk.gumbel_uniform(seeds.int(), 10)


def _problem(t, h, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (3 * torch.randn(t, h, generator=g)).to(torch.bfloat16)
    norm_w = (1.0 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16)
    head = (torch.randn(v, h, generator=g) / h**0.5).to(torch.bfloat16)
    temps = 0.5 + torch.rand(t, generator=g)
    seeds = torch.randint(0, 2**62, (t,), generator=g)
    return hidden, norm_w, head, temps, seeds


def _reference_tokens(hidden, norm_w, head, temps, seeds):
    """Tokens from the CPU reference path (logits, the torch noise twin, argmax), and each row's score gap
    between its best and second-best token (draws may differ only where the two are within rounding)."""
    with vk.use_backend("invariant"):
        logits = vk.compute_logits(hidden, norm_w, 1e-6, head)
    scores = logits / temps[:, None] - torch.log(-torch.log(vk.gumbel_uniform(seeds, head.shape[0])))
    top2 = scores.topk(2, dim=-1).values
    return scores.argmax(-1), top2[:, 0] - top2[:, 1]


def _peaked_problem(t, h, v, peaks, seed=0, flat_rows=()):
    """Logits peaked like a trained model's: every row's hidden state leans on one direction ``d``, and the lm_head
    rows of ``peaks`` point along it, so those columns have logits near 38 (decreasing by 0.5 along ``peaks``) over
    a bulk of about N(0, 1); the rows in ``flat_rows`` have random hidden states, hence no peak."""
    hidden, norm_w, head, temps, seeds = _problem(t, h, v, seed)
    g = torch.Generator().manual_seed(seed + 1)
    d = torch.randn(h, generator=g)
    lean = d + 0.3 * torch.randn(t, h, generator=g)
    flat = torch.zeros(t, dtype=torch.bool)
    flat[list(flat_rows)] = True
    hidden = torch.where(flat[:, None], hidden.float(), lean).to(torch.bfloat16)
    head = head.float()
    for i, col in enumerate(peaks):
        head[col] = (40 - 0.5 * i) * d / d.dot(d)
    return hidden, norm_w, head.to(torch.bfloat16), temps, seeds


def _check_draw(ops, hidden, norm_w, head, temps, seeds, subsets=()):
    """The interpreted fused draw against the torch reference, its logprob against the scoring form (bitwise), and
    row subsets against the full batch (bitwise); returns the tokens and logprobs."""
    from vexact_kernels.triton_ops import sample as sample_ops

    normed = vk.rms_norm(hidden, norm_w, 1e-6)
    tokens, lp = sample_ops.triton_sample_logprobs(normed, head, temps, seeds)
    want, gap = _reference_tokens(hidden, norm_w, head, temps, seeds)
    differ = tokens != want
    assert not differ.any() or bool((gap[differ] < 1e-4).all()), (tokens, want)
    lp_trainer, _ = ops.triton_logprobs(normed, head, tokens, temps)
    assert torch.equal(lp, lp_trainer)
    for idx in subsets:
        i = torch.tensor(idx)
        t1, lp1 = sample_ops.triton_sample_logprobs(normed[i], head, temps[i], seeds[i])
        assert torch.equal(t1, tokens[i]) and torch.equal(lp1, lp[i]), idx
    return tokens, lp


@interp
@pytest.mark.parametrize("split_tiles", [None, 1])
def test_interpreted_kernel_draws_the_reference_token_with_the_trainer_logprob(split_tiles, monkeypatch):
    from vexact_kernels.triton_ops import logprobs as ops

    if split_tiles:  # several vocabulary splits at a small V: the split fold picks the winner
        monkeypatch.setattr(ops, "LOGPROBS_SPLIT_TILES", split_tiles)
    # 70 rows: two row blocks, the second mostly padding
    _check_draw(ops, *_problem(70, 48, 300, seed=3), subsets=([3], [65, 3, 40], list(range(64, 70))))


@interp
@pytest.mark.parametrize("flat_rows", [(), (4,)])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf + inf, an empty tile's bound
def test_interpreted_kernel_skips_the_noise_of_tiles_that_cannot_win_with_the_same_draws(flat_rows, monkeypatch):
    """Peaked logits: after the tile holding a row's peak, tiles whose best logit is more than the largest noise
    below the row's best score cannot win. Their noise is skipped (counted here) where every real row of the row
    block agrees (one flat row keeps its tiles live); tokens and logprobs are those of the unskipped draw, and of the
    reference. V = 1100: 9 tiles with peaks in tiles 0 and 2, in two splits of 8 (the second's last 7 are empty)."""
    from vexact_kernels.triton_ops import gumbel
    from vexact_kernels.triton_ops import logprobs as ops

    problem = _peaked_problem(7, 48, 1100, peaks=(77, 5, 290), seed=6, flat_rows=flat_rows)
    calls = []
    noise = gumbel.tile_noise

    def counted(*args):  # the interpreter runs the kernel's helpers as Python functions
        calls.append(int(args[2]) // ops.LOGPROBS_VOCAB_BLOCK)  # col0
        return noise(*args)

    monkeypatch.setattr(gumbel, "tile_noise", counted)  # _draw_tile reads it there

    hidden, norm_w, head, temps, seeds = problem

    def draw(subsets):
        """The draws of all rows and tiles with noise per launch: all rows, then each subset (checked against all)."""
        counts = []
        for idx in [list(range(7))] + subsets:
            calls.clear()
            out = _check_draw(ops, hidden[idx], norm_w, head, temps[idx], seeds[idx])
            counts.append(sorted(calls))
            if len(counts) == 1:
                tokens, lp = out
            else:
                assert torch.equal(out[0], tokens[idx]) and torch.equal(out[1], lp[idx]), idx
        return (tokens, lp), counts

    (tokens, lp), counts = draw([[3], [6, 0]])
    assert set(tokens[[i for i in range(7) if i not in flat_rows]].tolist()) <= {5, 77, 290}
    want = [[0, 2, 8]] * 3  # the peaks' tiles and the second split's first tile
    if flat_rows:
        want[0] = list(range(9))  # the flat row's logits leave every tile in reach
    assert counts == want
    monkeypatch.setattr(ops, "GUMBEL_NOISE_MAX", float("inf"))  # no skip: every tile's noise, empty ones included
    (tokens_all, lp_all), counts = draw([])
    assert torch.equal(tokens_all, tokens) and torch.equal(lp_all, lp)
    assert counts == [list(range(16))]


@interp
@pytest.mark.parametrize("peaked", [False, True])
def test_interpreted_draw_rows_give_the_tokens_and_bits_of_the_full_row_block(peaked, monkeypatch):
    """At small T the noise covers only the first 1 or 16 rows of the row block (``SAMPLE_DRAW_ROWS``, checked by
    the shape each tile's noise is drawn at): tokens and logprobs are those of the form drawing the noise of all 64
    rows (``SAMPLE_DRAW_ROWS = ()``), bit for bit, the reference's and the trainer's, and a row's draw is the same
    at every T. Random logits in several vocabulary splits (one tile each); peaked ones (V = 600: 5 tiles in one
    split, peaks in tiles 0 and 2) for the skip, with a flat row (row 2) that keeps every tile live."""
    from vexact_kernels.triton_ops import gumbel
    from vexact_kernels.triton_ops import logprobs as ops

    small_form = (1, 16)
    monkeypatch.setattr(ops, "SAMPLE_DRAW_ROWS", small_form)
    if peaked:
        problem = _peaked_problem(17, 48, 600, peaks=(77, 5, 290), seed=9, flat_rows=(2,))
    else:
        monkeypatch.setattr(ops, "LOGPROBS_SPLIT_TILES", 1)
        problem = _problem(17, 48, 300, seed=10)
    hidden, norm_w, head, temps, seeds = problem
    shapes = []
    noise = gumbel.tile_noise

    def counted(*args):  # the interpreter runs the kernel's helpers as Python functions
        out = noise(*args)
        shapes.append(tuple(int(n) for n in out.shape))
        return out

    monkeypatch.setattr(gumbel, "tile_noise", counted)  # _draw_tile reads it there
    tokens, lp = _check_draw(ops, *problem)  # T = 17: the full row block
    for t, rows in ((1, 1), (2, 16), (5, 16), (16, 16), (17, 64)):
        shapes.clear()
        small = _check_draw(ops, hidden[:t], norm_w, head, temps[:t], seeds[:t])
        assert shapes and set(shapes) == {(rows, ops.LOGPROBS_VOCAB_BLOCK)}, (t, shapes)
        if peaked:  # rows 0 and 1 alone skip the noise of tiles 1, 3 and 4
            assert len(shapes) == (2 if t <= 2 else 5), (t, len(shapes))
        idx = list(range(t - 1, -1, -1))  # the same rows in the other order
        back = _check_draw(ops, hidden[idx], norm_w, head, temps[idx], seeds[idx])
        assert torch.equal(back[0], small[0][idx]) and torch.equal(back[1], small[1][idx]), t
        monkeypatch.setattr(ops, "SAMPLE_DRAW_ROWS", ())
        shapes.clear()
        full = _check_draw(ops, hidden[:t], norm_w, head, temps[:t], seeds[:t])
        assert set(shapes) == {(ops.LOGPROBS_BLOCK_T, ops.LOGPROBS_VOCAB_BLOCK)}, (t, shapes)
        monkeypatch.setattr(ops, "SAMPLE_DRAW_ROWS", small_form)
        assert torch.equal(small[0], full[0]) and torch.equal(small[1], full[1]), t
        assert torch.equal(small[0], tokens[:t]) and torch.equal(small[1], lp[:t]), t


@interp
def test_interpreted_gumbel_argmax_over_given_logits_draws_the_reference_token(monkeypatch):
    """The draw for logits computed elsewhere (the fast backend's): chunked over the vocabulary, same noise."""
    from vexact_kernels.triton_ops import sample as sample_ops

    monkeypatch.setattr(sample_ops, "GUMBEL_BLOCK", 64)  # several chunks at a small V: the first-chunk tie rule
    hidden, norm_w, head, temps, seeds = _problem(6, 32, 300, seed=4)
    with vk.use_backend("invariant"):
        logits = vk.compute_logits(hidden, norm_w, 1e-6, head)
    tokens = sample_ops.triton_gumbel_argmax(logits, temps, seeds)
    want, gap = _reference_tokens(hidden, norm_w, head, temps, seeds)
    differ = tokens != want
    assert not differ.any() or bool((gap[differ] < 1e-4).all()), (tokens, want)


if triton_available():
    import triton
    import triton.language as tl

    from vexact_kernels.triton_ops.gumbel import gumbel_noise

    @triton.jit
    def _noise_of_every_uniform(out_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, gumbel_noise(i.to(tl.uint32) << 9))  # word i << 9: the i-th of the 2**23 uniforms


def _check_noise_bound(device: str, block: int) -> None:
    """The kernels' noise at each of the 2**23 uniforms is finite, within rounding of torch's, largest at the
    largest uniform and below ``GUMBEL_NOISE_MAX``, the bound of the tile skip."""
    from vexact_kernels.triton_ops import gumbel

    n = 2**23
    out = torch.empty(n, device=device)
    _noise_of_every_uniform[(n // block,)](out, BLOCK=block)
    out = out.cpu()
    u = (torch.arange(n, dtype=torch.float32) + 0.5) * 2.0**-23
    assert torch.isfinite(out).all()
    assert float((out - -torch.log(-torch.log(u))).abs().max()) < 1e-4
    assert int(out.argmax()) == n - 1 and float(out.max()) < gumbel.GUMBEL_NOISE_MAX
    assert float(out.max()) > gumbel.GUMBEL_NOISE_MAX - 0.15  # and close to it: the skip stays as sharp as it can


@interp
def test_interpreted_noise_stays_below_the_skip_bound():
    _check_noise_bound("cpu", 2**20)


def test_reference_path_draws_from_the_softmax_and_reports_the_trainer_logprob():
    """CPU reference (invariant and fast backends): the logprob is ``logprobs_from_hidden``'s; the draw follows
    softmax(logits / T) (a chi-square-style check over many seeds of one row)."""
    hidden, norm_w, head, temps, _ = _problem(1, 32, 12, seed=5)
    n = 4000
    rows = hidden.expand(n, -1).contiguous()
    t = temps.expand(n).contiguous()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    for backend in ("invariant", "fast"):
        with vk.use_backend(backend):
            tokens, lp = vk.sample_from_hidden(rows, norm_w, 1e-6, head, t, seeds)
            lp_trainer, _ = vk.logprobs_from_hidden(rows, norm_w, 1e-6, head, tokens, t)
        assert tokens.dtype == torch.int64 and torch.equal(lp, lp_trainer)
        assert len(set(lp.tolist())) == len(set(tokens.tolist()))  # one logprob per token: rows are identical
    with vk.use_backend("invariant"):
        p = torch.softmax(vk.compute_logits(hidden, norm_w, 1e-6, head)[0] / temps[0], -1)
    freq = torch.bincount(tokens, minlength=12).float() / n
    assert float((freq - p).abs().max()) < 4 * float((p * (1 - p) / n).sqrt().max()) + 1e-3
    # seeds decide: the same seeds give the same tokens, other seeds other tokens
    with vk.use_backend("invariant"):
        again, _ = vk.sample_from_hidden(rows[:50], norm_w, 1e-6, head, t[:50], seeds[:50])
        other, _ = vk.sample_from_hidden(rows[:50], norm_w, 1e-6, head, t[:50], seeds[:50] + 1)
    assert torch.equal(again, tokens[:50]) and not torch.equal(other, tokens[:50])


def test_sample_from_hidden_rejects_bad_seeds_and_temperatures():
    hidden, norm_w, head, temps, seeds = _problem(3, 16, 10)
    with pytest.raises(ValueError, match="seeds must be int64 \\[3\\]"):
        vk.sample_from_hidden(hidden, norm_w, 1e-6, head, temps, seeds[:2])
    with pytest.raises(ValueError, match="seeds must be int64"):
        vk.sample_from_hidden(hidden, norm_w, 1e-6, head, temps, seeds.int())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vk.sample_from_hidden(hidden, norm_w, 1e-6, head, torch.zeros(3), seeds)
    with pytest.raises(ValueError, match="hidden must be \\[T, H\\]"):
        vk.sample_from_hidden(hidden[None], norm_w, 1e-6, head, temps, seeds)


@pytest.mark.gpu
def test_gpu_fused_draw_matches_reference_and_trainer_logprob_at_a_real_vocabulary():
    from vexact_kernels.triton_ops import logprobs as ops
    from vexact_kernels.triton_ops import sample as sample_ops

    dev = "cuda"
    hidden, norm_w, head, temps, seeds = _problem(130, 2048, 151936, seed=7)
    hidden, norm_w, head, temps, seeds = (x.to(dev) for x in (hidden, norm_w, head, temps, seeds))
    with vk.use_backend("invariant"):
        tokens, lp = vk.sample_from_hidden(hidden, norm_w, 1e-6, head, temps, seeds)
        lp_trainer, _ = vk.logprobs_from_hidden(hidden, norm_w, 1e-6, head, tokens, temps)
        want, gap = _reference_tokens(hidden, norm_w, head, temps, seeds)
    assert torch.equal(lp, lp_trainer)  # the engine's reported logprob is the trainer's, bitwise
    differ = tokens != want
    assert int(differ.sum()) <= 2 and bool((gap[differ] < 1e-3).all())  # GPU log vs torch log: near-ties only
    # any row subset and batch size: same token, same bits
    for idx in ([0], [5, 77], list(range(64, 130)), list(range(129, -1, -3))):
        i = torch.tensor(idx, device=dev)
        with vk.use_backend("invariant"):
            t2, lp2 = vk.sample_from_hidden(hidden[i], norm_w, 1e-6, head, temps[i], seeds[i])
        assert torch.equal(t2, tokens[i]) and torch.equal(lp2, lp[i])
    # peaked logits: the tiles after a peak in its split (8 tiles of 128 columns) skip their noise, except in row
    # 70's row block (a flat row keeps them live); every draw and logprob is the unskipped kernel's
    peaks = (3, 1030, 77830, 151935)  # tile 0 of splits 0, 1, 76; the last column (tile 2 of the last split)
    peaked = [x.to(dev) for x in _peaked_problem(130, 2048, 151936, peaks, seed=8, flat_rows=(70,))]
    p_hidden, p_norm_w, p_head, p_temps, p_seeds = peaked
    with vk.use_backend("invariant"):
        p_tokens, p_lp = vk.sample_from_hidden(p_hidden, p_norm_w, 1e-6, p_head, p_temps, p_seeds)
        p_lp_trainer, _ = vk.logprobs_from_hidden(p_hidden, p_norm_w, 1e-6, p_head, p_tokens, p_temps)
        p_want, p_gap = _reference_tokens(*peaked)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops, "GUMBEL_NOISE_MAX", float("inf"))
            p_tokens_all, p_lp_all = vk.sample_from_hidden(p_hidden, p_norm_w, 1e-6, p_head, p_temps, p_seeds)
    assert torch.equal(p_tokens, p_tokens_all) and torch.equal(p_lp, p_lp_all) and torch.equal(p_lp, p_lp_trainer)
    p_differ = p_tokens != p_want
    assert int(p_differ.sum()) <= 2 and bool((p_gap[p_differ] < 1e-3).all())
    drawn = set(p_tokens[torch.arange(130, device=dev) != 70].tolist())
    assert drawn <= set(peaks) and len(drawn) >= 3, drawn  # the noise picks among the peaks, wherever they are
    # the fast backend (cuBLAS logits, the same noise from the standalone kernel): near-ties of its own logits only
    with vk.use_backend("fast"):
        fast_tokens, fast_lp = vk.sample_from_hidden(hidden, norm_w, 1e-6, head, temps, seeds)
        fast_lp_trainer, _ = vk.logprobs_from_hidden(hidden, norm_w, 1e-6, head, fast_tokens, temps)
    assert torch.equal(fast_lp, fast_lp_trainer)
    assert int((fast_tokens != tokens).sum()) <= 13  # different logits bits may flip a near-tie, rarely
    # captured in a CUDA graph (the engine's decode step may be): replay == eager
    normed = vk.rms_norm(hidden, norm_w, 1e-6)
    sample_ops.triton_sample_logprobs(normed, head, temps, seeds)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gt, glp = sample_ops.triton_sample_logprobs(normed, head, temps, seeds)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gt, tokens) and torch.equal(glp, lp)


@pytest.mark.gpu
@pytest.mark.parametrize("peaked", [False, True])
def test_gpu_draw_rows_give_the_tokens_and_bits_of_the_full_row_block(peaked):
    """At T <= 16 the draw's noise covers 1 or 16 rows of the 64-row block (``SAMPLE_DRAW_ROWS``): tokens and
    logprobs are bitwise those of the form drawing all 64 rows' noise, the logprob is ``logprobs_from_hidden``'s, and
    any row subset draws the same. The small form is set here, whatever the default; if this fails, set the default
    ``SAMPLE_DRAW_ROWS = ()`` (the form before)."""
    from vexact_kernels.triton_ops import logprobs as ops

    dev = "cuda"
    if peaked:  # the skip runs; row 2 is flat
        peaks = (3, 1030, 77830, 151935)
        problem = _peaked_problem(64, 2048, 151936, peaks, seed=12, flat_rows=(2,))
    else:
        problem = _problem(64, 2048, 151936, seed=11)
    hidden, norm_w, head, temps, seeds = (x.to(dev) for x in problem)

    def draw(idx, draw_rows=(1, 16)):
        i = torch.tensor(idx, device=dev)
        with pytest.MonkeyPatch.context() as mp, vk.use_backend("invariant"):
            mp.setattr(ops, "SAMPLE_DRAW_ROWS", draw_rows)
            return vk.sample_from_hidden(hidden[i], norm_w, 1e-6, head, temps[i], seeds[i])

    tokens, lp = draw(list(range(64)))
    with vk.use_backend("invariant"):
        lp_trainer, _ = vk.logprobs_from_hidden(hidden, norm_w, 1e-6, head, tokens, temps)
        want, gap = _reference_tokens(hidden, norm_w, head, temps, seeds)
    assert torch.equal(lp, lp_trainer)
    differ = tokens != want
    assert int(differ.sum()) <= 2 and bool((gap[differ] < 1e-3).all())
    for t in (1, 3, 16, 17, 64):
        first = list(range(t))
        small, full = draw(first), draw(first, ())
        assert torch.equal(small[0], full[0]) and torch.equal(small[1], full[1]), t
        assert torch.equal(small[0], tokens[:t]) and torch.equal(small[1], lp[:t]), t
        with vk.use_backend("invariant"):
            lp_t, _ = vk.logprobs_from_hidden(hidden[:t], norm_w, 1e-6, head, small[0], temps[:t])
        assert torch.equal(small[1], lp_t), t
        for idx in (first[::-1], [t - 1], first[1::2], [63 - r for r in first]):
            if idx:
                sub_tokens, sub_lp = draw(idx)
                i = torch.tensor(idx, device=dev)
                assert torch.equal(sub_tokens, tokens[i]) and torch.equal(sub_lp, lp[i]), (t, idx)


@pytest.mark.gpu
def test_gpu_noise_stays_below_the_skip_bound():
    """The device's logs (not the interpreter's numpy): the skip bound holds for the noise the GPU computes."""
    _check_noise_bound("cuda", 1024)
