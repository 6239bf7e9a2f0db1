"""Check a parallel layout against one process: `python -m meshtron.verify <train.py overrides>`.

    python -m meshtron.verify +model=gpt_1b parallel.tp=4 parallel.pp=2 [--steps 2] [--tol 1e-5]

Shrinks the model keeping its structure, runs the layout in gloo processes beside one serial
process and compares activations, gradients and weights step by step; exit status 0 PASS,
1 FAIL, 2 bad configuration. The logic lives in `meshtron.training.verify`.
"""

from meshtron.training.verify import main

if __name__ == "__main__":
    main()
