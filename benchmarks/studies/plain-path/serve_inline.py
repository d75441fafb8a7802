"""`specdecode serve` with the engine stepped on the event loop's own thread: no engine thread,
so no hand-off of the interpreter lock at each token (the round's updates go straight into the
rows' queues, and the chunks are written between rounds). A measurement, not a server: the
event loop waits out every round, so requests arriving meanwhile wait a round to be read, and
stopping leaves the round task to the loop's end. For server_ab.txt's last A/B:

    python benchmarks/studies/plain-path/serve_inline.py serve --port 8186 --max-batch 8 \
        --context 2048 --threads 2 --no-draft
"""

import asyncio
import sys
import threading

from specdecode.serve import scheduler as sch

S = sch.Scheduler


def start(self):
    self._aloop = asyncio.get_running_loop()
    self._wake = asyncio.Event()
    self._inline_started = True
    self._task = self._aloop.create_task(self._inline())


def started(self):
    return getattr(self, "_inline_started", False)


async def _inline(self):
    # a load that fails ends this task with its traceback: a measurement needs no more
    self._decoder = decoder = await asyncio.to_thread(self._load)
    loop = decoder.loop(
        max_rows=self.max_rows, prefill_chunk=self.prefill_chunk, **self.loop_options
    )
    self.state = "ready"
    self.loaded.set()
    while not self._stopping:
        if not (self._cancels or self._waiting or len(loop)):
            self._store(decoder)
            self._wake.clear()
            await self._wake.wait()
            continue
        try:
            self._admit(loop)
            if len(loop):
                self._round(loop)
        except Exception as error:
            self._fail_running(loop, error)
        await asyncio.sleep(0)


orig_submit, orig_cancel, orig_stop = S.submit, S.cancel, S.stop


def submit(self, job):
    orig_submit(self, job)
    self._aloop.call_soon_threadsafe(self._wake.set)


def cancel(self, job):
    orig_cancel(self, job)
    self._aloop.call_soon_threadsafe(self._wake.set)


def stop(self, timeout=10.0):
    self._stopping = True


for name, function in [
    ("start", start),
    ("started", started),
    ("_inline", _inline),
    ("submit", submit),
    ("cancel", cancel),
    ("stop", stop),
]:
    setattr(S, name, function)
main_thread = threading.main_thread()


def deliver(self, item):
    if threading.current_thread() is main_thread:
        self.queue.put_nowait(item)
    else:
        self.aloop.call_soon_threadsafe(self.queue.put_nowait, item)


sch.RowStream._deliver = deliver

from specdecode.cli.main import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
