"""unmask.compiling on a CUDA device, in one short run without the tokenizer's packages (torch
and numpy only): what produced BENCHMARKS.md's "Compiled forward" GPU numbers.

    OUT=DIR PYTHONPATH=. python scripts/compile_gpu_probe.py

1. float32, the tests' tiny peaky LLaDA and Dream (tests/helpers.py): compiled tokens == eager
   tokens for 4 decoders, through the engine.
2. bfloat16, random weights of a 141M-parameter LLaDA shape (compile_bench.py's, but 4 heads of
   192 instead of 12 of 64; as it ran): threshold and fast
   at batch 1 (4 prompts) and 16 (16 prompts), gen_length 32, eager vs compiled (best of 2),
   token agreement (random weights: near-ties, so bfloat16 rounding flips many), for mode
   default and then reduce-overhead (compile_model now refuses it: run with an older
   unmask.compiling to see it fail).
Writes DIR/probe.json after each part; PROBE_DEADLINE (seconds) skips the parts after it.
"""
import copy
import json
import os
import shutil
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, "tests")  # helpers.peaky_model
T0 = time.time()
DEADLINE = float(os.environ.get("PROBE_DEADLINE", "330"))
out = {"torch": torch.__version__, "cuda": torch.version.cuda,
       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
       "gcc": shutil.which("gcc"), "python": sys.version.split()[0]}
try:
    import triton
    out["triton"] = triton.__version__
except Exception as e:  # noqa: BLE001
    out["triton"] = repr(e)
print(out, flush=True)

from helpers import peaky_model  # noqa: E402

from unmask.compiling import check_compile, compile_model, recompile_count  # noqa: E402
from unmask.config import ModelConfig  # noqa: E402
from unmask.decoding.params import DecodeParams  # noqa: E402
from unmask.engine import decode  # noqa: E402
from unmask.models import build_model  # noqa: E402

dev = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))
SYNC = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
try:
    check_compile(dev)
    out["check_compile"] = "ok"
except Exception as e:  # noqa: BLE001
    out["check_compile"] = repr(e)
print("check_compile", out["check_compile"], flush=True)


def save():
    path = os.path.join(os.environ.get("OUT", "."), "probe.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def run(model, spec, prompts, batch, gen=32):
    p = DecodeParams.parse(spec, gen_length=gen, block_length=gen)
    SYNC()
    t = time.perf_counter()
    reqs = decode(model, p, prompts, max_running=batch)
    SYNC()
    wall = time.perf_counter() - t
    return [r.token_ids for r in reqs], wall


def section(name, fn):
    if time.time() - T0 > DEADLINE:
        out[name] = "skipped: deadline"
        return
    t = time.time()
    try:
        out[name] = fn()
    except Exception:  # noqa: BLE001
        out[name] = {"error": traceback.format_exc()[-3000:]}
    out[name + "_s"] = round(time.time() - t, 1)
    print(name, json.dumps(out[name])[:1500], flush=True)
    save()


def exactness():
    """fp32 peaky tiny models on CUDA: compiled tokens == eager tokens."""
    res = {}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 63, size=n).tolist() for n in (3, 12, 19)] + \
              [rng.integers(3, 63, size=10).tolist() for _ in range(4)]
    for kind in ("llada", "Dream"):
        eager = copy.deepcopy(peaky_model(kind, 0, 8.0, 64, 63, 1)).to(dev)
        comp = copy.deepcopy(eager)
        compile_model(comp)
        for spec in ("threshold,threshold=0.5", "fast,threshold=0.5",
                     "freedave++,draft_steps=4,threshold=0.5", "threshold,threshold=0.5,cache=dual"):
            a, _ = run(eager, spec, prompts, 8, 24)
            b, _ = run(comp, spec, prompts, 8, 24)
            res[f"{kind} {spec}"] = a == b
    res["recompiles"] = recompile_count()
    return res


def big(dtype):
    c = ModelConfig(model_type="llada", d_model=768, n_heads=4, n_kv_heads=4, n_layers=12,
                    mlp_hidden_size=2304, vocab_size=32000, embedding_size=32000,
                    mask_token_id=2, eos_token_id=1, max_sequence_length=4096)
    torch.manual_seed(0)
    m = build_model(c)
    m.init_weights()
    return m.eval().to(dev, dtype)


def speed(mode, dtype=torch.bfloat16):
    eager = big(dtype)
    comp = copy.deepcopy(eager)
    compile_model(comp, mode)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 2000, size=int(n)).tolist() for n in rng.integers(20, 60, size=16)]
    res = {}
    r0 = recompile_count()
    t = time.perf_counter()
    for spec in ("threshold", "fast"):
        for batch in (1, 16):
            ps = prompts[:4] if batch == 1 else prompts
            run(comp, spec, ps, batch)
    res["first_pass_compiled_s"] = round(time.perf_counter() - t, 1)
    res["first_pass_recompiles"] = recompile_count() - r0
    r1 = recompile_count()
    for spec in ("threshold", "fast"):
        for batch in (1, 16):
            ps = prompts[:4] if batch == 1 else prompts
            run(eager, spec, ps, batch)
            te, tc = [], []
            agree = []
            for _ in range(2):
                a, w = run(eager, spec, ps, batch)
                te.append(w)
                b, w = run(comp, spec, ps, batch)
                tc.append(w)
                agree.append(np.mean([np.mean(np.array(x) == np.array(y))
                                      for x, y in zip(a, b, strict=True)]))
            res[f"{spec} b{batch}"] = {"eager_s": round(min(te), 3), "compiled_s": round(min(tc), 3),
                                       "x": round(min(tc) / min(te), 2),
                                       "token_agreement": round(float(np.mean(agree)), 3)}
    res["later_recompiles"] = recompile_count() - r1
    res["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None
    return res


section("exactness_fp32", exactness)
section("speed_default_bf16", lambda: speed("default"))
section("speed_reduce_overhead_bf16", lambda: speed("reduce-overhead"))
out["total_s"] = round(time.time() - T0, 1)
save()
print("done", out["total_s"], flush=True)
