import re, subprocess, sys, time, signal
flags = sys.argv[2:]
t = time.perf_counter()
p = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", sys.argv[1], "--device", "cpu", "--port", "0",
                      "--max-model-len", "256", *flags], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
for line in p.stderr:
    if "ready: serving" in line:
        print(flags, f"ready after {time.perf_counter() - t:.2f} s", flush=True); break
p.send_signal(signal.SIGTERM); p.wait(60)
