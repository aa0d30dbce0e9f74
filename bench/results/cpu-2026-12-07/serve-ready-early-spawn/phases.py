"""Where `serve`'s start-up goes, in the server's process: seconds from its start to the spawn of the engine
process, to the child's ready message, and to the `ready: serving` line (then it stops itself). The child's
own log lines come through with its own clock, from its start. Usage, from the repository root:
PYTHONPATH=. python phases.py MODEL_DIR [serve flags]"""
import logging, multiprocessing.connection, multiprocessing.context, os, signal, sys, threading, time

T0 = time.perf_counter()


def mark(what):
    print(f"[{time.perf_counter() - T0:6.2f}] {what}", file=sys.__stderr__, flush=True)


_popen = multiprocessing.context.SpawnProcess._Popen
multiprocessing.context.SpawnProcess._Popen = staticmethod(lambda p: (mark("spawn"), _popen(p))[1])
_recv = multiprocessing.connection.Connection.recv


def recv(self):
    message = _recv(self)
    if isinstance(message, tuple) and message and message[0] in ("ready", "failed"):
        mark(f"the child's {message[0]} message received")
    return message


multiprocessing.connection.Connection.recv = recv


class Marks(logging.Handler):
    def emit(self, record):
        mark(record.getMessage()[:90])
        if "ready: serving" in record.getMessage():
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()


_basic_config = logging.basicConfig
logging.basicConfig = lambda **kw: (_basic_config(**kw), logging.getLogger().addHandler(Marks()))

if __name__ == "__main__":  # the spawned child imports this module too
    mark("importing the CLI")
    from engine.entrypoints.cli import main
    mark("imported")
    sys.exit(main(["serve", "--model", sys.argv[1], "--device", "cpu", "--port", "0", "--max-model-len", "256",
                   *sys.argv[2:]]))
