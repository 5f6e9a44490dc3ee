"""Guidance over a forked cache under preemption (`--kv-reservation lazy`,
pools far too small) in the shapes that strain swapping rows outside decode
groups: a main row swapped while its partition waits on another KV
component before the fork, the
running-row cap filled by the branches a swapped main row is waited on by,
and a request that fits the pool only while its branches share pages. Every
image matches three separately prefilled contexts, and the engine lets go of
every page and running row."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.graph import Fork, Step, Walk
from test_toy_image import CFG_CASES, TOL, _guided, cfg_reference
from toys.audio_decoder import HIDDEN, VOCAB
from toys.image_gen import ToyImageModel
from toys.serving import DEVICES, drained

Case = tuple[int, int, int, int, float]  # image tokens, text tokens, latent rows, steps, scale


def _requests(seed: int, cases: list[Case]) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (ni,), generator=gen).tolist(), torch.randint(0, VOCAB, (nt,), generator=gen)
             .tolist(), torch.randn(rows, HIDDEN, generator=gen), steps, scale)
            for ni, nt, rows, steps, scale in cases]


async def _serve(model: ToyImageModel, seed: int, cases: list[Case], device: str = "cpu", reservation: str = "lazy",
                 **scheduler: int) -> int:
    """Serve the requests of `cases` on one worker of `model` (a context of
    48 tokens) with lazy pages of 4 tokens (or auto: its rows enter no loop
    with a cap, so they take pages as they go too), each against its
    three-context reference; how many rows were preempted."""
    model.context = 48
    requests = _requests(seed, cases)
    expected = [cfg_reference(model, *r) for r in requests]
    eng = Engine(EngineConfig(model="toy-image", devices=(device,), dtype="float32", scheduler=SchedulerConfig(
        page_size=4, kv_reservation=reservation, **scheduler)), model=model)
    await eng.start()
    try:
        results = await asyncio.wait_for(asyncio.gather(*(_guided(eng, f"p{k}", *r) for k, r in enumerate(requests))),
                                         60)
        for (images, reason), want in zip(results, expected):
            assert reason == "length" and len(images) == 1
            torch.testing.assert_close(torch.tensor(images[0]), want, atol=TOL, rtol=0)
        await drained(eng)
        return eng.workers[0].preemption.preempted
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reservation", ["lazy", "auto"])
async def test_guidance_under_preemption_matches_three_contexts(device: str, reservation: str) -> None:
    """Branch rows that wait for pages, or for their siblings, are swapped
    out (losing their share of the prompt's pages) and back."""
    # pages of 4: one request fits with its branches unshared (33), two do not
    assert await _serve(ToyImageModel(), 8, CFG_CASES * 2, device, reservation, num_pages=36) > 0


LOAD = [(17, 2, 4, 2, 1.5), (30, 1, 8, 2, 2.0), (22, 3, 2, 2, 0.5), (25, 2, 6, 2, 1.0), (19, 3, 3, 2, 3.0)] * 2


class SecondCacheModel(ToyImageModel):
    """A second KV component steps the image before the fork, so main's row
    may be swapped out while its partition waits on that component's pages,
    with no step of its own queued."""

    components = {**ToyImageModel.components, "llm2": ToyImageModel.components["llm"]}
    walks = {"generate_cfg": Walk(
        Step("llm", "prefill", {"ids": "image_ids"}, ()),
        Step("llm2", "prefill", {"ids": "image_ids"}, ()),
        Fork(("no_text", "share"), ("no_image", "fresh"), component="llm"),
        *ToyImageModel.walks["generate_cfg"].nodes[2:],
        inputs=ToyImageModel.walks["generate_cfg"].inputs)}

    def __init__(self) -> None:
        super().__init__()
        self.denoiser2 = copy.deepcopy(self.denoiser)

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        if component == "llm2":
            return self.denoiser2.to(device, dtype)
        return super().build_component(component, device, dtype)


async def test_a_main_row_swapped_before_its_fork_comes_back_to_be_split() -> None:
    assert await _serve(SecondCacheModel(), 3, LOAD, num_pages=36) > 0


async def test_a_swapped_main_row_is_not_held_by_the_running_cap_its_branches_fill() -> None:
    """`--max-num-seqs 2`: a request's branches start beyond the cap and
    wait for main; main, swapped out, comes back past the cap too."""
    cases = [(5, 2, 8, 1, 1.5), (16, 8, 8, 4, 1.5), (26, 4, 4, 4, 1.5), (1, 7, 8, 1, 1.5), (23, 8, 8, 2, 1.5),
             (19, 2, 8, 1, 1.5)]
    # every request fits 24 pages with its branches unshared (the largest takes 22)
    assert await _serve(ToyImageModel(), 1, cases, num_pages=24, max_num_seqs=2) > 0


async def test_a_request_that_fits_only_with_shared_pages_goes_on_a_row_at_a_time() -> None:
    """A swapped branch comes back into pages of its own; request 3 then
    needs 21 pages of a pool of 20: its idle rows are swapped in turn."""
    cases = [(8, 5, 7, 4, 1.5), (16, 3, 3, 1, 1.5), (1, 7, 8, 3, 1.5), (26, 1, 8, 3, 1.5), (9, 3, 7, 3, 1.5),
             (7, 1, 8, 3, 1.5)]
    assert await _serve(ToyImageModel(), 4, cases, num_pages=20, max_num_seqs=3) > 0
