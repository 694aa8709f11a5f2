"""A test program for `pdtrace record --ring`: emits a numbered mark every few milliseconds for
a given time (argv[1] seconds), in this process and in one multiprocessing child. Marks go
through the public recorder API when a recorder is active; it knows nothing else of pdtrace.
With argv[2] == "signal-parent", it sends SIGUSR1 to its parent (pdtrace record) half-way,
asking for a snapshot. With argv[2] == "racy-read", the main process records, half-way, one
accepted-count read whose copy had not completed and that did not synchronize (the
acc.read event of vLLM thread 004's race, through the public recorder API): the flight
recorder's online check should ask for a snapshot by itself."""

import multiprocessing as mp
import os
import signal
import sys
import time


def run(seconds: float, who: str, signal_parent: bool = False, racy_read: bool = False) -> None:
    from pdtrace.record import recorder

    rec = recorder.get()
    end = time.monotonic() + seconds
    half = time.monotonic() + seconds / 2
    i = 0
    while time.monotonic() < end:
        if rec is not None:
            rec.emit("mark", label=who, detail=str(i))
        i += 1
        if signal_parent and time.monotonic() >= half:
            os.kill(os.getppid(), signal.SIGUSR1)
            signal_parent = False
        if racy_read and time.monotonic() >= half and rec is not None:
            rec.emit("acc.read", req="req-racy", step=7, row=1, value=3, event="e7", event_done=False, synced=False)
            racy_read = False
        time.sleep(0.002)
    print(f"{who} {i}")


if __name__ == "__main__":
    secs = float(sys.argv[1])
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=run, args=(secs, "child"))
    child.start()
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    run(secs, "main", signal_parent=mode == "signal-parent", racy_read=mode == "racy-read")
    child.join()
