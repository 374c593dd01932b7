"""Cleaning at scale (issue #18): one node with 1 and 2 worker CPUs, a two-node local Ray cluster,
and datatrove, on the same corpus in the same run, with the driver under a memory cap.

    flock /tmp/raypai-heavy.lock .venv/bin/python benchmarks/data_scale.py               # 100k synthetic docs
    flock /tmp/raypai-heavy.lock .venv/bin/python benchmarks/data_scale.py --docs 20000 --systems 1node-2cpu

Needs datatrove for its row (`PIP_CONSTRAINT=.ci/constraints.txt .venv/bin/pip install -e ".[bench]"`).
Corpus: the valid rows of a `raypai.data.synth` corpus as 16 JSONL files (`data_clean.prepare_synthetic`,
shared with benchmarks/data_clean.py). Every system runs the default recipe's work (raypai: the
default recipe, filters + exact_dedup + minhash_dedup; datatrove: data_clean.py's filters+minhash
pipeline, 2 workers) in a child process:
  1node-1cpu  a local Ray started by the child with num_cpus=1
  1node-2cpu  the same with num_cpus=2
  2node       `infra/local-cluster.sh up` with HEAD_CPUS=1 WORKER_CPUS=1 (2 CPUs in all, on two
              raylets; on this machine both share its cores) on free non-default ports; the child
              joins it through RAY_ADDRESS
Driver cap: once Ray is connected, the raypai child sets RLIMIT_DATA to its own VmData then plus
`--driver-headroom-mb` (default 64): it may allocate that much more and no more. (Every new
thread's 8 MB stack counts against RLIMIT_DATA: when the filter pass ran on Ray Data, its
executor could not start its threads under 64 MB and the default was 256; clean's plain tasks
start none.) `driver_free_under_cap_mb` is what the driver could still allocate
after the clean. Ray's processes
are not under it (started before, or by the raylet, which was; each process's `Max data size` is
read and reported). After the clean it tries to load the kept text into memory, which must fail
under the cap (`kept_text_load_under_cap`: the check that the cap binds).
Memory per process: the parent samples the child and (2node) both nodes' process trees 4 times a
second, keeping each process's peak RSS; workers are processes named `ray::...`. The driver's own
peak is its VmHWM. Work placement: the clean manifest's filter tasks per node; every finished Ray
task (ingest, filter, dedup units, writes) per node from Ray's state API (2node only: the local
Rays run without a dashboard).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from data_clean import prepare_synthetic, run_datatrove

REPO = Path(__file__).resolve().parents[1]
# ports away from the defaults (6379 is Redis here; 6380/8265 may be another local cluster); the
# client port outside the worker ports Ray takes by default (10002-19999)
CLUSTER_ENV = {
    "RAYPAI_CLUSTER_PORT": "6391",
    "RAYPAI_DASHBOARD_PORT": "8291",
    "RAYPAI_CLIENT_PORT": "20091",
    "RAYPAI_AGENT_PORT": "52391",
    "HEAD_CPUS": "1",
    "WORKER_CPUS": "1",
    "WORKER_RESOURCES": '{"worker_node": 1}',
}


def _status(pid: int | str = "self") -> dict[str, int]:
    """VmData/VmRSS/VmHWM of a process, in bytes."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key, val = line.split(":", 1)
        if key in ("VmData", "VmRSS", "VmHWM"):
            out[key] = int(val.split()[0]) * 1024
    return out


def _data_limit(pid: int) -> str:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max data size"):
            return line.split()[3]
    return "?"


# ----------------------------------------------------------------------------- child side


