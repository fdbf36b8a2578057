"""Resident memory while loading a single-file checkpoint quantized, split into anonymous memory
(heap, tensors) and the pages of memory-mapped files (BENCHMARKS.md, "Memory-bound calls").

For a random-weight SDAR shape saved as one model.safetensors in a dtype, each scheme is loaded
by `LLM` in a fresh process; a thread samples /proc/self/status (unmask.memory.resident) every
millisecond while it loads. Reported, above the process's memory before the load (the libraries
`LLM` uses imported: torch, torchao, transformers): the weights' bytes as loaded
(unmask.quantize.weight_bytes), the resident memory after the load (anonymous / file-mapped), the
kernel's peak (VmHWM: both kinds at once), the part of it reached by the end of the weights' load,
the sampled peaks of each kind, and the libraries' import.

    .venv/bin/python scripts/probe/load_memory.py --shape sdar-170m --dtype float32 --schemes int8,int4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from memory_floor import SHAPES, random_folder  # noqa: E402

from unmask.memory import resident  # noqa: E402
from unmask.quantize import mib, torchao_version, weight_bytes  # noqa: E402

SAMPLE_S = 0.001


class Peaks:
    """The largest anonymous and file-mapped resident memory a thread sees while it runs."""

    def __init__(self) -> None:
        self.anonymous = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = resident()
            self.anonymous, self.file = max(self.anonymous, r.anonymous), max(self.file, r.file)
            time.sleep(SAMPLE_S)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def load_once(folder: Path, scheme: str | None, dtype: str) -> dict:
    """In this fresh process: load `folder` as `scheme`; its memory above the process's before,
    with the libraries `LLM` uses imported (their import is not the load: `libraries`)."""
    start = resident()
    from transformers import PreTrainedTokenizerFast  # noqa: F401, PLC0415  (the tokenizer's)

    from unmask import LLM  # noqa: PLC0415

    torchao_version()  # the quantizing library
    before = resident()
    with Peaks() as peaks:
        llm = LLM(folder, device="cpu", dtype=dtype, quantize=scheme)
    after = resident()
    return {"weights": weight_bytes(llm.model), "anonymous": after.anonymous - before.anonymous,
            "file": after.file - before.file, "peak": after.peak - before.total,
            "load_peak": llm.load_memory.peak - before.total,
            "peak_anonymous": peaks.anonymous - before.anonymous,
            "peak_file": peaks.file - before.file, "libraries": before.total - start.total}


def table(folder: Path, schemes: list[str | None], dtype: str) -> list[str]:
    out = ["| weights | bytes | resident after (anonymous / file) | peak (VmHWM) | of it by the "
           "load's end | sampled peak anonymous / file | peak / bytes | peak anonymous / bytes | "
           "libraries' import |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for scheme in schemes:
        load_dtype = "bfloat16" if scheme == "int4" else dtype
        m = json.loads(subprocess.run([sys.executable, __file__, "--load-once", str(folder),
                                       str(scheme), load_dtype], check=True, capture_output=True,
                                      text=True).stdout.splitlines()[-1])
        out.append(f"| {scheme or load_dtype} ({load_dtype}) | {mib(m['weights'])} | "
                   f"{mib(m['anonymous'])} / {mib(m['file'])} | {mib(m['peak'])} | "
                   f"{mib(m['load_peak'])} | {mib(m['peak_anonymous'])} / {mib(m['peak_file'])} | "
                   f"{m['peak'] / m['weights']:.2f} | {m['peak_anonymous'] / m['weights']:.2f} | "
                   f"{mib(m['libraries'])} |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="sdar-170m")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the checkpoint's dtype, and the load's (int4: bfloat16)")
    ap.add_argument("--schemes", default="int8,int4,w8a8,none")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--load-once", nargs=3, metavar=("FOLDER", "SCHEME", "DTYPE"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_once:
        folder, scheme, dtype = args.load_once
        print(json.dumps(load_once(Path(folder), None if scheme == "None" else scheme, dtype)))
        return
    schemes = [None if s == "none" else s for s in args.schemes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_folder(args.shape, Path(tmp), dtype=args.dtype)
        size = (folder / "model.safetensors").stat().st_size
        lines = [f"# Load memory: random-weight {args.shape}, one model.safetensors in "
                 f"{args.dtype} ({mib(size)})", "",
                 f"Each scheme loaded by `LLM` in a fresh process, above its memory before the "
                 f"load, with the libraries it uses imported (torch, torchao, transformers: "
                 f"their import, the last column, is not the load's); bytes: the loaded model's "
                 f"weights as held (unmask.quantize.weight_bytes); peak: the kernel's VmHWM, "
                 f"anonymous and file-mapped pages together; \"by the load's end\": the VmHWM "
                 f"`LLM` logs once the weights are loaded, before the tokenizer; load average "
                 f"{os.getloadavg()[0]:.1f}.", "",
                 *table(folder, schemes, args.dtype), "",
                 f"Command: `python scripts/probe/load_memory.py {' '.join(sys.argv[1:])}`"]
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
