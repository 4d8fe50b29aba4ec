import sys, time, torch
from ddtree.engine.demo import demo_paths
from ddtree.engine.reference.engine import Engine, GenParams, SpecParams
torch.set_num_threads(int(sys.argv[1]))
t, d = demo_paths()
eng = Engine.load(t, d, device="cpu", backend=sys.argv[2] if len(sys.argv) > 2 else "auto")
p = eng.tokenizer.encode("Write a Python function that parses a CSV file and returns the rows as dicts.", add_special_tokens=False)
gen = GenParams(max_new_tokens=48, ignore_eos=True)
for spec in [SpecParams("ar"), SpecParams("dflash"), SpecParams("ddtree", 16)]:
    eng.generate(p, gen, spec)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); r = eng.generate(p, gen, spec); ts.append(time.perf_counter() - t0)
    print(sys.argv[1:], spec.algorithm, spec.budget, f"{48/min(ts):.1f} tok/s best, {48/sorted(ts)[1]:.1f} median", flush=True)
