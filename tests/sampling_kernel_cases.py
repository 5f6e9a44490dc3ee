"""The sampler's kernel comparisons (draws, the wide vocabulary's draw and its
threshold descent, exponential noise, the repetition penalty), shared by the
CPU tests (Triton's interpreter) and the CUDA tests, as `kernel_cases` holds
the others: random inputs on a device in, the Triton path checked against
the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mstar.kernels.sampling import draw, noise, wide_descent, wide_draw
from mstar.kernels.sampling import penalty as penalty_kernels


def check_repetition_penalty(rows: int, vocab: int, dtype: torch.dtype, device: str) -> None:
    """The kernel's float32 logits equal the torch form's bit for bit: seen
    tokens' positive logits divided, negative ones multiplied, rows without
    a penalty (1.0) and -inf entries left as they are."""
    gen = torch.Generator().manual_seed(rows * 100 + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[:, ::11] = float("-inf")
    seen = torch.rand(rows, vocab, generator=gen) < 0.3
    penalty = torch.tensor([[1.3, 1.0, 2.0, 0.7][r % 4] for r in range(rows)])
    args = [t.to(device) for t in (logits, seen, penalty)]
    got = penalty_kernels.repetition_penalty_triton(*args)
    want = penalty_kernels.repetition_penalty_reference(*args)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def check_exponential_noise(rows: int, vocab: int, device: str) -> None:
    """The same draws as the int64 reference, up to the last bit of the log:
    seeds and counters beyond 32 bits, negative seeds, a ragged last block."""
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=gen)
    counters = torch.randint(0, 2**40, (rows,), generator=gen)
    # and a row whose bits reach the top 24-bit value (at index 622), where u must stay below 1
    seeds = torch.cat([seeds, torch.tensor([0])]).to(device)
    counters = torch.cat([counters, torch.tensor([18735])]).to(device)
    got = noise.exponential_noise_triton(seeds, counters, vocab)
    want = noise.exponential_noise_reference(seeds, counters, vocab)
    assert got.shape == (rows + 1, vocab) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert (got > 0).all() and (want > 0).all()  # a -0.0 draw turns a race's 0 / -0.0 into NaN, which argmax takes
    if vocab > 4096:  # the window's indices are checked on the narrow cases (the interpreter is slow)
        return
    # a window of the vocabulary from index 37: the whole row's draws at those indices
    window = noise.exponential_noise_triton(seeds, counters, vocab, 37)
    whole = noise.exponential_noise_reference(seeds, counters, vocab + 37)
    torch.testing.assert_close(window, whole[:, 37:], atol=0, rtol=1e-6)
    torch.testing.assert_close(noise.exponential_noise_reference(seeds, counters, vocab, 37), whole[:, 37:],
                               atol=0, rtol=0)


def check_window_draw(rows: int, vocab: int, first: int, end: int, dtype: torch.dtype, device: str,
                      kernel: Callable[..., torch.Tensor]) -> None:
    """A draw from a window [first, end) of the vocabulary (a strided view
    of the whole rows, drawing each id's noise) takes the token the torch
    form takes from the whole rows with every id outside it at -inf:
    greedy and sampled rows, with and without filters, at two offsets."""
    gen = torch.Generator().manual_seed(rows + vocab + first)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, :first] = float("-inf")
    logits[:, end:] = float("-inf")
    logits = logits.to(dtype)
    temperature = torch.tensor([[0.7, 1.0, 0.0, 1.3][r % 4] for r in range(rows)])
    seeds, counters = torch.arange(rows) * 3 + 1, torch.arange(rows) * 5
    for filtered in (True, False):
        top_k = torch.tensor([[0, 5, 0][r % 3] if filtered else 0 for r in range(rows)])
        top_p = torch.tensor([[0.8, 1.0, 0.5][r % 3] if filtered else 1.0 for r in range(rows)])
        min_p = torch.tensor([[0.0, 0.05, 0.0][r % 3] if filtered else 0.0 for r in range(rows)])
        params = [t.to(device) for t in (temperature, top_k, top_p, min_p, seeds, counters)]
        whole = logits.to(device)
        for offset in (0, 14):
            got = kernel(whole[:, first:end], *params, offset, filtered, first=first) + first
            want = draw.draw_tokens_reference(whole, *params, offset, filtered)
            assert got.cpu().tolist() == want.cpu().tolist(), (filtered, offset)


def check_draw_tokens(rows: int, vocab: int, filtered: bool, dtype: torch.dtype, device: str,
                      kernel: Callable[..., torch.Tensor] | None = None) -> None:
    """One launch draws the token the sampler's torch form draws, row by row:
    greedy rows (temperature 0) beside sampled ones, filters alone and
    together, ties and -inf entries, logits in `dtype` read as they are,
    draws at counter + offset. `kernel`: the draw under test (default
    `draw.draw_tokens_triton`)."""
    gen = torch.Generator().manual_seed(rows * 10 + vocab + filtered)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, ::7] = float("-inf")
    if rows > 1 and vocab > 12:  # ties across row 1's top-5 cut
        top = logits[1].argsort(descending=True)
        logits[1, top[3:8]] = logits[1, top[3]].item()
    if rows > 4 and vocab > 12:  # -0.0 and 0.0 are equal: row 4 keeps its top 1, the first in index order
        logits[4] = -torch.rand(vocab, generator=gen) - 1
        logits[4, 10], logits[4, 11] = -0.0, 0.0
    logits = logits.to(dtype)
    # every seventh row greedy: the filters' pattern (of six) falls on sampled rows too
    temperature = torch.tensor([[0.7, 1.0, 0.8, 1.3, 0.5, 0.9, 0.0][r % 7] for r in range(rows)])
    top_k = torch.tensor([[0, 5, 50, 0, 1, vocab + 3][r % 6] if filtered else 0 for r in range(rows)])
    top_p = torch.tensor([[1.0, 0.8, 1.0, 0.5, 0.9, 0.95][r % 6] if filtered else 1.0 for r in range(rows)])
    min_p = torch.tensor([[0.0, 0.0, 0.05, 0.0, 0.0, 0.1][r % 6] if filtered else 0.0 for r in range(rows)])
    seeds, counters = torch.arange(rows) * 3 + 1, torch.arange(rows) * 5
    for offset in (0, 14):   # a row's own counter, and a mode's later draw
        args = [t.to(device) for t in (logits, temperature, top_k, top_p, min_p, seeds, counters)]
        got = (kernel or draw.draw_tokens_triton)(*args, offset, filtered)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        want = draw.draw_tokens_reference(*args, offset, filtered)
        assert got.cpu().tolist() == want.cpu().tolist(), offset


def check_wide_draw(rows: int, vocab: int, filtered: bool, dtype: torch.dtype, device: str, block: int) -> None:
    """`check_draw_tokens` for the draw of wide vocabularies, its row
    streamed in blocks of `block`; plus a top-p cut that falls inside a run
    of equal logits, and a vocabulary past one block by one token."""
    for steps in (0, 1, wide_descent.STEPS):  # every row to the search; one candidate tested; the default
        check_draw_tokens(rows, vocab, filtered, dtype, device,
                          lambda *a: wide_draw.draw_tokens_wide(*a, block=block, descent_steps=steps))
    # a +inf logit (or a finite one that a tiny temperature scales past float32): every probability is NaN,
    # and the torch form's argmax takes the NaN row's first entry
    inf = torch.tensor([[0.0, 1.0, float("inf"), 2.0, 0.5], [1.0, 5.0, 3.0, 5.0, -2.0]]).to(dtype)
    nan_args = [t.to(device) for t in (inf, torch.tensor([1.0, 1e-38]), torch.zeros(2, dtype=torch.long),
                                       torch.ones(2), torch.zeros(2), torch.arange(2), torch.arange(2))]
    got = wide_draw.draw_tokens_wide(*nan_args, 0, filtered, block=block)
    assert got.cpu().tolist() == draw.draw_tokens_reference(*nan_args, 0, filtered).cpu().tolist()
    if not filtered:
        return
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab + 1, generator=gen)
    logits[:, 3:40] = 4.0  # 37 equal logits well above the rest: top-p ends among them
    args = [logits.to(dtype), torch.tensor([1.0, 0.7, 1.0, 1.5]), torch.tensor([0, 0, 20, 0]),
            torch.tensor([0.5, 0.3, 0.9, 0.97]), torch.tensor([0.0, 0.0, 0.0, 0.01]), torch.arange(4),
            torch.arange(4) + 9]
    args = [t.to(device) for t in args]
    for offset, steps in ((0, 0), (0, 1), (3, 0), (3, wide_descent.STEPS)):
        got = wide_draw.draw_tokens_wide(*args, offset, True, block=block, descent_steps=steps)
        assert got.cpu().tolist() == draw.draw_tokens_reference(*args, offset, True).cpu().tolist(), offset
    # what the host knows skips a search: no row with top-k, then no row with top-p
    no_k = [args[0], args[1], torch.zeros_like(args[2]), *args[3:]]
    got = wide_draw.draw_tokens_wide(*no_k, 0, True, block=block, top_k_active=False)
    assert got.cpu().tolist() == draw.draw_tokens_reference(*no_k, 0, True).cpu().tolist()
    no_p = [*args[:3], torch.ones_like(args[3]), *args[4:]]
    got = wide_draw.draw_tokens_wide(*no_p, 0, True, block=block, top_p_active=False)
    assert got.cpu().tolist() == draw.draw_tokens_reference(*no_p, 0, True).cpu().tolist()
    # a +inf logit: every probability is NaN, and the first top token wins, as the torch form's rank 0
    args[0] = args[0].clone()
    args[0][:, vocab // 2] = float("inf")
    got = wide_draw.draw_tokens_wide(*args, 0, True, block=block)
    assert got.cpu().tolist() == draw.draw_tokens_reference(*args, 0, True).cpu().tolist() == [vocab // 2] * 4


def check_wide_descent(rows: int, vocab: int, dtype: torch.dtype, device: str, block: int) -> None:
    """The candidate descent alone: with steps enough, every sampled row of a
    top-p draw settles there (none is left to the search), and on the token
    the torch form draws; with none, no row settles; greedy rows stay as
    they came, and a row whose probabilities are NaN (a +inf logit) is left
    to the search."""
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[rows - 1, vocab // 3] = float("inf")
    temperature = torch.tensor([[0.0, 0.6, 1.0, 1.4][r % 4] for r in range(rows)])
    top_p = torch.tensor([[0.8, 0.5, 0.95, 1.0, 0.3][r % 5] for r in range(rows)])
    min_p = torch.tensor([[0.0, 0.0, 0.02][r % 3] for r in range(rows)])
    args = [t.to(device) for t in (logits, temperature, torch.zeros(rows, dtype=torch.long), top_p, min_p,
                                   torch.arange(rows) + 5, torch.arange(rows) * 3)]
    want = draw.draw_tokens_reference(*args, 0, True).cpu()
    greedy = temperature <= 0
    for steps in (0, 64):
        state, token = _descend(args, steps, block)
        if steps == 0:
            assert (state.cpu() == wide_descent.SETTLED).tolist() == greedy.tolist()
            continue
        settled = (state.cpu() == wide_descent.SETTLED) & ~greedy
        sampled = ~greedy
        sampled[rows - 1] = False
        assert settled[sampled].all(), state
        assert not settled[rows - 1]
        assert token.cpu()[settled].tolist() == want[settled].tolist()


def _descend(args: list[torch.Tensor], steps: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`wide_descent.descend` on a draw's arguments, with the tensors the
    wide draw prepares for it (no top-k)."""
    logits, temperature, _, top_p, min_p, seeds, counters = args
    rows, vocab = logits.shape
    blocks = -(-vocab // block)
    div = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    scaled = logits.float() / div[:, None]
    m = scaled.max(1).values
    total = torch.exp(scaled - m[:, None]).sum(1)
    dev = logits.device
    none_k = (torch.full((rows,), wide_draw.LOWEST, dtype=torch.int64, device=dev),
              torch.full((rows,), wide_draw._NONE, dtype=torch.int64, device=dev),
              torch.zeros(rows, blocks, dtype=torch.float32, device=dev))
    kernel_args = (logits, logits.stride(0), div, m, vocab, blocks)
    state = (temperature <= 0).to(torch.int8) * wide_descent.SETTLED
    return wide_descent.descend(kernel_args, *none_k, total, top_p, min_p, seeds, counters, 0, state, (rows, blocks),
                                block, steps, top_k=False)
