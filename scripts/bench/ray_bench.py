"""Ray Serve with 1 and 2 engine replicas against the plain server, in one run (BENCHMARKS.md).

Starts the plain server (`unmask serve`, its own process), a local Ray cluster with the app
deployed twice (1 replica at /r1, 2 at /r2; each replica one CPU, one torch thread), measures
what Ray's routing adds per request (sequential GET /v1/models, no engine work), runs
`unmask bench-serve` against the three, and takes everything down.

    .venv/bin/python scripts/bench/ray_bench.py [--bench "unmask bench-serve"] [bench-serve args...]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
from ray import serve

from unmask.server.ray_serve import RayServeOptions, deploy, free_port
from unmask.server.state import ServerConfig


def routing_ms(url: str, n: int = 200) -> float:
    with httpx.Client(timeout=30) as c:
        for _ in range(10):
            c.get(f"{url}/v1/models")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.get(f"{url}/v1/models").raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", default=str(Path(sys.executable).parent / "unmask") + " bench-serve",
                   help="the bench-serve command (default: unmask bench-serve)")
    args, rest = p.parse_known_args()
    port = free_port("127.0.0.1")
    plain = subprocess.Popen([str(Path(sys.executable).parent / "unmask"), "serve", "--port",
                              str(port), "--threads", "1", "--log-level", "warning"])
    ray.init(num_cpus=3, object_store_memory=100 * 2**20, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="ur", dir="/tmp"), log_to_driver=False)
    try:
        ray_port = free_port("127.0.0.1")
        urls = {"plain": f"http://127.0.0.1:{port}"}
        for n in (1, 2):
            opts = RayServeOptions(replicas=n, cpus_per_replica=1, threads=1, server=ServerConfig())
            urls[f"ray{n}"] = deploy(opts, "127.0.0.1", ray_port, name=f"r{n}", route_prefix=f"/r{n}")
        for _ in range(100):
            try:
                httpx.get(f"{urls['plain']}/health").raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        for name, url in urls.items():
            print(f"routing ({name}): GET /v1/models median {routing_ms(url):.2f} ms", flush=True)
        cmd = [*shlex.split(args.bench), *[f"--url={k}={v}" for k, v in urls.items()], *rest]
        print("$", shlex.join(cmd), flush=True)
        return subprocess.call(cmd)
    finally:
        plain.terminate()
        plain.wait(60)
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
