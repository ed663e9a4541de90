"""Staging throughput: `stage_model` (LocalNode) into the RAM disk vs `cp -r`, side by side.

    .venv/bin/python bench/bench_staging.py --size-gb 2

Builds a model-shaped directory of random bytes on the local disk (never the RAM disk),
then copies it into the RAM disk with `cp -r` and with stage_model at each stream count,
alternating the order every round and dropping the page cache before each copy when
allowed (root), so every copy reads cold from disk; otherwise the results say "warm".
Also times a no-op re-stage (the cost of adopting a finished copy on every flow run).
Prints a markdown table and appends it to bench/RESULTS.md under "## Staging".
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.node.local import LocalNode  # noqa: E402
from fleet.staging import fleet_root, stage_model  # noqa: E402

GiB = 2**30
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"


def sh(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    return (r.stdout or r.stderr).strip()


def fstype(path: str) -> str:
    return sh("df", "--output=fstype", path).splitlines()[-1].strip()


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def make_source(root: Path, total: int, files: int) -> None:
    """files x (total/files) random bytes plus small config files; reused when already there."""
    each = total // files
    root.mkdir(parents=True, exist_ok=True)
    chunk = 64 * 2**20
    for i in range(files):
        p = root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        if p.exists() and p.stat().st_size == each:
            continue
        with open(p, "wb") as fh:
            left = each
            while left:
                n = min(chunk, left)
                fh.write(os.urandom(n))
                left -= n
    (root / "config.json").write_text('{"model_type": "bench"}\n')
    (root / "tokenizer.json").write_bytes(os.urandom(2 * 2**20))
    os.sync()


def machine() -> list[str]:
    mem = sh("sh", "-c", "grep MemTotal /proc/meminfo")
    return [
        f"- host: {platform.node()}, {platform.platform()}, {os.cpu_count()} CPUs (nproc {sh('nproc')})",
        f"- RAM: {mem.split(':', 1)[-1].strip()}",
        "- RAM disk: `" + " | ".join(sh("df", "-h", "/dev/shm").splitlines()) + "`",
        f"- load average at the end (other work on the machine skews results): {open('/proc/loadavg').read().split()[:3]}",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="model size in GiB (scaled down to fit the RAM disk)")
    ap.add_argument("--files", type=int, default=8, help="number of weight shards")
    ap.add_argument("--streams", default="1,8", help="stream counts to run stage_model with, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the order of methods alternates each round")
    ap.add_argument("--src-parent", default="/var/tmp", help="where the source is built (local disk, not tmpfs)")
    ap.add_argument("--ramdisk", default="/dev/shm")
    ap.add_argument("--results", default=str(Path(__file__).with_name("RESULTS.md")))
    ap.add_argument("--no-append", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--keep-src", action="store_true", help="keep the generated source for the next run")
    args = ap.parse_args()

    if fstype(args.src_parent) in ("tmpfs", "ramfs"):
        print(f"{args.src_parent} is a {fstype(args.src_parent)}: pick a disk with --src-parent", file=sys.stderr)
        return 2
    total = int(args.size_gb * GiB)
    # two copies never coexist (each is removed before the next), but keep 1 GiB + 10 % spare
    room = int((free_bytes(args.ramdisk) - GiB) / 1.1)
    notes = []
    if total > room:
        notes.append(f"scaled down from {args.size_gb} GiB to fit {args.ramdisk}")
        total = max(room, 64 * 2**20)
    disk_room = free_bytes(args.src_parent) - GiB
    if total > disk_room:
        print(f"not enough disk in {args.src_parent} for {total / GiB:.1f} GiB", file=sys.stderr)
        return 2

    src = Path(args.src_parent) / "fleet-bench-staging" / "BenchModel"
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-work-"))
    shm = Path(args.ramdisk)
    cp_dst = shm / "fleet-bench-cp"
    stage_dst = Path(fleet_root(str(shm), "bench", os.getuid()))   # every copy the bench stages is under it
    node = LocalNode()
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    methods = ["cp -r"] + [f"stage_model streams={s}" for s in streams]
    rows: list[dict] = []
    noop: list[float] = []
    cold_any = False

    t = time.monotonic()
    make_source(src, total, args.files)
    size = sum(p.stat().st_size for p in src.iterdir())
    print(f"source: {src} ({size / GiB:.2f} GiB in {args.files + 2} files, on {fstype(str(src))}), "
          f"built in {time.monotonic() - t:.1f} s", file=sys.stderr)

    try:
        for rnd in range(args.rounds):
            order = methods if rnd % 2 == 0 else list(reversed(methods))
            for method in order:
                shutil.rmtree(cp_dst, ignore_errors=True)
                shutil.rmtree(stage_dst, ignore_errors=True)
                cold = drop_caches()
                cold_any |= cold
                t0 = time.monotonic()
                copy_rate = None
                if method == "cp -r":
                    subprocess.run(["cp", "-r", str(src), str(cp_dst)], check=True)
                else:
                    res = stage_model(node, source=str(src), ramdisk=str(shm), fleet="bench", workdir=str(work),
                                      python=PY, streams=int(method.split("=")[1]), margin_bytes=0)
                    assert res.bytes_copied == size, res
                    copy_rate = res.mb_per_s
                wall = time.monotonic() - t0
                rows.append({"round": rnd + 1, "method": method, "cache": "cold" if cold else "warm",
                             "seconds": wall, "mb_s": size / 1e6 / wall, "copy_mb_s": copy_rate})
                print(f"round {rnd + 1} {method:24s} {wall:6.2f} s {size / 1e6 / wall:8.0f} MB/s", file=sys.stderr)
                if method != "cp -r":
                    t1 = time.monotonic()
                    again = stage_model(node, source=str(src), ramdisk=str(shm), fleet="bench", workdir=str(work),
                                        python=PY, streams=int(method.split("=")[1]), margin_bytes=0)
                    assert again.adopted
                    noop.append(time.monotonic() - t1)
    finally:
        shutil.rmtree(cp_dst, ignore_errors=True)
        shutil.rmtree(stage_dst, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep_src:
            shutil.rmtree(src.parent, ignore_errors=True)

    lines = ["| method | round | page cache | seconds | MB/s (wall) | MB/s (copy phase) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cr = f"{r['copy_mb_s']:.0f}" if r["copy_mb_s"] is not None else "—"
        lines.append(f"| {r['method']} | {r['round']} | {r['cache']} | {r['seconds']:.2f} | {r['mb_s']:.0f} | {cr} |")
    lines += ["", "| method | median MB/s (wall) |", "| --- | --- |"]
    for m in methods:
        lines.append(f"| {m} | {statistics.median(r['mb_s'] for r in rows if r['method'] == m):.0f} |")
    lines.append(f"| no-op re-stage (adopt) | {statistics.median(noop):.3f} s median of {len(noop)} |")
    table = "\n".join(lines)
    print(table)

    disk_line = " | ".join(sh("df", "-h", args.src_parent).splitlines())
    rota = sh("lsblk", "-d", "-o", "NAME,ROTA,SIZE,MODEL")
    cmd = shlex.join([".venv/bin/python", "bench/bench_staging.py", *sys.argv[1:]])
    section = [
        "## Staging", "",
        f"{dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')} — `{cmd}`", "",
        *machine(),
        f"- source disk ({fstype(args.src_parent)}): `{disk_line}`" + (f"; block devices: `{' ; '.join(rota.splitlines())}`" if rota else ""),
        f"- model: {size / GiB:.2f} GiB, {args.files} shards of {size // args.files / 2**20:.0f} MiB + 2 small files, random bytes"
        + (f" ({'; '.join(notes)})" if notes else ""),
        "- page cache: " + ("dropped before every copy (`sync; echo 3 > /proc/sys/vm/drop_caches`): cold reads"
                            if cold_any else "could not be dropped: warm reads, source served from RAM"),
        "- wall MB/s for stage_model includes uploading the script, the plan and the room check; "
        "the copy-phase rate is the stage script's own",
        "", table, "",
    ]
    if not args.no_append:
        path = Path(args.results)
        prev = path.read_text() if path.exists() else "# Benchmark results\n"
        path.write_text(prev.rstrip("\n") + "\n\n" + "\n".join(section))
        print(f"appended to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
