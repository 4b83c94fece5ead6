"""Renders committed bench JSON files as Markdown tables: python benchmarks/table.py [--summary] FILE.json ...

--summary: for `bench --decode` files, one line per cache and context of the decoding step: torch
eager and in a CUDA graph, and ONNX Runtime's fastest flavour and mode without and with CUDA graphs."""

import json
import sys


def fmt(x, spec):
    return "" if x is None or x != x else format(x, spec)


def decode_table(rows):
    """bench --decode rows: one line per phase, context, runtime, flavour and mode (a static cache's
    rows name their cache and whether its buffers were bound in place)."""
    lines = ["| phase | context | runtime | flavor | mode | median ms | p10-p90 | tokens/s | x torch eager | "
             "x torch spread | peak fraction | bandwidth fraction | max abs err vs torch |",
             "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if not r.get("phase"):
            continue
        context = r["shape"]["seq"] if r["phase"] == "prefill" else r["shape"]["past_seq"]
        lines.append(f"| {r['phase']} | {context} | {r['runtime']} | {r['flavor']} | {r.get('mode', '')} | "
                     f"{fmt(r['median_ms'], '.3f')} | "
                     f"{fmt(r['p10_ms'], '.3f')}-{fmt(r['p90_ms'], '.3f')} | {fmt(r['tokens_per_s'], ',.0f')} | "
                     f"{fmt(r['ratio_to_torch'], '.2f')} | "
                     f"{fmt(r.get('ratio_min'), '.2f')}-{fmt(r.get('ratio_max'), '.2f')} | "
                     f"{fmt(r['peak_fraction'], '.2f')} | {fmt(r.get('bandwidth_fraction'), '.2f')} | "
                     f"{fmt(r['max_abs_err'], '.1e')} |")
    return "\n".join(lines)


def table(path):
    rows = json.load(open(path))
    if any(r.get("phase") for r in rows):
        return decode_table(rows)
    spread = any(r.get("ratio_min") is not None for r in rows)
    memory = any(r.get("peak_mem_bytes") for r in rows)
    lines = ["| runtime | flavor | mode | batch x seq | median ms | p10 | p90 | TFLOP/s | peak fraction | "
             "x torch eager | "
             + ("x torch spread | " if spread else "") + ("peak MiB | " if memory else "") + "max abs err vs torch |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | " + ("---: | " if spread else "")
             + ("---: | " if memory else "") + "---: |"]
    for r in rows:
        shape = "x".join(str(r["shape"][k]) for k in ("batch", "seq") if k in r["shape"])
        mib = r["peak_mem_bytes"] / 2**20 if r.get("peak_mem_bytes") else None
        lines.append(f"| {r['runtime']} | {r['flavor']} | {r.get('mode', '')} | {shape} | "
                     f"{fmt(r['median_ms'], '.3f')} | "
                     f"{fmt(r['p10_ms'], '.3f')} | {fmt(r['p90_ms'], '.3f')} | {fmt(r['tflops'], '.3f')} | "
                     f"{fmt(r['peak_fraction'], '.2f')} | {fmt(r['ratio_to_torch'], '.3f')} | "
                     + (f"{fmt(r.get('ratio_min'), '.2f')}-{fmt(r.get('ratio_max'), '.2f')} | " if spread else "")
                     + (f"{fmt(mib, '.0f')} | " if memory else "")
                     + f"{fmt(r['max_abs_err'], '.1e')} |")
    return "\n".join(lines)


def decode_summary(rows):
    """The decoding step per cache (static, concat) and context: torch eager, torch in a CUDA graph, and
    ONNX Runtime's fastest flavour and mode without and with a CUDA graph (ms, x torch eager's time,
    and the fraction of the memory bandwidth where the file has it)."""
    lines = ["| cache | batch | context | torch eager ms | torch CUDA graph ms | ORT best, no graph | ms | "
             "x torch eager | "
             "ORT best in a CUDA graph | ms | x torch eager | x torch's graph | bandwidth fraction |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    decode = [r for r in rows if r.get("phase") == "decode" and r["median_ms"] == r["median_ms"]]
    keys = sorted({(r["mode"].split()[0], r["shape"]["batch"], r["shape"]["past_seq"]) for r in decode},
                  key=lambda k: (k[0] != "static", k[1], k[2]))
    for cache, batch, context in keys:
        here = [r for r in decode if r["mode"].split()[0] == cache and r["shape"]["batch"] == batch
                and r["shape"]["past_seq"] == context]
        eager = next(r for r in here if r["runtime"].startswith("torch") and "graph" not in r["mode"])
        graph = next((r for r in here if r["runtime"].startswith("torch") and "graph" in r["mode"]), None)
        ort = [r for r in here if r["runtime"].startswith("ort")]
        plain = min((r for r in ort if "graph" not in r["mode"]), key=lambda r: r["median_ms"], default=None)
        captured = min((r for r in ort if "graph" in r["mode"]), key=lambda r: r["median_ms"], default=None)

        def cell(r, eager=eager):
            if r is None:
                return "- | | "
            mode = r["mode"].split(" ", 1)[1] if " " in r["mode"] else r["mode"]
            return f"{r['flavor']} {mode} | {r['median_ms']:.3f} | {r['median_ms'] / eager['median_ms']:.2f}"
        to_graph = f"{captured['median_ms'] / graph['median_ms']:.2f}" if captured and graph else ""
        bw = (captured or plain or {}).get("bandwidth_fraction")
        lines.append(f"| {cache} | {batch} | {context} | {eager['median_ms']:.3f} | "
                     f"{fmt(graph and graph['median_ms'], '.3f')} | {cell(plain)} | {cell(captured)} | {to_graph} | "
                     f"{fmt(bw, '.2f')} |")
    return "\n".join(lines)


def static_step_table(doc):
    """benchmarks/probes/cuda_static.py's file: the step's attention per batch and context, each way's median ms
    (and its fraction of the GPU's read bandwidth), in one buffer."""
    ways = [("torch", "eager"), ("torch", "cuda-graph"), ("attention24", "in-place"),
            ("attention24", "in-place cuda-graph"),
            ("gqa", "in-place"), ("gqa", "in-place cuda-graph")]
    lines = [f"{doc['device']}, read bandwidth {doc['read_bandwidth_gbs']:.0f} GB/s, buffer {doc['args']['buffer']} "
             f"positions, {doc['args']['heads']} heads ({doc['args']['kv_heads']} key/value), head size "
             f"{doc['args']['head_dim']}, {doc['args']['dtype']}; ms (fraction of the read bandwidth)", "",
             "| batch | context | " + " | ".join(f"{w} {m}" for w, m in ways) + " |",
             "| ---: | ---: | " + " | ".join("---:" for _ in ways) + " |"]
    keys = sorted({(r["batch"], r["context"]) for r in doc["rows"]})
    for b, c in keys:
        cells = []
        for w, m in ways:
            r = next((r for r in doc["rows"] if (r["batch"], r["context"], r["way"], r["mode"]) == (b, c, w, m)), None)
            cells.append("refused" if r is None or r["median_ms"] is None
                         else f"{r['median_ms']:.4f} ({r['bandwidth_fraction']:.2f})")
        lines.append(f"| {b} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    summary = "--summary" in args
    for p in [a for a in args if a != "--summary"]:
        rows = json.load(open(p))
        text = static_step_table(rows) if isinstance(rows, dict) else decode_summary(rows) if summary else table(p)
        print(f"`{p}`\n\n{text}\n")
