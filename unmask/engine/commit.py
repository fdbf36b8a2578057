"""Where a step's commit rule runs, and so when the host reads a forward's scores: one object
per decoder, chosen by the model's device (`make_commit`).

- `HostCommit` (the CPU, and every decoder a device rule cannot run): the forward's scores are
  read as soon as it is queued (one copy, unmask.syncs.to_host) and the rule runs on them in
  numpy. On the CPU the "read" waits for nothing and numpy's rule costs a third of the same
  rule on tensors (BENCHMARKS.md, "Host overhead"), so the CPU stays here.
- `DeviceCommit` (a GPU, for `static`, `static-1` and `threshold`): the scores stay on the
  device (`DecodeBatch.pending`) until the next step's rule, which runs on them there
  (unmask/decoding/rules.py on tensors) and reads the scores and its counts in one copy. The
  host's bookkeeping after a forward (accepting the commits, writing the K/V store, finishing
  rows, the engine's events) then runs while the device computes the forward, instead of
  waiting for it; a step still reads the device once. FreeDave's drafts are verified with the
  scores of the forward that checks them, in the same step, so its decoders stay on the host.

docs/engine.md ("Host syncs") says which path runs where.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
from torch import Tensor

from unmask.decoding.methods import BlockSchedule, Method
from unmask.engine.batch import DecodeBatch
from unmask.engine.runner import Forwarded
from unmask.syncs import to_host


class HostCommit:
    """The forward's scores read at once; the rule on the host (numpy)."""

    reads_at_once = True  # a forward's scores are on the host when it returns

    def scored(self, b: DecodeBatch, fw: Forwarded) -> None:
        """After a forward is queued: its scores into fw's host arrays, in one read."""
        s = fw.scores
        fw.token[s.rows, s.slots], fw.conf[s.rows, s.slots], fw.entropy[s.rows, s.slots] = \
            to_host(s.token, s.conf, s.entropy)

    def accepted(self, b: DecodeBatch, fw: Forwarded, rows: np.ndarray, fi: np.ndarray) -> None:
        """Batch rows `rows` took the predictions of the forward's rows `fi` (already in
        b.preds: their scores were read)."""

    def count(self, b: DecodeBatch, method: Method, cand: np.ndarray,
              schedule: BlockSchedule | None) -> np.ndarray:
        """(R,) the rule's count for each row, from the batch's predictions."""
        pr = b.preds
        return method.count(pr.conf, cand, schedule, b.rows.knobs, pr.entropy)


class DeviceCommit(HostCommit):
    """The scores left on the device; the next step's rule runs there, and one read brings
    the scores and its counts."""

    reads_at_once = False

    def scored(self, b: DecodeBatch, fw: Forwarded) -> None:
        pass  # read with the next step's counts

    def accepted(self, b: DecodeBatch, fw: Forwarded, rows: np.ndarray, fi: np.ndarray) -> None:
        """Keep the accepted rows' scores on the device (b.preds holds their places as
        unscored until `count` reads them)."""
        s = fw.scores
        row_of = np.full(fw.fresh.shape[0], -1, dtype=np.int64)  # forward row -> batch row
        row_of[fi] = rows
        to = row_of[s.rows]
        b.pending = s.keep(to >= 0, to, s.slots)

    def count(self, b: DecodeBatch, method: Method, cand: np.ndarray,
              schedule: BlockSchedule | None) -> np.ndarray:
        """The rule on the device over the pending scores (and the batch's others), then one
        read: the scores into b.preds and the counts."""
        p, pr, dev = b.pending, b.preds, b.device
        if p is None:
            return super().count(b, method, cand, schedule)

        def on(a: np.ndarray) -> Tensor:
            return torch.from_numpy(a.copy()).to(dev)  # a copy: knob fields are strided

        flat = on(p.rows * pr.conf.shape[1] + p.slots)
        conf = on(pr.conf).view(-1).index_copy(0, flat, p.conf).view(pr.conf.shape)  # (R, S)
        entropy = None  # the rules that run on the device read no entropy
        if method.reads_entropy:
            entropy = on(pr.entropy).view(-1).index_copy(0, flat, p.entropy).view(pr.conf.shape)
        knobs = _Knobs(b.rows.knobs, on)
        sched = None if schedule is None else BlockSchedule(
            on(schedule.masked_at_start), on(schedule.step), on(schedule.steps_per_block))
        n = method.count(conf, on(cand), sched, knobs, entropy)
        token, conf_n, entropy_n, counts = to_host(p.token, p.conf, p.entropy, n)
        pr.token[p.rows, p.slots], pr.conf[p.rows, p.slots] = token, conf_n
        pr.entropy[p.rows, p.slots] = entropy_n
        b.pending = None
        return counts


class _Knobs(Mapping):
    """The rows' knobs (R,) as tensors on the device, each copied there when a rule reads it."""

    def __init__(self, knobs: np.ndarray, on: Callable[[np.ndarray], Tensor]) -> None:
        self.knobs, self.on = knobs, on

    def __getitem__(self, name: str) -> Tensor:
        return self.on(self.knobs[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.knobs.dtype.names)

    def __len__(self) -> int:
        return len(self.knobs.dtype.names)


def make_commit(device: torch.device, method: Method) -> HostCommit:
    """The rule on the device where there is one and the method's rule runs there without
    drafts; on the host otherwise."""
    if device.type != "cpu" and method.rule.on_device and not method.drafts:
        return DeviceCommit()
    return HostCommit()
