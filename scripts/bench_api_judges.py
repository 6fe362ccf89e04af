"""Labelling throughput of an API judge against a fake server with fixed latency.

Compares (1) the reference pattern, a plain loop of synchronous SDK calls one at a time (what the
MJ-Bench code does), (2) our ApiJudge with concurrency 1, and (3) our ApiJudge with concurrency N.
All three send the same two-image requests (both orders of every pair); no cache.

    python scripts/bench_api_judges.py --pairs 48 --latency 0.1 --concurrency 16 [--kind openai]
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import time
from pathlib import Path

import openai
import torch

import rewards
from align.testing.fake_judge_servers import FakeJudgeServer, constant_judge
from rewards.images import encode_png, to_pil
from rewards.judge_prompts import JudgeQuestion, render

REPO = Path(__file__).resolve().parents[1]

PREFIX = {"openai": "openai", "anthropic": "anthropic", "gemini": "google"}
KEY_VARS = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY", "gemini": "GEMINI_API_KEY"}


class ServerProcess:
    """The fake server in separate processes, as a real API is: its work must not compete for our GIL.

    ``workers`` processes listen on one port (SO_REUSEPORT); the kernel spreads connections over them,
    so the server's own JSON handling (a few ms of Python per request) does not queue behind one GIL.
    """

    def __init__(self, kind: str, latency: float, workers: int = 4):
        self.kind, self.latency, self.workers = kind, latency, workers

    @staticmethod
    def _serve(kind, latency, port, port_queue, stop_event):
        with FakeJudgeServer(kind, latency=latency, answer=constant_judge, decode_images=False,
                             port=port, reuse_port=True) as server:
            port_queue.put((server.base_url, server.port))
            stop_event.wait()

    def __enter__(self):
        ctx = multiprocessing.get_context("fork")
        queue, self._stop = ctx.Queue(), ctx.Event()
        self._procs = []
        port = 0  # the first worker picks a free port; the others join it
        for _ in range(self.workers):
            proc = ctx.Process(target=self._serve, args=(self.kind, self.latency, port, queue, self._stop), daemon=True)
            proc.start()
            self._procs.append(proc)
            self.base_url, port = queue.get(timeout=60)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for proc in self._procs:
            proc.join(timeout=10)


def reference_loop(server, captions, images_a, images_b) -> float:
    """One synchronous chat.completions call at a time, both orders (OpenAI wire format only)."""
    client = openai.OpenAI(api_key=os.environ["OPENAI_API_KEY"], base_url=server.base_url, max_retries=0)
    question = JudgeQuestion("pair")
    start = time.perf_counter()
    for caption, a, b in zip(captions, to_pil(images_a), to_pil(images_b)):
        for first, second in ((a, b), (b, a)):
            content = [{"type": "text", "text": render(question, caption)}]
            for img in (first, second):
                data = base64.b64encode(encode_png(img)).decode()
                content.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}],
                                           temperature=0)
    return time.perf_counter() - start


def ours(server, kind: str, concurrency: int, captions, images_a, images_b) -> tuple[float, int]:
    judge = rewards.load(f"{PREFIX[kind]}:fake-model", base_url=server.base_url, concurrency=concurrency)
    start = time.perf_counter()
    prefs = judge.compare(captions, images_a, images_b)
    elapsed = time.perf_counter() - start
    return elapsed, sum(not p.abstained for p in prefs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds the fake server waits per request")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kind", choices=sorted(PREFIX), default="openai")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--server-workers", type=int, default=4, help="fake server processes sharing the port")
    parser.add_argument("--in-process-server", action="store_true",
                        help="run the fake server in this process (its threads then share our GIL)")
    args = parser.parse_args(argv)
    if args.server_workers < 1:
        parser.error("--server-workers must be >= 1")

    os.environ.setdefault(KEY_VARS[args.kind], "bench-key")
    g = torch.Generator().manual_seed(0)
    images_a = torch.rand(args.pairs, 3, args.size, args.size, generator=g)
    images_b = torch.rand(args.pairs, 3, args.size, args.size, generator=g)
    captions = [f"caption {i}" for i in range(args.pairs)]
    requests = 2 * args.pairs
    results: dict = {"pairs": args.pairs, "requests": requests, "latency_s": args.latency, "kind": args.kind}
    results["server"] = "in-process threads" if args.in_process_server else f"{args.server_workers} separate processes"
    if args.in_process_server:
        server_cm = FakeJudgeServer(args.kind, latency=args.latency, answer=constant_judge, decode_images=False)
    else:
        server_cm = ServerProcess(args.kind, args.latency, args.server_workers)
    with server_cm as server:
        ours(server, args.kind, args.concurrency, captions[:2], images_a[:2], images_b[:2])  # warm-up (imports)
        if args.kind == "openai":
            results["reference_loop_s"] = reference_loop(server, captions, images_a, images_b)
        results["ours_c1_s"], _ = ours(server, args.kind, 1, captions, images_a, images_b)
        results[f"ours_c{args.concurrency}_s"], labelled = ours(
            server, args.kind, args.concurrency, captions, images_a, images_b
        )
    baseline = results.get("reference_loop_s", results["ours_c1_s"])
    concurrent = results[f"ours_c{args.concurrency}_s"]
    results["labelled_pairs"] = labelled
    results["speedup_vs_reference"] = baseline / concurrent
    results["requests_per_s"] = requests / concurrent
    for name, value in results.items():
        print(f"{name:>24}: {value:.3f}" if isinstance(value, float) else f"{name:>24}: {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
