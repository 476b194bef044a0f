"""Greedy text on the CPU and on the GPU (f16 cache), each running free, for a fixed list of
prompts (three open-ended, three with one likely continuation): how many tokens are equal
before the first difference, and the CPU's top-two logit gap at that step.

    python tools/greedy_devices.py MODEL.gguf      # needs a CUDA build of libinnerq (INNERQ_LIB)
"""
import sys
import numpy as np
from innerq import Llama
M = sys.argv[1]
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4, 5, 6, 7, 8,", "Monday, Tuesday, Wednesday,", "A, B, C, D, E, F,"]
N = 40
for p in prompts:
    toks, gaps = {}, {}
    for ngl in (0, -1):
        with Llama(M, n_ctx=512, n_gpu_layers=ngl, kv_type="f16", n_threads=8) as llm:
            llm.eval(llm.tokenize(p))
            out, gp = [], []
            for _ in range(N):
                lg = np.array(llm.logits)
                s = np.sort(lg)
                gp.append(float(s[-1] - s[-2]))
                t = int(np.argmax(lg))
                out.append(t)
                llm.eval([t])
            toks[ngl], gaps[ngl] = out, gp
            if ngl == 0:
                text = llm.detokenize(out).decode("utf-8", "replace")
    c, g = toks[0], toks[-1]
    same = next((i for i in range(N) if c[i] != g[i]), N)
    gap = gaps[0][same] if same < N else float("nan")
    print(f"{p!r}: equal for {same}/{N} tokens; CPU top-two gap at the first difference {gap:.3f}; min CPU gap before it "
          f"{min(gaps[0][:same]) if same else float('nan'):.3f}; CPU text {text[:60]!r}")
