"""CPU time and context switches of a process tree, per process and per thread, from /proc.

    before = snapshot(process_tree(pid)); ...; rows = thread_deltas(before, snapshot(...))

A thread's CPU seconds are its utime + stime (clock ticks of /proc/PID/task/TID/stat); its
context switches are the `voluntary_ctxt_switches` (it blocked: a poll, a lock, a sleep) and
`nonvoluntary_ctxt_switches` (the kernel took its core away: another runnable thread wanted
it) of /proc/PID/task/TID/status. Linux only; threads that start and end between two
snapshots are not seen.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ThreadSample:
    pid: int
    tid: int
    process: str  # what the process is: its command line, shortened
    thread: str  # the thread's name (comm)
    cpu_s: float
    voluntary_switches: int
    involuntary_switches: int


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = _parent_pid(entry)
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [], [root_pid]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier.extend(children.get(pid, []))
    return sorted(tree)


def _parent_pid(process_dir: Path) -> int | None:
    try:
        stat = (process_dir / "stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def snapshot(pids: list[int]) -> dict[tuple[int, int], ThreadSample]:
    """Every thread of `pids` now, keyed by (pid, tid); vanished ones are left out."""
    samples = {}
    for pid in pids:
        process = process_label(pid)
        try:
            tids = [int(name) for name in os.listdir(PROC / str(pid) / "task")]
        except OSError:
            continue
        for tid in tids:
            sample = _thread_sample(pid, tid, process)
            if sample is not None:
                samples[(pid, tid)] = sample
    return samples


def process_label(pid: int) -> str:
    """A short name for the process: `python -m core_engine.worker ...` -> "worker", else its
    program."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [word.decode(errors="replace") for word in argv if word]
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1].removeprefix("core_engine.")
    return Path(words[1] if len(words) > 1 and "python" in words[0] else words[0]).name


def _thread_sample(pid: int, tid: int, process: str) -> ThreadSample | None:
    task = PROC / str(pid) / "task" / str(tid)
    try:
        stat = (task / "stat").read_text()
        status = (task / "status").read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    cpu_s = _stat_cpu_s(stat)
    switches = {
        key: int(value)
        for key, _, value in (line.partition(":") for line in status.splitlines())
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
    }
    return ThreadSample(
        pid, tid, process, name, cpu_s,
        switches.get("voluntary_ctxt_switches", 0), switches.get("nonvoluntary_ctxt_switches", 0),
    )  # fmt: skip


def thread_deltas(
    before: dict[tuple[int, int], ThreadSample], after: dict[tuple[int, int], ThreadSample]
) -> list[ThreadSample]:
    """What each thread did between the snapshots (threads born since count from zero),
    busiest first."""
    deltas = []
    for key, end in after.items():
        start = before.get(key)
        deltas.append(
            ThreadSample(
                end.pid,
                end.tid,
                end.process,
                end.thread,
                end.cpu_s - (start.cpu_s if start else 0.0),
                end.voluntary_switches - (start.voluntary_switches if start else 0),
                end.involuntary_switches - (start.involuntary_switches if start else 0),
            )  # fmt: skip
        )
    return sorted(deltas, key=lambda sample: -sample.cpu_s)


def per_process(deltas: list[ThreadSample]) -> dict[str, dict[str, float]]:
    """CPU seconds and context switches summed per process label."""
    totals: dict[str, dict[str, float]] = {}
    for sample in deltas:
        total = totals.setdefault(
            sample.process, {"cpu_s": 0.0, "voluntary": 0, "involuntary": 0, "threads": 0}
        )
        total["cpu_s"] += sample.cpu_s
        total["voluntary"] += sample.voluntary_switches
        total["involuntary"] += sample.involuntary_switches
        total["threads"] += 1
    return totals


class CpuTimeline:
    """Samples the CPU seconds of every process of a tree every `period_s`, in a thread, so that
    the cores each process used over any window of the run can be read afterwards (a client
    that starts up for seconds before it sends is then not charged to the window that matters).

        with CpuTimeline(os.getpid()) as timeline: ...
        timeline.cores_used(start_s, end_s)  # {process label: cores}, time.monotonic() bounds
    """

    def __init__(self, root_pid: int, period_s: float = 0.5) -> None:
        self._root_pid = root_pid
        self._period_s = period_s
        self._samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-timeline", daemon=True)

    def __enter__(self) -> CpuTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            now = time.monotonic()
            sample = {}
            for pid in process_tree(self._root_pid):
                cpu_s = _process_cpu_s(pid)
                if cpu_s is not None:
                    sample[pid] = (process_label(pid), cpu_s)
            self._samples.append((now, sample))

    def cores_used(self, start_s: float, end_s: float) -> dict[str, float]:
        """Cores each process label used between the samples nearest `start_s` and `end_s`
        (CPU seconds over wall seconds; processes alive at both samples)."""
        first = min(self._samples, key=lambda sample: abs(sample[0] - start_s))
        last = min(self._samples, key=lambda sample: abs(sample[0] - end_s))
        wall_s = last[0] - first[0]
        if wall_s <= 0:
            return {}
        cores: dict[str, float] = {}
        for pid, (label, cpu_s) in last[1].items():
            if pid in first[1]:
                cores[label] = cores.get(label, 0.0) + (cpu_s - first[1][pid][1]) / wall_s
        return dict(sorted(cores.items(), key=lambda item: -item[1]))


def _process_cpu_s(pid: int) -> float | None:
    """utime + stime of every thread of `pid`, live and ended, in seconds."""
    try:
        return _stat_cpu_s((PROC / str(pid) / "stat").read_text())
    except OSError:
        return None


def _stat_cpu_s(stat: str) -> float:
    """utime + stime, in seconds, of a /proc stat line (a process's or a thread's)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