def child_raypai(inp: Path, work: Path, cpus: int, headroom_mb: int, cluster: bool) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from raypai.data import DEFAULT_RECIPE, clean, ingest
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    t0 = time.perf_counter()
    if cluster:  # RAY_ADDRESS and the auth settings come from the parent
        ensure_ray(Settings.load(), log_to_driver=False)
    else:
        ensure_ray(Settings.load(), local=True, num_cpus=cpus, dashboard=False, log_to_driver=False)
    base = _status()
    cap = base["VmData"] + headroom_mb * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    t1 = time.perf_counter()
    ingest(inp, work / "ing")
    t_ingest = time.perf_counter() - t1
    m = clean(work / "ing", work / "out", DEFAULT_RECIPE, work_dir=work / "w", progress=lambda *_: None)
    seconds = time.perf_counter() - t1
    end = _status()
    free = _free_under_cap()  # before the load below, whose failed allocations pyarrow may keep reserved
    # The cap must bind: holding the kept text in this process has to fail under it. One thread, no
    # pre-buffering: an allocation refused in one of pyarrow's pool threads aborts the process
    # (seen at 1 CPU) instead of raising here.
    try:
        texts = [
            pq.read_table(work / "out" / s["file"], columns=["text"], use_threads=False, pre_buffer=False)
            for s in m["shards"]
        ]
        held = sum(t.nbytes for t in texts)
        load_fails = False
        del texts
    except (MemoryError, pa.ArrowMemoryError):
        held, load_fails = 0, True
    try:
        placement = _task_placement() if cluster else None
    except Exception as e:  # noqa: BLE001 - the figures stand without it; say why it is missing
        placement = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    ray.shutdown()
    return {
        "seconds": seconds,
        "startup_s": t1 - t0,
        "ingest_s": t_ingest,
        "kept": m["rows"],
        "kept_text_bytes": m["text_bytes"],
        "filter": m["filter"],
        "placement": placement,
        "driver_vmdata_at_cap_mb": round(base["VmData"] / 2**20),
        "driver_cap_mb": round(cap / 2**20),
        "driver_headroom_mb": headroom_mb,
        "driver_peak_rss_mb": round(end["VmHWM"] / 2**20),
        "driver_rss_at_connect_mb": round(base["VmRSS"] / 2**20),
        "kept_text_load_under_cap": "failed (cap binds)" if load_fails else f"succeeded ({held} bytes)",
        "driver_free_under_cap_mb": round(free / 2**20),
        "op_seconds": {r["op_name"]: r["seconds"] for r in m["op_stats"]},
    }


def _free_under_cap(step: int = 8 << 20) -> int:
    """Bytes this process can still allocate in `step` chunks (malloc'd, zero-filled) before the
    cap refuses: the cap's real headroom, which includes space the allocators had reserved before
    it was set."""
    held = []
    try:
        while True:
            held.append(bytearray(step))
    except MemoryError:
        pass
    n = len(held) * step
    del held
    return n


def _task_placement() -> dict:
    """{node: {task name: finished count}} from Ray's state API; node = 'head' / 'worker' (the
    node with the worker_node resource)."""
    import ray
    from ray.util.state import list_tasks

    label = {n["NodeID"]: "worker" if "worker_node" in n["Resources"] else "head" for n in ray.nodes()}
    out: dict[str, dict[str, int]] = {}
    for t in list_tasks(filters=[("state", "=", "FINISHED")], limit=10_000, raise_on_missing_output=False):
        node = label.get(t.node_id, str(t.node_id)[:8])
        name = t.name.split("(")[0]
        out.setdefault(node, {})
        out[node][name] = out[node].get(name, 0) + 1
    return out


# ----------------------------------------------------------------------------- parent side


