"""Does a DPO run's cost before its first step, or its peak memory, depend on the dataset's size?
Targets: 5,000 pairs at <= 1.10x the peak RSS of 500 pairs (issue 37); the seconds to the first step and the
bytes of the data read before it flat from 500 to 50,000 pairs (issue 61).

    python scripts/bench_data_memory.py                          # 500 vs 5,000 pairs, 128 px
    python scripts/bench_data_memory.py --sizes 500,5000,50000 --cases default
    python scripts/bench_data_memory.py --sizes 500,5000 --cases images,images-workers,store

Builds synthetic Pick-a-Pic-schema parquet files (caption, jpg_0, jpg_1, label_0, label_1; random
JPEGs at --resolution px, one tie in ten; row groups of 100 rows, as large files are written), a tiny
SD-architecture pipeline (align/testing/tiny_sd.py), and runs `align/dpo.py --finetune lora --max_steps 2`
on each file in a fresh subprocess with a fresh datasets cache. Peak memory of a run: the largest
single process's peak RSS (getrusage of the children), and the whole process tree's RSS sampled every
20 ms (psutil: the trainer plus its DataLoader workers), in full and without file-backed pages
(RSS - shared: the pages of memory-mapped data that were read count in RSS but the kernel can drop them).

Before the first step: the seconds from the start of the process to the first line of metrics.jsonl (and the CPU
seconds the trainer's processes used by then: wall time on a shared machine also counts other jobs), and
the data it read by then: the parquet file is dropped from the page cache before each run
(posix_fadvise DONTNEED), and when step 1 is logged the pages of the parquet file, and of any file
`datasets` wrote into its cache (a conversion of the whole file), that are in the page cache are counted
(mincore). Linux only.

Cases: default         the trainer's defaults (the run's own latent store of the pairs it reads)
       images          pixels decoded in the training process (--latent_store none)
       images-workers  the same with two DataLoader workers (--dataloader_num_workers 2)
       store           the default: every pair encoded once into the run folder's latent store
                       (at 32 px: the build encodes every pair, which at 128 px takes over an hour here)
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from align.testing.tiny_sd import build_tiny_pipeline

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "default": [],
    "images": ["--latent_store", "none"],
    "images-workers": ["--latent_store", "none", "--dataloader_num_workers", "2"],
    # Encoding 5,000 pairs at 128 px takes over an hour on two shared cores: the store case trains at 32 px.
    "store": ["--resolution", "32"],
}


def write_pairs(path: Path, count: int, size: int, seed: int = 0) -> None:

    rng = np.random.default_rng(seed)
    schema = pa.schema([("caption", pa.string()), ("jpg_0", pa.binary()), ("jpg_1", pa.binary()),
                        ("label_0", pa.float64()), ("label_1", pa.float64())])

    def jpeg():
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, format="JPEG", quality=90)
        return buffer.getvalue()

    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, count, 100):
            rows = []
            for i in range(start, min(count, start + 100)):
                label = 0.5 if i % 10 == 9 else float(i % 2)
                rows.append({"caption": f"a photo number {i}", "jpg_0": jpeg(), "jpg_1": jpeg(),
                             "label_0": label, "label_1": 1.0 - label})
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache (they are clean once fsynced), so that a run's reads show."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def cached_bytes(path: Path) -> int:
    """Bytes of a file in the page cache (mincore over a mapping of it that touches no page)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        pages = -(-size // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        try:
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return min(size, sum(v & 1 for v in vector) * mmap.PAGESIZE)


def data_read(data: Path, cache: Path) -> tuple[float, float]:
    """MB of the parquet file in the page cache, and MB of what datasets wrote into its cache (all of it counted:
    written pages are in the page cache, and a conversion reads the whole source to write them)."""
    written = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0
    return cached_bytes(data) / 2**20, written / 2**20


def cpu_seconds(parent: psutil.Process) -> float | None:
    """CPU seconds (user + system) the trainer and its live children have used: less sensitive than wall time to other
    jobs on a shared machine."""
    try:
        return sum(sum(p.cpu_times()[:2]) for p in [parent, *parent.children(recursive=True)])
    except psutil.Error:
        return None


def measure(model: str, data: Path, resolution: int, extra: list[str], workdir: Path) -> dict:
    """Run dpo.py in a subprocess (from a fresh child of this script, so getrusage sees only it)."""
    env = dict(os.environ, HF_DATASETS_CACHE=str(workdir / "datasets_cache"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, str(ROOT / "align" / "dpo.py"), "--model", model, "--dataset", str(data),
           "--output-dir", str(workdir / "run"), "--finetune", "lora", "--lora_rank", "4", "--resolution", str(resolution),
           "--train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps", "2", "--learning_rate", "1e-4",
           "--scale_lr", "false", "--lr_warmup_steps", "0", "--checkpointing_steps", "1000",
           "--report_to", "none", *extra]
    evict(data)
    metrics = workdir / "run" / "metrics.jsonl"
    first_step = first_cpu = parquet_mb = cache_mb = None
    start = time.perf_counter()
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parent, tree_peak, anon_peak = psutil.Process(process.pid), 0, 0
    while process.poll() is None:
        if first_step is None and metrics.is_file() and metrics.stat().st_size > 0:
            first_step = time.perf_counter() - start
            parquet_mb, cache_mb = data_read(data, workdir / "datasets_cache")
            first_cpu = cpu_seconds(parent)
        try:
            members = [parent, *parent.children(recursive=True)]
            infos = [m.memory_info() for m in members]
            tree_peak = max(tree_peak, sum(i.rss for i in infos))
            anon_peak = max(anon_peak, sum(i.rss - i.shared for i in infos))  # without file-backed pages
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"dpo.py failed ({process.returncode}):\n{err[-3000:]}")
    return {"max_process_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "tree_mb": tree_peak / 2**20, "anon_mb": anon_peak / 2**20, "seconds": time.perf_counter() - start,
            "first_step_s": first_step, "first_step_cpu_s": first_cpu, "parquet_read_mb": parquet_mb,
            "cache_written_mb": cache_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="500,5000")
    parser.add_argument("--cases", default="default,images,images-workers,store")
    parser.add_argument("--workdir", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--data_dir", default=None, help="keep the parquet files here and reuse them (default: in the "
                        "temporary folder)")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--one", nargs=4, metavar=("MODEL", "DATA", "CASE", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, data, case, workdir = args.one
        print(json.dumps(measure(model, Path(data), args.resolution, CASES[case], Path(workdir))))
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        model = str(build_tiny_pipeline(tmp / "model"))
        files = {}
        data_dir = Path(args.data_dir) if args.data_dir else tmp
        data_dir.mkdir(parents=True, exist_ok=True)
        for size in sizes:
            files[size] = data_dir / f"pairs_{size}_{args.resolution}px.parquet"
            if not files[size].is_file():
                write_pairs(files[size].with_suffix(".tmp"), size, args.resolution)
                files[size].with_suffix(".tmp").rename(files[size])
            print(f"{size} pairs: {files[size].stat().st_size / 2**20:.1f} MB parquet", flush=True)
        for case in args.cases.split(","):
            results = {}
            for size in sizes:
                workdir = tmp / f"{case}_{size}"
                out = subprocess.run([sys.executable, __file__, "--resolution", str(args.resolution), "--one", model,
                                      str(files[size]), case, str(workdir)], capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{case} {size}: {out.stderr[-3000:]}")
                results[size] = json.loads(out.stdout.strip().splitlines()[-1])
                r = results[size]
                print(f"{case:15s} {size:6d} pairs: first step after {r['first_step_s']:6.1f} s ({r['first_step_cpu_s']:6.1f} "
                      f"CPU s), data read before it "
                      f"{r['parquet_read_mb']:8.1f} MB of the parquet file ({files[size].stat().st_size / 2**20:.0f} MB) + "
                      f"{r['cache_written_mb']:8.1f} MB written to datasets' cache; peak RSS {r['max_process_mb']:7.1f} MB "
                      f"(largest process), {r['tree_mb']:7.1f} MB (process tree), {r['anon_mb']:7.1f} MB (tree, "
                      f"anonymous); {r['seconds']:.1f} s in all", flush=True)
            small, large = results[sizes[0]], results[sizes[-1]]
            print(f"{case:15s} ratio {sizes[-1]}/{sizes[0]} pairs: {large['max_process_mb'] / small['max_process_mb']:.3f} "
                  f"(largest process), {large['tree_mb'] / small['tree_mb']:.3f} (tree), "
                  f"{large['anon_mb'] / small['anon_mb']:.3f} (tree, anonymous); target <= 1.10", flush=True)


if __name__ == "__main__":
    main()
