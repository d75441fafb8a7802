"""CPU time a served token costs, thread by thread: a server (ours or llama-server) is driven
with MT-Bench 81-88 as 2-turn chats, 64 tokens each (ignore_eos), one request at a time,
streamed, and every thread's time on a core (`/proc/PID/task/TID/schedstat`, nanoseconds) is
read before and after. Time per token says what each thread spends for it, the event loop's
work and the engine's included, which a throughput figure shows only through the noise of the
machine's speed.

    python benchmarks/studies/plain-path/thread_cpu.py PORT PID [PASSES]

(The record counted the events that hold a `content` field; `drive` now counts every event.)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from drive_chat import drive  # this script's folder is on the path when it runs


def thread_times(pid: int) -> dict[str, int]:
    """Nanoseconds on a core by thread, keyed "name/tid"."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except OSError:  # the thread ended
            continue
        times[f"{name}/{task.name}"] = ns
    return times


def main() -> None:
    port, pid = sys.argv[1], int(sys.argv[2])
    passes = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    drive(port, 1)  # warm-up
    before, start = thread_times(pid), time.perf_counter()
    chunks, requests = drive(port, passes)
    wall, after = time.perf_counter() - start, thread_times(pid)
    tokens = requests * 64
    spent = {key: (ns - before.get(key, 0)) / 1e6 for key, ns in after.items()}
    total = sum(spent.values())
    print(f"port {port}: {requests} requests, {tokens} tokens ({chunks} chunks) in {wall:.1f} s")
    print(f"wall {1e3 * wall / tokens:.2f} ms a token; CPU {total / tokens:.3f} ms a token")
    for key, ms in sorted(spent.items(), key=lambda item: -item[1]):
        if ms > 1:  # by thread, the busiest first (llama.cpp's workers, the engine, the loop)
            print(f"  {key:24s} {ms / tokens:.3f} ms a token")


if __name__ == "__main__":
    main()
