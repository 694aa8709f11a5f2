"""A program recorded by tests/test_record.py: spawn children, a fork child and a subprocess.

It knows nothing of pdtrace except that, when a recorder is active in a process, it marks
what it does through the public recorder API (so the test can check which process wrote
what). Usage: mp_app.py [--sleep S] [--exit N] [--kill-child] [--burst N] [--atexit-mark]
"""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time


def mark(label, **kw):
    try:
        from pdtrace.record import recorder
    except ImportError:
        return
    rec = recorder.get()
    if rec is not None:
        rec.emit("mark", label=label, detail=str(kw))


def child(i):
    try:
        from pdtrace.record import recorder

        rec = recorder.get()
        if rec is not None:  # what a vLLM hook does when it sees a worker being built
            rec.set_role("worker", rank=i, why="test program")
    except ImportError:
        pass
    mark("child", i=i)
    return i * i


def doomed(q):
    mark("doomed-before-kill")
    try:  # wait until the writer thread has flushed the mark (one flush interval, longer under load)
        from pdtrace.record import recorder

        rec = recorder.get()
        deadline = time.time() + 30
        while rec is not None and time.time() < deadline:
            with open(rec.shard_path, "rb") as fh:
                if b"doomed-before-kill" in fh.read():
                    break
            time.sleep(0.05)
    except ImportError:
        pass
    q.put(os.getpid())
    time.sleep(60)


def burst(n):
    """Emit n marks and return at once, as vLLM's engine core and workers end: a multiprocessing
    child leaves through Process._bootstrap and os._exit(), where atexit never runs."""
    for i in range(n):
        mark("burst", i=i)


def main():
    args = sys.argv[1:]
    mark("main-start")
    if "--atexit-mark" in args:  # the program's own exit handler still records
        import atexit

        atexit.register(mark, "at-exit")
    if "--burst" in args:
        n = int(args[args.index("--burst") + 1])
        for method in ("fork", "spawn"):
            p = mp.get_context(method).Process(target=burst, args=(n,))
            p.start()
            p.join()
        mark("burst-done")
    ctx = mp.get_context("spawn")
    # close()+join(): workers exit normally (atexit flushes their shards). A `with Pool()` block
    # would terminate() them with SIGTERM right after map() returns; that path is covered by
    # test_sigterm_mid_run_still_gives_a_valid_trace for the main process.
    pool = ctx.Pool(2)
    squares = pool.map(child, [1, 2, 3])
    pool.close()
    pool.join()
    mark("squares", value=squares)
    if "--kill-child" in args:
        q = ctx.Queue()
        p = ctx.Process(target=doomed, args=(q,))
        p.start()
        pid = q.get(timeout=60)
        os.kill(pid, signal.SIGKILL)
        p.join()
    out = subprocess.run([sys.executable, "-c",
                          "from pdtrace.record import recorder; r = recorder.get(); "
                          "r and r.emit('mark', label='subprocess'); print('sub-ok')"],
                         capture_output=True, text=True, check=True).stdout.strip()
    mark("subprocess-output", value=out)
    if "--sleep" in args:
        mark("sleeping")
        time.sleep(float(args[args.index("--sleep") + 1]))
    print("result", squares, out, flush=True)
    code = int(args[args.index("--exit") + 1]) if "--exit" in args else 0
    sys.exit(code)


if __name__ == "__main__":
    main()
