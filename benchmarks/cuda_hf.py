"""Whole language models on ONNX Runtime's CUDA provider: each export's decode step timed at several
contexts (device memory bound through IO binding; the static form also captured once in a CUDA graph
and replayed per token), beside transformers eager on the same GPU and onnxruntime-genai's CUDA
export of the same weights, with every engine's accuracy measured the way `verify` measures it
(`attnexport.pretrained.accuracy`: teacher-forced KL and top-1 on real text, perplexity on a held-out text,
greedy tokens against transformers') on the very path that was timed: a static export's accuracy
runs through its replayed CUDA graph.

    python benchmarks/cuda_hf.py random FOLDER            # the seeded random Llama (same weights anywhere)
    python benchmarks/cuda_hf.py run --source SRC --onnx static-fp16=PATH --genai genai-fp16=DIR \
        --contexts 128,1024,4096,8192 --json OUT

`--provider cpu` runs the same on ONNX Runtime's CPU provider (no CUDA graph): how the script is
checked on a machine without a GPU. TF32 stays off (fp32 parity); timings say so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnexport.bench import stats_of  # noqa: E402
from attnexport.pretrained import cost as COST  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained import reference as HR  # noqa: E402
from attnexport.pretrained.causal import accuracy as A  # noqa: E402
from attnexport.pretrained.causal import generation as G  # noqa: E402
from attnexport.pretrained.causal.bench import cache_bytes, file_weight_bytes  # noqa: E402

NEW_TOKENS = 48
# The random model: a Llama of SmolLM2's head size and grouping, small enough that onnxruntime-genai's
# CUDA builds of it travel to the GPU machine; its weights are drawn with numpy's generator from a
# seed, so this machine and the GPU machine make the same ones (the digest says so).
RANDOM = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=4096, max_position_embeddings=16384, tie_word_embeddings=False,
              rms_norm_eps=1e-5, rope_theta=10000.0)


def make_random(folder: Path, word_tokenizer: bool) -> str:
    """Writes the seeded random Llama (config, safetensors; a word tokenizer, which onnxruntime-genai's
    builder wants, when asked: the measurements feed seeded ids) to `folder`; its digest."""
    import torch
    import transformers

    from attnexport.pretrained.causal.bench import word_tokenizer
    config = transformers.LlamaConfig(**RANDOM)
    model = transformers.LlamaForCausalLM(config)
    rng = np.random.default_rng(1234)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * rng.standard_normal(p.shape)
            else:
                values = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
            p.copy_(torch.from_numpy(values.astype(np.float16).astype(np.float32)))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if word_tokenizer:
        word_tokenizer(folder, RANDOM["vocab_size"])
    return digest(model)


def digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()[:16]


# --- ONNX Runtime on the device ------------------------------------------------------------------

class Device:
    def __init__(self, provider: str):
        import onnxruntime as ort
        self.ort, self.provider = ort, provider
        self.where = "cuda" if provider == "cuda" else "cpu"

    def session(self, path: Path, graph: bool = False):
        ort = self.ort
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        if self.provider == "cuda":
            options = {"device_id": "0", "use_tf32": "0"}
            if graph:
                options["enable_cuda_graph"] = "1"
            providers = [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        s = ort.InferenceSession(str(path), so, providers=providers)
        placement = {}
        for sub in s.get_provider_graph_assignment_info():
            placement.setdefault(sub.ep_name, []).extend(f"{n.op_type}:{n.name}" for n in sub.get_nodes())
        return s, placement

    def value(self, array: np.ndarray):
        return self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.where, 0)

    def empty(self, shape, dtype):
        return self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.where, 0)


def _np_type(t: str):
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
            "tensor(int32)": np.int32}[t]


class Buffered:
    """A step graph whose cache lives in device buffers written in place (attnexport's static form,
    onnxruntime-genai's shared buffer): `run(feed)` in `G.stepped_logits`/`G.generate`'s terms,
    the cache never leaving the device (the feed's cache entries are ignored, the returned ones
    are placeholders); one-token steps replay a CUDA graph when `graph`."""

    def __init__(self, dev: Device, path: Path, layout: hf.Layout, positions: int, graph: bool, genai: bool):
        self.dev, self.genai, self.positions = dev, genai, positions
        self.layout = layout
        self.plain, self.placement = dev.session(path)
        self.replayed, self.refused = None, None
        if graph:  # ONNX Runtime refuses a capture when a compute node runs on the CPU: said, not fatal
            try:
                self.replayed = dev.session(path, graph=True)[0]
            except Exception as e:  # noqa: BLE001
                self.refused = str(e).splitlines()[0][:300]
        self.inputs = {i.name: i for i in self.plain.get_inputs()}
        self.cache = [n for n in self.inputs if n.startswith("past_key_values.")]
        self.presents = {n: n.replace("past_key_values.", "present.") for n in self.cache}
        self.states: dict = {}
        self.graphs = 0  # CUDA graphs captured so far: each binding of the replayed session is its own

    def state(self, batch: int):
        if batch not in self.states:
            buffers = {}
            for n in self.cache:
                shape = (batch, self.layout.kv_heads, self.positions, self.layout.head_dim)
                buffers[n] = self.dev.value(np.zeros(shape, _np_type(self.inputs[n].type)))
            self.states[batch] = {"buffers": buffers, "bindings": {}}
        return self.states[batch]

    def binding(self, batch: int, key, session, feed: dict):
        """A binding of `feed`'s shapes (device values updated in place on later calls)."""
        st = self.state(batch)
        if key not in st["bindings"]:
            b = session.io_binding()
            values = {n: self.dev.value(a) for n, a in feed.items()}
            for n, v in values.items():
                b.bind_ortvalue_input(n, v)
            for n, v in st["buffers"].items():
                b.bind_ortvalue_input(n, v)
                b.bind_ortvalue_output(self.presents[n], v)
            logits_type = _np_type(next(o.type for o in session.get_outputs() if o.name == "logits"))
            ids = feed["input_ids"]
            logits = self.dev.empty((ids.shape[0], ids.shape[1], self.vocab(session)), logits_type)
            b.bind_ortvalue_output("logits", logits)
            options = self.dev.ort.RunOptions()
            if session is self.replayed:
                self.graphs += 1
                options.add_run_config_entry("gpu_graph_id", str(self.graphs))
            st["bindings"][key] = (b, values, logits, options)
        return st["bindings"][key]

    def vocab(self, session):
        return [o for o in session.get_outputs() if o.name == "logits"][0].shape[-1]

    def feed_of(self, feed: dict) -> dict:
        out = {}
        for n in self.inputs:
            if n in self.cache:
                continue
            if n == "attention_mask" and "attention_mask" not in feed:
                raise ValueError("a shared-buffer step needs the mask")
            out[n] = np.asarray(feed[n]).astype(_np_type(self.inputs[n].type))
        return out

    def call(self, feed: dict, replay: bool):
        """One step; returns the logits' device value."""
        values = self.feed_of(feed)
        batch, length = values["input_ids"].shape
        mask_len = values["attention_mask"].shape[1] if "attention_mask" in values else 0
        use = self.replayed if (replay and self.replayed is not None and length == 1) else self.plain
        # A replayed graph keeps its shapes: static steps share one (write_pos is a value); a shared-buffer
        # step's mask grows, so each mask length is its own graph.
        key = (use is self.replayed, length, mask_len if (self.genai or use is not self.replayed) else 0)
        b, dev_values, logits, options = self.binding(batch, key, use, values)
        for n, a in values.items():
            dev_values[n].update_inplace(np.ascontiguousarray(a))
        use.run_with_iobinding(b, options)
        return logits

    def run(self, feed: dict) -> dict:
        logits = self.call(feed, replay=True).numpy()
        return {"logits": logits, **{p: None for p in self.presents.values()}}


# --- timing ----------------------------------------------------------------------------------------

def timed(fn, warmup: int, iters: int, sync=lambda: None):
    for _ in range(warmup):
        fn()
    sync()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
    return stats_of(ms)


def hbm_bandwidth() -> float | None:
    """The GPU's read bandwidth in bytes/s: the fastest of several sums of a 2 GiB buffer."""
    import torch
    if not torch.cuda.is_available():
        return None
    x = torch.ones(512 << 20, device="cuda")
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del x
    return (512 << 20) * 4 / best


def fill_buffers(engine: Buffered):
    """The batch-1 buffers filled with random values at every position (a step at context c reads
    the first c of them)."""
    st = engine.state(1)
    rng = np.random.default_rng(0)
    for n, v in st["buffers"].items():
        shape = v.shape()
        dtype = _np_type(engine.inputs[n].type)
        v.update_inplace((rng.standard_normal(shape) * 0.5).astype(dtype))


def step_feed(engine: Buffered, context: int) -> dict:
    feed = {"input_ids": np.array([[5]], np.int64), "write_pos": np.array([context], np.int64),
            "attention_mask": np.ones((1, context + 1), np.int64), "position_ids": np.array([[context]], np.int64)}
    return {n: feed[n] for n in engine.inputs if n not in engine.cache}


def time_buffered(engine: Buffered, contexts, warmup, iters, replay: bool) -> dict:
    out = {}
    fill_buffers(engine)
    for c in contexts:
        feed = step_feed(engine, c)
        try:
            out[c] = timed(lambda feed=feed: engine.call(feed, replay), warmup, iters)
        except Exception as e:  # noqa: BLE001 - the runtime's reason, in the results
            out[c] = f"failed: {str(e).splitlines()[0][:300]}"
    return out


def time_concat(dev: Device, path: Path, layout: hf.Layout, contexts, warmup, iters) -> dict:
    session, _ = dev.session(path)
    types = {i.name: _np_type(i.type) for i in session.get_inputs()}
    out = {}
    rng = np.random.default_rng(0)
    for c in contexts:
        b = session.io_binding()
        feed = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, c + 1), np.int64),
                "position_ids": np.array([[c]], np.int64)}
        for n in layout.cache_names("past_key_values"):
            feed[n] = (rng.standard_normal((1, layout.kv_heads, c, layout.head_dim)) * 0.5).astype(types[n])
        keep = {n: dev.value(a.astype(types[n])) for n, a in feed.items() if n in types}
        for n, v in keep.items():
            b.bind_ortvalue_input(n, v)
        for o in session.get_outputs():
            b.bind_output(o.name, dev.where)
        try:
            out[c] = timed(lambda b=b: session.run_with_iobinding(b), warmup, iters)
        except Exception as e:  # noqa: BLE001
            out[c] = f"failed: {str(e).splitlines()[0][:300]}"
    return out


