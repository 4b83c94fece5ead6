"""How much each kind of matrix of a Q4_1 model needs its folded residual rows: for every carried
float-minimum matrix, the error its output would take if the residual rows were dropped (the zero
point nearest -m/d kept, what that leaves of the minimum m lost: r = m + d * zero per block, times
the sum of the block's inputs), relative to the output, as an rms over the positions of the
teacher-forced passage verify uses; beside it, the error the folded form leaves (what its 4-bit
residual rows miss of r). Means and maxima by kind of matrix, over the layers.

    python benchmarks/probes/residual_sensitivity.py SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import collections
from pathlib import Path

import numpy as np
import torch

from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained.causal import accuracy as A


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a GGUF file or save_pretrained folder with Q4_1 matrices")
    parser.add_argument("--block", type=int, default=32)
    a = parser.parse_args()
    model = hf.load(a.source)[0]
    ids = A.text_ids(hf.tokenizer_of(a.source), A.EVAL_TEXT, model.config.vocab_size, 0)
    inputs: dict = {}

    def keep(name):
        def hook(_module, args, _out):
            inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1]).double().numpy()
        return hook
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, m in linears.items():
        m.register_forward_hook(keep(name))
    with torch.no_grad():
        model(torch.tensor(ids))
    by_kind: dict = collections.defaultdict(list)
    folded: dict = collections.defaultdict(list)
    for name, m in linears.items():
        w = m.weight.detach().numpy().T.astype(np.float32)  # (K, N), as the export's MatMul holds it
        grid = P.grid_of(w, 4, a.block)
        if grid is None or grid.minimum is None:
            continue
        # The folded form's zero points, and what its residual rows miss of what those leave of
        # each minimum (the residual, K/block x N).
        zero, _codes, _scales, _zeros, missed = P.fold_grid(grid)
        residual = grid.minimum.astype(np.float64) + grid.scale.astype(np.float64) * zero
        x = inputs[name]
        sums = x.reshape(len(x), -1, a.block).sum(-1)
        out = x @ w.astype(np.float64)
        kind = name.rsplit(".", 1)[-1]
        for errors, lost in ((by_kind, sums @ residual), (folded, sums @ missed)):
            errors[kind].append(float(np.sqrt((lost ** 2).mean() / (out ** 2).mean())))
    print(f"{ids.shape[1]} tokens; the output error relative to the output (rms), mean and max over the layers:")
    print(f"  {'matrix':12s} {'dropped':>11s} {'max':>11s}  {'folded':>11s} {'max':>11s}")
    for kind, errors in by_kind.items():
        print(f"  {kind:12s} {np.mean(errors):11.4f} {np.max(errors):11.4f}  {np.mean(folded[kind]):11.5f} "
              f"{np.max(folded[kind]):11.5f}   ({len(errors)} matrices)")


if __name__ == "__main__":
    main()
