"""Held-out scores of a block-diffusion (SDAR) model folder with the trainer's plain greedy block
decode (unmask.training.block_diffusion.greedy_block_decode: per block, one forward per masked
position commits the most confident one; no cache, no engine). The numbers a model card can state
before the engine decodes the family; the engine's decoders are measured with `unmask bench`.

    python scripts/bench/sdar_greedy_eval.py unmask/assets/sdar_model --task math --n 96 --max-tokens 256

Prints one JSON line: task, n, solved, score, max_tokens, seconds; --samples F writes each
prompt's output as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from unmask.checkpoint import load_model
from unmask.tasks import TASKS
from unmask.training.block_diffusion import greedy_block_decode
from unmask.training.objective import TextEncoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--task", default="math", choices=sorted(TASKS))
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--samples", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(a.model).eval()
    enc = TextEncoder(f"{a.model}/tokenizer.json")
    task = TASKS[a.task]
    examples = task.load("heldout", a.n, seed=0)
    solved, rows, t0 = 0, [], time.time()
    for ex in examples:
        ids = greedy_block_decode(model, enc.prompt(ex.prompt), enc.mask_id, enc.eos_id, a.max_tokens)
        text = enc.tok.decode(ids[: ids.index(enc.eos_id)] if enc.eos_id in ids else ids)
        ok = bool(task.check(ex, text))
        solved += ok
        rows.append({"prompt": ex.prompt, "text": text, "correct": ok})
    if a.samples:
        with open(a.samples, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(json.dumps({"task": a.task, "n": len(examples), "solved": solved,
                      "score": round(solved / len(examples), 4), "max_tokens": a.max_tokens,
                      "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
