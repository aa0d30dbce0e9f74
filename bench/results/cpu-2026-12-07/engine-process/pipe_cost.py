"""What the engine process adds per step at batch 64: encoding each RequestOutput's delta and pickling
the step's message (the child's engine thread), and unpickling it into the mirrors and RequestOutputs
(the server's reader thread). 512-token prompts, one token a step. Usage: pipe_cost.py REPO"""
import pickle, sys, time, timeit
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/work/main")
from engine.outputs import RequestOutput, TextHistory
from engine.entrypoints.server.output_deltas import ChildStream as _ChildStream, Mirror as _Mirror, encode_output as _encode

streams = [_ChildStream(f"cmpl-{i:032x}-0", True) for i in range(64)]
prompts = {s.request_id: list(range(512)) for s in streams}
hist = {s.request_id: TextHistory(prompts[s.request_id], 512, 0, [], 0, []) for s in streams}


def outputs(k):
    outs = []
    for s in streams:
        h = hist[s.request_id]
        h.all_token_ids.append(k)
        h.text_pieces.append(" tok")
        h.token_times.append(time.monotonic())
        h = hist[s.request_id] = h._replace(num_output_tokens=h.num_output_tokens + 1,
                                            num_text_pieces=h.num_text_pieces + 1)
        outs.append((s, RequestOutput(s.request_id, prompts[s.request_id], [k], " tok", False, None, None, history=h)))
    return outs


def message(outs):
    return pickle.dumps(("outputs", [(s.request_id, "output", _encode(s, o)) for s, o in outs]))


message(outputs(0))  # the first carries the prompts
n = 300
made = timeit.timeit(lambda: outputs(1), number=n) / n
sent = timeit.timeit(lambda: message(outputs(1)), number=n) / n
print(f"child: encode + pickle {(sent - made) * 1e6:.0f} us per step of 64 (the outputs themselves {made * 1e6:.0f} us, "
      "made in either mode)")
msg = message(outputs(2))
mirrors = {s.request_id: _Mirror() for s in streams}


def receive():
    for request_id, _, payload in pickle.loads(msg)[1]:
        mirrors[request_id].output(payload)


print(f"server: unpickle + mirror + RequestOutputs {timeit.timeit(receive, number=n) / n * 1e6:.0f} us per step of 64; "
      f"message {len(msg)} bytes")
