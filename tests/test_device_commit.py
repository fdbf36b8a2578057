"""The commit rule on the device (unmask/engine/commit.py), forced on the CPU as a GPU runs it:
a forward's scores stay on the device until the next step's rule runs on them there, and one
read brings the scores and the rule's counts. For `static`, `static-1` and `threshold`, on a
block-causal and a bidirectional model (and Dream, which reads a slot's prediction one place
back), with requests joining, leaving and widening the canvas between steps: today's tokens,
NFE and token-forwards, and at most one device read a step that calls the model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import peaky_model, reads_per_model_step

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig, decode
from unmask.engine import commit as commit_mod
from unmask.engine import decoder as decoder_mod
from unmask.engine.batch import Scores

VOCAB, MASK, EOS = 64, 63, 1
# lengths that make a later request widen the canvas at the front while others are pending
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20]]
PRESETS = ["static,steps=8", "static-1", "threshold,threshold=0.7",
           "threshold,threshold=0.8,steps=8"]
FAMILIES = ["sdar", "llada", "Dream"]


def as_on_a_gpu(monkeypatch) -> list[int]:
    """The decoders choose their commit as on a CUDA device; returns a list that gets one entry
    per rule step run on the device over pending scores."""
    real_make, real_count = commit_mod.make_commit, commit_mod.DeviceCommit.count
    ran: list[int] = []

    def count(self, b, *a, **k):
        if b.pending is not None:
            ran.append(1)
        return real_count(self, b, *a, **k)

    monkeypatch.setattr(decoder_mod, "make_commit",
                        lambda device, method: real_make(torch.device("cuda"), method))
    monkeypatch.setattr(commit_mod.DeviceCommit, "count", count)
    return ran


def params(kind: str, spec: str) -> DecodeParams:
    return DecodeParams.parse(spec, gen_length=16, block_length=4 if kind == "sdar" else 8)


def outcomes(kind: str, spec: str, max_running: int) -> list[tuple]:
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    reqs = decode(model, params(kind, spec), PROMPTS, mask_id=MASK, eos_id=EOS,
                  max_running=max_running)
    return [(r.token_ids, r.nfe, r.token_forwards) for r in reqs]


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("spec", PRESETS)
def test_the_rule_on_the_device_gives_the_hosts_tokens(kind: str, spec: str, monkeypatch) -> None:
    for max_running in (1, 2, 4):  # 2: rows join, leave and widen the canvas between steps
        want = outcomes(kind, spec, max_running)
        with monkeypatch.context() as mp:
            ran = as_on_a_gpu(mp)
            assert outcomes(kind, spec, max_running) == want
        assert ran  # the rule ran on the device's scores


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("spec", PRESETS)
def test_the_rule_on_the_device_reads_once_a_step(kind: str, spec: str, monkeypatch) -> None:
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    as_on_a_gpu(monkeypatch)
    eng = Engine(model, SchedulerConfig(), mask_id=MASK, eos_id=EOS)
    for p in PROMPTS:
        eng.add_request(p, params(kind, spec))
    counts = reads_per_model_step(eng)
    # the first step has no scores to read yet; every later one reads them with its counts
    assert counts[0] == 0 and set(counts[1:]) == {1}, counts


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_joining_rows_first_forward_is_read_with_the_batchs(kind: str, monkeypatch) -> None:
    """A request joining a decoding batch forwards first in a call of its own
    (Decoder._prime); its scores wait on the device with the batch's, one read a step."""
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    as_on_a_gpu(monkeypatch)
    eng = Engine(model, SchedulerConfig(max_running=2), mask_id=MASK, eos_id=EOS)
    for p in PROMPTS:
        eng.add_request(p, params(kind, "threshold,threshold=0.7"))
    counts = reads_per_model_step(eng)
    # 0 where no row has scores yet (a batch whose rows all joined at once)
    assert max(counts) == 1 and counts.count(1) > len(counts) // 2, counts


def test_drafts_and_the_cpu_keep_the_rule_on_the_host() -> None:
    model = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)
    cuda = torch.device("cuda")
    for spec, where in (("threshold", commit_mod.DeviceCommit), ("static-1", commit_mod.DeviceCommit),
                        ("freedave++", commit_mod.HostCommit), ("fast", commit_mod.HostCommit),
                        ("entropy_bounded", commit_mod.HostCommit)):
        method = decoder_mod.make_method(params("sdar", spec))
        assert type(commit_mod.make_commit(cuda, method)) is where, spec
        assert type(commit_mod.make_commit(torch.device("cpu"), method)) is commit_mod.HostCommit
    assert type(decoder_mod.Decoder(model, params("sdar", "threshold"), MASK, EOS).commit) \
        is commit_mod.HostCommit


def test_pending_scores_follow_their_rows_and_slots() -> None:
    p = Scores(np.array([0, 1, 2, 2]), np.array([3, 0, 5, 7]), torch.tensor([10, 11, 12, 13]),
                torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.zeros(4))
    kept = p.taken(np.array([2, 0]))  # row 1 left; rows 2 and 0 are now 0 and 1
    assert kept.rows.tolist() == [1, 0, 0] and kept.slots.tolist() == [3, 5, 7]
    assert kept.token.tolist() == [10, 12, 13]
    wider = kept.shifted(2, 10)  # two slots before every row, 10 wide
    assert wider.slots.tolist() == [5, 7, 9] and wider.token.tolist() == [10, 12, 13]
    narrower = kept.shifted(-4, 4)  # the first four slots dropped, 4 wide
    assert narrower.slots.tolist() == [1, 3] and narrower.token.tolist() == [12, 13]
