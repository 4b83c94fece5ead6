"""Renders committed bench JSON files as Markdown tables: python benchmarks/table.py FILE.json ..."""

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
                     f"{fmt(r['ratio_to_torch'], '.2f')} | {fmt(r.get('ratio_min'), '.2f')}-{fmt(r.get('ratio_max'), '.2f')} | "
                     f"{fmt(r['peak_fraction'], '.2f')} | {fmt(r.get('bandwidth_fraction'), '.2f')} | "
                     f"{fmt(r['max_abs_err'], '.1e')} |")
    return "\n".join(lines)


def table(path):
    rows = json.load(open(path))
    if any(r.get("phase") for r in rows):
        return decode_table(rows)
    spread = any(r.get("ratio_min") is not None for r in rows)
    memory = any(r.get("peak_mem_bytes") for r in rows)
    lines = ["| runtime | flavor | mode | batch x seq | median ms | p10 | p90 | TFLOP/s | peak fraction | x torch eager | "
             + ("x torch spread | " if spread else "") + ("peak MiB | " if memory else "") + "max abs err vs torch |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | " + ("---: | " if spread else "")
             + ("---: | " if memory else "") + "---: |"]
    for r in rows:
        shape = "x".join(str(r["shape"][k]) for k in ("batch", "seq") if k in r["shape"])
        mib = r["peak_mem_bytes"] / 2**20 if r.get("peak_mem_bytes") else None
        lines.append(f"| {r['runtime']} | {r['flavor']} | {r.get('mode', '')} | {shape} | {fmt(r['median_ms'], '.3f')} | "
                     f"{fmt(r['p10_ms'], '.3f')} | {fmt(r['p90_ms'], '.3f')} | {fmt(r['tflops'], '.3f')} | "
                     f"{fmt(r['peak_fraction'], '.2f')} | {fmt(r['ratio_to_torch'], '.3f')} | "
                     + (f"{fmt(r.get('ratio_min'), '.2f')}-{fmt(r.get('ratio_max'), '.2f')} | " if spread else "")
                     + (f"{fmt(mib, '.0f')} | " if memory else "")
                     + f"{fmt(r['max_abs_err'], '.1e')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"`{p}`\n\n{table(p)}\n")