class ProcSampler:
    """Peak RSS per process over the trees under `roots` (the child; both nodes' `ray start`)."""

    def __init__(self, roots: list[int]):
        self.roots = [psutil.Process(p) for p in roots]
        self.peak: dict[int, int] = {}
        self.kind: dict[int, str] = {}
        self.limit: dict[int, str] = {}
        self.peak_sum = 0
        self.cpu: dict[int, float] = {}

    def sample(self) -> None:
        total = 0
        procs = {p.pid: p for r in self.roots for p in [r, *_children(r)]}
        for pid, p in procs.items():
            try:
                with p.oneshot():
                    rss = p.memory_info().rss
                    t = p.cpu_times()
                    if self.kind.get(pid) not in ("driver", "worker"):  # a worker is named ray::... once started
                        cmd = " ".join(p.cmdline())
                        self.kind[pid] = (
                            "driver"
                            if pid == self.roots[0].pid
                            else "worker"
                            if cmd.startswith("ray::") or "default_worker.py" in cmd
                            else "ray-system"
                        )
                    self.limit[pid] = _data_limit(pid)
            except (psutil.Error, OSError):
                continue
            total += rss
            self.peak[pid] = max(self.peak.get(pid, 0), rss)
            self.cpu[pid] = max(self.cpu.get(pid, 0.0), t.user + t.system)
        self.peak_sum = max(self.peak_sum, total)

    def summary(self) -> dict:
        by = {}
        for pid, kind in self.kind.items():
            by.setdefault(kind, []).append(self.peak.get(pid, 0))
        return {
            "worker_processes": len(by.get("worker", [])),
            "worker_peak_rss_mb_max": round(max(by.get("worker", [0])) / 2**20),
            "worker_peak_rss_mb_median": round(sorted(by.get("worker", [0]))[len(by.get("worker", [0])) // 2] / 2**20),
            "ray_system_peak_rss_mb_max": round(max(by.get("ray-system", [0])) / 2**20),
            "tree_peak_rss_mb_sum": round(self.peak_sum / 2**20),
            "cpu_s": round(sum(self.cpu.values()), 1),
            # a Ray process under the driver's RLIMIT_DATA would show its value here
            "ray_data_limits": sorted({v for pid, v in self.limit.items() if self.kind.get(pid) != "driver"}),
        }


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def run_child(cmd: list[str], env: dict, roots_extra: list[int]) -> tuple[dict, ProcSampler]:
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = ProcSampler([child.pid, *roots_extra])

    def loop():
        while child.poll() is None:
            sampler.sample()
            time.sleep(0.25)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    out, err = child.communicate()
    th.join()
    if child.returncode != 0:
        sys.stderr.write(err[-4000:])
        raise SystemExit(f"child failed (exit {child.returncode}): {' '.join(cmd)}")
    return json.loads(out.strip().splitlines()[-1]), sampler


def cluster(cmd: str, env: dict) -> None:
    subprocess.run(
        [str(REPO / "infra" / "local-cluster.sh"), cmd], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL
    )


def measure(system: str, inp: Path, work: Path, headroom_mb: int, docs: int, mb: float) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    roots: list[int] = []
    cdir = Path("/tmp/rp-scale-cluster")  # short: Ray's socket paths under it must fit AF_UNIX's 107 bytes
    shutil.rmtree(cdir, ignore_errors=True)
    if system == "2node":
        env |= CLUSTER_ENV | {"RAYPAI_CLUSTER_DIR": str(cdir)}
        cluster("up", env)
        roots = [int((cdir / f"{n}.pid").read_text()) for n in ("head", "worker")]
        env |= {
            "RAY_ADDRESS": f"127.0.0.1:{CLUSTER_ENV['RAYPAI_CLUSTER_PORT']}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(cdir / "auth_token"),
            "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{CLUSTER_ENV['RAYPAI_DASHBOARD_PORT']}",
        }
    cpus = 1 if system == "1node-1cpu" else 2
    cmd = [
        sys.executable,
        __file__,
        "--child",
        system,
        "--input",
        str(inp),
        "--work",
        str(work),
        "--cpus",
        str(cpus),
        "--driver-headroom-mb",
        str(headroom_mb),
    ]
    load = os.getloadavg()[0]
    try:
        res, sampler = run_child(cmd, env, roots)
    finally:
        if system == "2node":
            cluster("down", env)
    secs = res.pop("seconds")
    return {
        "bench": "data_scale",
        "system": "datatrove" if system == "datatrove" else "raypai",
        "config": system,
        "docs": docs,
        "mb": round(mb, 1),
        "cpus": cpus,
        "kept": res.pop("kept"),
        "seconds": round(secs, 2),
        "docs_per_s": round(docs / secs, 1),
        "mb_per_s": round(mb / secs, 3),
        "startup_s": round(res.pop("startup_s"), 2),
        **sampler.summary(),
        "load1_before": round(load, 2),
        "load1_after": round(os.getloadavg()[0], 2),
        **res,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--systems", default="1node-1cpu,1node-2cpu,2node,datatrove")
    ap.add_argument("--work", type=Path, default=Path("/tmp/raypai-bench-scale"))
    ap.add_argument("--driver-headroom-mb", type=int, default=64)
    ap.add_argument("--child", choices=["1node-1cpu", "1node-2cpu", "2node", "datatrove"])
    ap.add_argument("--input", type=Path)
    ap.add_argument("--cpus", type=int, default=2)
    a = ap.parse_args()
    if a.child == "datatrove":
        res = run_datatrove(a.input, a.work, True, a.cpus)
        print(json.dumps(res | {"ingest_s": 0.0}), flush=True)
        return
    if a.child:
        print(json.dumps(child_raypai(a.input, a.work, a.cpus, a.driver_headroom_mb, a.child == "2node")), flush=True)
        return
    inp = prepare_synthetic(a.work / "inputs" / f"synthetic-{a.docs // 1000}k", a.docs)
    files = sorted(inp.glob("*.jsonl"))
    docs = sum(sum(1 for _ in open(f)) for f in files)
    mb = sum(f.stat().st_size for f in files) / 1e6
    for system in a.systems.split(","):
        try:
            print(
                json.dumps(measure(system, inp, a.work / "runs" / system, a.driver_headroom_mb, docs, mb)), flush=True
            )
        except (SystemExit, Exception) as e:  # one system failing still leaves the others' figures
            print(
                json.dumps({"bench": "data_scale", "config": system, "error": f"{type(e).__name__}: {e}"}), flush=True
            )


if __name__ == "__main__":
    main()
