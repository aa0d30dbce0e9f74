"""The front end's process (engine.core.text_process): `python -m engine.core.text_worker R W` reads
records from file descriptor R and writes one reply per record to W, until the engine sends None or
closes its end. Its own module so that the engine, which imports text_process, never imports this one
(runpy would run a second copy of an imported module)."""
from __future__ import annotations

import functools
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from engine.core.detokenizer import TextState, advance_all


def serve(recv: Connection, send: Connection) -> None:
    import tokenizers
    path = recv.recv()  # the engine's tokenizer, as a file of its own (TextProcess.attach)
    if path is None:  # the engine ended (or chose inline) before it had one
        return
    backend = tokenizers.Tokenizer.from_file(path)
    os.unlink(path)
    decode = functools.partial(backend.decode_batch, skip_special_tokens=True)  # BatchDecoder's fast path
    states: dict[int, TextState] = {}
    while (record := recv.recv()) is not None:
        news, updates = record
        for key, context, stops, include_stop, min_tokens in news:
            states[key] = TextState(decode, context, stops, include_stop, min_tokens)
        # a key without a state ended here (a stop string) before the engine read that reply: the
        # tokens it sampled meanwhile are not part of the text
        updates = [u for u in updates if u[0] in states]
        batch = [(states[key], new, num_out, end) for key, new, num_out, end in updates]
        reply = []
        for (key, *_), (state, *_), result in zip(updates, batch, advance_all(batch) if batch else ()):
            if result is None:
                continue
            piece, matched = result
            if piece or state.done:
                reply.append((key, piece, state.done, state.stopped_at if matched else None))
            if state.done:
                del states[key]
        send.send(reply)


def main(argv: list[str]) -> int:
    # Ctrl-C and an orchestrator's SIGTERM reach the whole process group: the engine decides when this
    # process ends (its None, or its end of the pipe closing), so a drain still has its text.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    recv = Connection(int(argv[0]), writable=False)
    send = Connection(int(argv[1]), readable=False)
    try:
        serve(recv, send)
    except EOFError:  # the engine's side closed: nothing is owed to anyone
        return 0
    except BaseException:
        try:
            send.send(("error", traceback.format_exc()))
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
