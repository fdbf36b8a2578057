"""The server's door into the engine (unmask.server.engine_client), without HTTP: it refuses a
group of engine requests all together, naming the request's field each refusal is about, and
requests submitted through it from many threads at once each get the tokens they get alone."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import tiny_model

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig, decode
from unmask.errors import CanvasTooLong, InputError
from unmask.server.engine_client import EngineClient, Submission
from unmask.server.metrics import ServerMetrics
from unmask.server.protocol import FieldError


@functools.cache
def model():
    return tiny_model("llada")  # vocabulary 300, mask 2, eos 1, max_sequence_length 256


def params(spec: str = "threshold,threshold=0.5", gen: int = 16, seed: int = 0) -> DecodeParams:
    return DecodeParams.parse(spec, gen_length=gen, block_length=8, seed=seed)


@pytest.fixture
def door(request) -> Iterator[EngineClient]:
    """A started door; `@pytest.mark.parametrize("door", [SchedulerConfig kwargs], indirect=True)`
    sets the engine's budgets."""
    client = EngineClient(Engine(model(), SchedulerConfig(**getattr(request, "param", {}))),
                          ServerMetrics())
    client.start()
    yield client
    client.stop()


def items(*prompts: list[int], length_field: str | None = None, p: DecodeParams | None = None
          ) -> list[Submission]:
    return [Submission(ids, p or params(), f"prompt[{i}]", length_field)
            for i, ids in enumerate(prompts)]


def refusal(door: EngineClient, group: list[Submission]) -> FieldError:
    with pytest.raises(FieldError) as e:
        asyncio.run(door.submit(group, "choices"))
    assert not door.engine.has_unfinished  # refused before any was submitted
    return e.value


@pytest.mark.parametrize("group,field,words", [
    (items([5, 6], [5, 6], [300]), "prompt[2]", "prompt[2]: prompt token ids must be integers in "
                                                "the model's vocabulary (0..299); got 300"),
    (items([5, 6], []), "prompt[1]", "prompt[1]: empty prompt"),
    (items([5, 6], [5, 2]), "prompt[1]", "prompt[1]: the prompt holds the mask token (id 2)"),
    (items([5, 6], [5] * 250), "prompt[1]", "exceeds max_sequence_length 256"),
    (items([5, 6], [5] * 250, length_field="max_tokens"), "max_tokens",
     "exceeds max_sequence_length 256"),
], ids=["vocabulary", "empty", "mask", "too-long", "too-long-by-max-tokens"])
def test_a_refused_prompt_names_its_field(door: EngineClient, group: list[Submission],
                                          field: str, words: str) -> None:
    err = refusal(door, group)
    assert err.field == field and words in str(err), err


@pytest.mark.parametrize("door", [dict(max_running=4, max_queue=1, max_slots=40)], indirect=True)
def test_the_slot_budget_names_the_prompt_or_the_whole_request(door: EngineClient) -> None:
    # 4-token prompts with 16-token canvases: 20 slots each, two run at once under 40
    err = refusal(door, items([5, 6, 7, 8], [5] * 30))
    assert err.field == "prompt[1]" and "exceeds the engine's slot budget 40" in str(err)
    err = refusal(door, items(*[[5, 6, 7, 8]] * 4))
    assert err.field is None
    assert "runs 2 of them at once" in str(err) and "send at most 3" in str(err)
    assert len(asyncio.run(_run(door, items(*[[5, 6, 7, 8]] * 3)))) == 3


@pytest.mark.parametrize("door", [dict(max_running=1, max_queue=1)], indirect=True)
def test_more_than_the_engine_holds_is_refused_whole(door: EngineClient) -> None:
    err = refusal(door, items([5], [6], [7]))
    assert err.field is None and "send at most 2" in str(err) and "--max-running 1" in str(err)


def test_a_client_that_leaves_mid_submission_gets_the_submitted_aborted(
        door: EngineClient) -> None:
    asked = []

    async def left() -> bool:
        asked.append(1)
        return len(asked) > 1  # gone once the first was submitted

    assert asyncio.run(door.submit(items([5, 6], [7, 8]), "choices", left=left)) is None
    deadline = time.monotonic() + 10
    while door.engine.has_unfinished:
        assert time.monotonic() < deadline, "the submitted request was not aborted"
        time.sleep(0.01)
    text = door.metrics.registry.get_sample_value("unmask_requests_total", {"outcome": "abort"})
    assert text == 1.0


async def _run(door: EngineClient, group: list[Submission]) -> list[list[int]]:
    """Submit a group and wait for each request's last event; its final tokens."""
    handles = await door.submit(group, "choices")
    for h in handles:
        while not (await h.events.get()).finished:
            pass
    assert all(h.request.finish_reason in ("eos", "length") for h in handles)
    return [h.request.token_ids for h in handles]


def test_many_threads_through_one_door_each_get_their_own_tokens(door: EngineClient) -> None:
    """Eight threads, each with its own event loop, submit two requests at once (specs, seeds
    and lengths differ): every request finishes with the tokens it gets decoded alone."""
    specs = ["threshold,threshold=0.5", "static-1", "threshold,temperature=0.8",
             "static,steps=8"]
    groups = [[Submission([5 + t, 6 + k, 7], params(specs[(t + k) % 4], 8 * (1 + k), seed=t),
                          f"prompt[{k}]") for k in range(2)] for t in range(8)]
    results: dict[int, list[list[int]]] = {}
    start = threading.Barrier(len(groups))

    def worker(t: int) -> None:
        start.wait()
        results[t] = asyncio.run(_run(door, groups[t]))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(len(groups))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert sorted(results) == list(range(len(groups)))
    for t, group in enumerate(groups):
        alone = [decode(model(), s.params, [s.prompt_ids])[0].token_ids for s in group]
        assert results[t] == alone, f"thread {t}"
    assert door.error is None


def test_each_prompt_is_checked_once(door: EngineClient, monkeypatch) -> None:
    """The door checks every prompt before it submits any, and the engine takes what it checked:
    add_request does not check a prompt again (it did, once per prompt, before)."""
    calls = []
    check = Engine.check_prompt

    def counted(self, prompt_ids, p):
        calls.append(list(prompt_ids))
        return check(self, prompt_ids, p)
    monkeypatch.setattr(Engine, "check_prompt", counted)
    assert len(asyncio.run(_run(door, items([5, 6], [7, 8, 9])))) == 2
    assert calls == [[5, 6], [7, 8, 9]]


def test_a_checked_prompt_is_checked_again_for_other_params() -> None:
    """A CheckedPrompt stands for its own params and engine only: with another spec (a longer
    canvas) or on another engine, add_request checks it again."""
    engine = Engine(model(), SchedulerConfig())
    ok = engine.check([5] * 200, params(gen=16))
    engine.add_request(ok, ok.params)  # taken as checked
    with pytest.raises(CanvasTooLong):
        engine.add_request(ok, params(gen=64))
    other = Engine(model(), SchedulerConfig(), mask_id=5)  # another engine: 5 is its mask
    with pytest.raises(InputError, match="mask token"):
        other.add_request(ok, ok.params)
