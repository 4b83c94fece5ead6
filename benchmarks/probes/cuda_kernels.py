"""Which CUDA kernels one run of the MHA block launches, in torch and in each ONNX Runtime flavour.

Run on a GPU machine from the project root:
    python3 benchmarks/probes/cuda_kernels.py --batch 1 --seq 128 [--json FILE]
torch's profiler (CUPTI) sees every kernel of the process, ONNX Runtime's too, so the same
tool lists both: the kernel names show which attention kernel ran (flash, memory-efficient,
unfused) and the count shows what a CUDA graph has to replay.
"""

import argparse
import collections
import json

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from attnexport import dtypes as D
from attnexport import export as E
from attnexport import runtimes as R
from attnexport import seeding as S
from attnexport import variants as V


def kernels(fn, runs=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time
    return sorted(([name[:110], n / runs, us / runs] for name, (n, us) in per.items()), key=lambda r: -r[2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    v = V.get("mha")
    o = v.resolve({"batch": a.batch, "seq": a.seq, "dim": 1024, "heads": 16})
    params = S.init_params(v, o, 0)
    inputs = D.cast_floats(S.make_inputs(v, o, 1), "fp16")
    module = S.load_params(v.build(o), params).to("cuda", torch.float16).eval()
    x = {k: torch.from_numpy(np.ascontiguousarray(t)).cuda() for k, t in inputs.items()}

    def torch_run():
        with torch.no_grad():
            module(*x.values())
    report = {"torch": kernels(torch_run)}
    for flavor in E.FLAVORS:
        model = E.build_model("mha", o, flavor, dtype="fp16", params=params)[0]
        session, placement, shapes = R.ort_session("ort-cuda", model, tf32=True)
        binding = session.io_binding()
        for k, t in x.items():
            binding.bind_input(k, "cuda", 0, np.float16, list(t.shape), t.data_ptr())
        out = torch.empty(x["x"].shape, dtype=torch.float16, device="cuda")
        binding.bind_output(session.get_outputs()[0].name, "cuda", 0, np.float16, list(out.shape), out.data_ptr())
        report[f"ort-cuda {flavor}"] = kernels(lambda session=session, binding=binding:
                                               session.run_with_iobinding(binding))
        report[f"ort-cuda {flavor} nodes"] = {p: len(n) for p, n in placement.items()}
    for name, rows in report.items():
        if name.endswith("nodes"):
            print(f"{name}: {rows}")
            continue
        print(f"\n{name} (batch {a.batch}, seq {a.seq}): {sum(r[1] for r in rows):.0f} kernels, "
              f"{sum(r[2] for r in rows):.1f} us of kernel time per run")
        for kname, n, us in rows:
            print(f"  {n:4.1f} x {us:8.1f} us  {kname}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"batch": a.batch, "seq": a.seq, "device": torch.cuda.get_device_name(0), **report}, f,
                      indent=1)


if __name__ == "__main__":
    main()