def time_torch(model, layout: hf.Layout, contexts, warmup, iters, dtype) -> dict:
    """transformers eager on the GPU, one token after a DynamicCache of `context` random positions
    (cropped back after each step)."""
    import torch
    from transformers import DynamicCache
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = model.to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for c in contexts:
        cache = DynamicCache()
        for i in range(layout.layers):
            k = torch.randn(1, layout.kv_heads, c, layout.head_dim, device=device, dtype=dtype) * 0.5
            cache.update(k, k.clone(), i)
        token, position = torch.tensor([[5]], device=device), torch.tensor([[c]], device=device)
        mask = torch.ones((1, c + 1), dtype=torch.int64, device=device)

        def step(cache=cache, token=token, position=position, mask=mask, c=c):
            with torch.no_grad():
                m(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True)
            cache.crop(c)
        out[c] = timed(step, warmup, iters, sync)
    model.to(device="cpu", dtype=torch.float32)
    return out


# --- accuracy ------------------------------------------------------------------------------------

def torch_cost(model, base: A.Baseline, dtype) -> dict:
    """transformers' own model on the GPU in `dtype`: teacher-forced KL and top-1, and its greedy
    tokens (its generate, one prompt at a time) against the float32 model's on the CPU."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = model.to(device=device, dtype=dtype)
    with torch.no_grad():
        got = m(input_ids=torch.from_numpy(base.eval_ids).to(device), use_cache=False).logits[0].double().cpu().numpy()
        held = m(input_ids=torch.from_numpy(base.held_ids).to(device), use_cache=False).logits[0].double().cpu().numpy()
        firsts = []
        for prompt, want in zip(base.prompts, base.tokens, strict=True):
            ids = torch.from_numpy(np.asarray(prompt)[None, :]).to(device)
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(want), do_sample=False,
                             min_new_tokens=len(want), pad_token_id=0)
            tokens = out[0, ids.shape[1]:].cpu().numpy()
            differ = np.flatnonzero(tokens != want)
            firsts.append(int(differ[0]) if differ.size else None)
    model.to(device="cpu", dtype=torch.float32)
    kl = COST.kl_per_position(base.eval32, got)
    return {"kl_mean": float(kl.mean()), "top1": float((base.eval32.argmax(-1) == got.argmax(-1)).mean()),
            "perplexity": A.perplexity(held, base.held_ids[0]),
            "perplexity_fp32": A.perplexity(base.held32, base.held_ids[0]), "first_difference": firsts}


# --- the run -------------------------------------------------------------------------------------

def run(args) -> dict:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = Device(args.provider)
    contexts = [int(c) for c in args.contexts.split(",")]
    model, params_from = hf.load(args.source)
    tokenizer = hf.tokenizer_of(args.source)
    result = {"source": str(args.source), "params_from": params_from, "digest": digest(model),
              "provider": args.provider, "contexts": contexts, "iters": args.iters, "warmup": args.warmup,
              "tf32": False, "host": platform.node(), "engines": []}
    try:
        import onnxruntime as ort
        result["onnxruntime"] = ort.__version__
        result["torch"] = torch.__version__
        if torch.cuda.is_available():
            result["device"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    bandwidth = hbm_bandwidth()
    result["read_bandwidth_gbs"] = bandwidth / 1e9 if bandwidth else None
    budget = A.Budget()
    bases: dict = {}

    def base_for(layout: hf.Layout) -> A.Baseline:
        key = layout.form
        if key not in bases:
            t0 = time.time()
            reference = HR.Reference(model, layout, "fp32")
            prompts = G.prompts(tokenizer, layout, (5, 9, 2), seed=4)
            bases[key] = A.baseline(reference, tokenizer, prompts, NEW_TOKENS)
            print(f"baseline ({key}): {time.time() - t0:.1f} s", flush=True)
        return bases[key]

    def emit(entry):
        result["engines"].append(entry)
        brief = {k: v for k, v in entry.items() if k not in ("cpu_nodes", "step_bytes")}
        brief["cpu_nodes"] = len(entry.get("cpu_nodes", []))
        print(json.dumps(brief)[:2000], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    def attnexport_engine(spec):
        label, path = spec.split("=", 1)
        path = Path(path)
        t0 = time.time()
        onnx_model = onnx.load(str(path), load_external_data=False)
        layout = hf.Layout.of(onnx_model)
        dtype = np.float16 if any(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
                                  for i in onnx_model.graph.input) else np.float32
        del onnx_model
        weights = file_weight_bytes(path)
        entry = {"engine": "attnexport", "label": label, "form": layout.form, "file_mib": path.stat().st_size / 2**20,
                 "weight_bytes": weights}
        itemsize = np.dtype(dtype).itemsize
        if layout.form == "static":
            engine = Buffered(dev, path, layout, layout.max_seq, graph=args.provider == "cuda", genai=False)
            entry["cpu_nodes"] = [n for n in engine.placement.get("CPUExecutionProvider", [])][:40]
            entry["times"] = {"io-binding": time_buffered(engine, contexts, args.warmup, args.iters, replay=False)}
            if engine.refused:
                entry["times"]["cuda-graph"] = {c: f"refused: {engine.refused}" for c in contexts}
            if engine.replayed is not None:
                entry["times"]["cuda-graph"] = time_buffered(engine, contexts, args.warmup, args.iters, replay=True)
                if all(isinstance(v, str) for v in entry["times"]["cuda-graph"].values()):
                    engine.replayed = None  # no capture: the accuracy of the plain runs
                    entry["accuracy_path"] = "plain runs (the CUDA graph failed)"
            base = base_for(layout)
            cost = A.measure(engine.run, layout, base, budget, dtype).to_dict()
            entry["accuracy"] = cost
            # Replay parity: the teacher-forced logits through the replayed graph and through plain runs.
            replay = G.stepped_logits(engine.run, layout, base.eval_ids, A.PREFILL, 1, dtype)
            plain = G.stepped_logits(lambda f: {"logits": engine.call(f, replay=False).numpy(),
                                                 **{p: None for p in engine.presents.values()}},
                                      layout, base.eval_ids, A.PREFILL, 1, dtype)
            entry["replay_vs_plain_max_abs"] = float(np.abs(replay - plain).max())
        else:
            from attnexport import runtimes as R
            entry["times"] = {"io-binding": time_concat(dev, path, layout, contexts, args.warmup, args.iters)}
            prepared = R.prepare_onnx("ort-cuda" if args.provider == "cuda" else "ort-cpu", onnx.load(str(path)))
            entry["accuracy"] = A.measure(prepared.run, layout, base_for(layout), budget, dtype).to_dict()
        entry["step_bytes"] = {c: weights + cache_bytes(layout, c, itemsize) for c in contexts}
        entry["seconds"] = time.time() - t0
        emit(entry)

    def genai_engine(spec):
        label, folder = spec.split("=", 1)
        folder = Path(folder)
        t0 = time.time()
        config = json.loads((folder / "genai_config.json").read_text())
        decoder = config["model"]["decoder"]
        path = folder / decoder["filename"]
        layout = hf.Layout("concat", decoder["num_hidden_layers"], decoder["num_key_value_heads"],
                           decoder["head_size"], config["model"]["vocab_size"])
        positions = max(max(contexts) + 1, 2 * A.TOKENS)
        engine = Buffered(dev, path, layout, positions, graph=args.provider == "cuda", genai=True)
        dtype = _np_type(engine.inputs[engine.cache[0]].type)
        weights = file_weight_bytes(path)
        entry = {"engine": "onnxruntime-genai", "label": label, "form": "shared buffer",
                 "file_mib": sum(f.stat().st_size for f in folder.glob(decoder["filename"] + "*")) / 2**20,
                 "weight_bytes": weights,
                 "cpu_nodes": engine.placement.get("CPUExecutionProvider", [])[:40],
                 "times": {"io-binding": time_buffered(engine, contexts, args.warmup, args.iters, replay=False)}}
        if engine.refused:
            entry["times"]["cuda-graph"] = {c: f"refused: {engine.refused}" for c in contexts}
        if engine.replayed is not None:
            entry["times"]["cuda-graph"] = time_buffered(engine, contexts, args.warmup, min(args.iters, 30),
                                                         replay=True)
        # Its accuracy on plain runs (a captured graph per mask length would be a graph per step).
        engine.replayed = None
        entry["accuracy"] = A.measure(engine.run, layout, base_for(layout), budget, dtype, one_at_a_time=True).to_dict()
        entry["step_bytes"] = {c: weights + cache_bytes(layout, c, np.dtype(dtype).itemsize) for c in contexts}
        entry["seconds"] = time.time() - t0
        emit(entry)

    def torch_engine(name):
        dtype = {"fp32": torch.float32, "fp16": torch.float16}[name]
        t0 = time.time()
        cfg = model.config
        lay = hf.Layout("concat", cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
                        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, cfg.vocab_size)
        entry = {"engine": "transformers", "label": f"torch-{name}", "form": "DynamicCache",
                 "times": {"eager": time_torch(model, lay, contexts, args.warmup, args.iters, dtype)}}
        entry["accuracy"] = torch_cost(model, base_for(lay), dtype)
        entry["seconds"] = time.time() - t0
        emit(entry)

    def guarded(fn, spec, engine):
        try:
            fn(spec)
        except Exception as e:  # noqa: BLE001 - one engine failing does not stop the others
            emit({"engine": engine, "label": spec.split("=", 1)[0], "failed": f"{type(e).__name__}: {e}"[:600]})

    for spec in args.onnx:
        guarded(attnexport_engine, spec, "attnexport")
    for spec in args.genai:
        guarded(genai_engine, spec, "onnxruntime-genai")
    for name in args.torch:
        guarded(torch_engine, name, "transformers")
    return result




def table(paths) -> str:
    """Markdown: each engine's median ms a token per context and mode (p10-p90), its file size and
    accuracy beside it."""
    lines = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        contexts = d["contexts"]
        lines.append(f"{d.get('device', d['provider'])}, onnxruntime {d.get('onnxruntime')}, torch {d.get('torch')}, "
                     f"TF32 off, read bandwidth {d.get('read_bandwidth_gbs') or 0:.0f} GB/s; "
                     f"`{Path(d['source']).name}` ({d['params_from']}); median ms a token (p10-p90) over "
                     f"{d['iters']} steps")
        lines.append("")
        lines.append("| engine | export | MiB | mode | " + " | ".join(str(c) for c in contexts)
                     + " | KL mean | top-1 | perplexity (fp32) | greedy first differing token |")
        lines.append("| --- | --- | ---: | --- | " + " | ".join("---:" for _ in contexts)
                     + " | ---: | ---: | ---: | --- |")
        for e in d["engines"]:
            if "failed" in e:
                lines.append(f"| {e['engine']} | {e['label']} | | failed: {e['failed'][:120]} |"
                             + " |" * (len(contexts) + 4))
                continue
            a = e["accuracy"]
            acc = (f"{a['kl_mean']:.2g} | {a['top1']:.1%} | {a['perplexity']:.4g} ({a['perplexity_fp32']:.4g}) | "
                   + ", ".join("-" if f is None else str(f) for f in a["first_difference"]))
            for mode, times in e["times"].items():
                cells = []
                for c in contexts:
                    v = times.get(str(c), times.get(c))
                    cells.append(f"{v[0]:.3f} ({v[1]:.3f}-{v[2]:.3f})" if isinstance(v, list) else "refused"
                                 if str(v).startswith("refused") else "failed")
                size = f"{e['file_mib']:.0f}" if "file_mib" in e else ""
                lines.append(f"| {e['engine']} | {e['label']} | {size} | {mode} | " + " | ".join(cells) + f" | {acc} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("random")
    r.add_argument("folder", type=Path)
    r.add_argument("--word-tokenizer", action="store_true")
    b = sub.add_parser("run")
    b.add_argument("--source", required=True)
    b.add_argument("--onnx", action="append", default=[], help="LABEL=PATH of an attnexport --hf export")
    b.add_argument("--genai", action="append", default=[], help="LABEL=FOLDER of an onnxruntime-genai build")
    b.add_argument("--torch", action="append", default=[], choices=["fp32", "fp16"])
    b.add_argument("--contexts", default="128,1024,4096,8192")
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--iters", type=int, default=100)
    b.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    b.add_argument("--json")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    if args.command == "table":
        print(table(args.files))
        return
    if args.command == "random":
        print(make_random(args.folder, args.word_tokenizer))
        return
    run(args)


if __name__ == "__main__":
    main()
