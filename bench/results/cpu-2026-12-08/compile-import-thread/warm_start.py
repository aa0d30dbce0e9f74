import time, sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path.insert(0, sys.argv[1])
t0 = time.perf_counter()
import torch
from engine import LLM
t1 = time.perf_counter()
llm = LLM("default", compile=True, max_num_seqs=4, max_model_len=512, show_progress=False)
t2 = time.perf_counter()
st = llm.stats()["startup"]
ph = {}
for p in st["phases"]:
    ph[p["name"]] = ph.get(p["name"], 0) + p["seconds"]
print(f"imports {t1-t0:.2f} LLM {t2-t1:.2f} | " + " ".join(f"{k}={v:.2f}" for k, v in ph.items()), st.get("compile_cache"), st.get("compile_imports_wait_s"))
llm.close()
