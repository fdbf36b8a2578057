"""A block-causal call of fewer places than its products' fewest rows (a batch-1 block-4 step) runs as
rows widened to that many places instead of packed (unmask/engine/runner.py, `Runner._widened`):
every call's logits and every stored K/V bit are the packed call's, in float32 and bfloat16, and the
tokens, NFE and token-forwards are the same, alone and in a batch."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import peaky_model

from unmask.decoding.params import DecodeParams
from unmask.engine import decode
from unmask.engine import product_rows as product_rows_mod
from unmask.engine import runner as runner_mod
from unmask.kv import KVStore

VOCAB, MASK, EOS = 64, 63, 1
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20]]


def decoded(kind: str, spec: str, dtype: torch.dtype, widen: bool, batch: int, monkeypatch):
    model = copy.deepcopy(peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)).to(dtype)  # cached: not in place
    seen: list[torch.Tensor] = []
    real_score, real_write = runner_mod.score, KVStore.write
    widened = []

    def spy(logits, *a, **k):
        seen.append(logits.detach().clone())
        return real_score(logits, *a, **k)

    def write(self, *a, **k):
        real_write(self, *a, **k)
        seen.append(self.kv.detach().clone())

    def count(self, *a, **k):
        widened.append(1)
        return real_widened(self, *a, **k)

    real_widened = runner_mod.Runner._widened
    with monkeypatch.context() as mp:
        # the default minimum (16 rows) everywhere, so that a block of 4 is a small call
        mp.setattr(product_rows_mod, "instruction_set", lambda: "")
        mp.setattr(runner_mod.Runner, "widen_small_calls", widen)
        mp.setattr(runner_mod.Runner, "_widened", count)
        mp.setattr(runner_mod, "score", spy)
        mp.setattr(KVStore, "write", write)
        params = DecodeParams.parse(spec, gen_length=16, block_length=4)
        reqs = decode(model, params, PROMPTS, mask_id=MASK, eos_id=EOS, max_running=batch)
    return [(r.token_ids, r.nfe, r.token_forwards) for r in reqs], seen, len(widened)


@pytest.mark.parametrize("kind", ["sdar", "Fast_dLLM_Qwen", "llada2_moe"])
@pytest.mark.parametrize("spec", ["threshold,threshold=0.7", "static-1", "freedave++,threshold=0.7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widened_calls_give_the_packed_calls_bits(kind, spec, dtype, monkeypatch) -> None:
    for batch in (1, 2):
        want, want_seen, _ = decoded(kind, spec, dtype, False, batch, monkeypatch)
        got, got_seen, n_widened = decoded(kind, spec, dtype, True, batch, monkeypatch)
        assert got == want
        if batch == 1:
            assert n_widened > 0  # the batch-1 steps of blocks of 4 took the widened path
        assert len(got_seen) == len(want_seen)
        assert all(torch.equal(a, b) for a, b in zip(got_seen, want_seen, strict=True))
