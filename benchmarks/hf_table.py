"""The decode table of docs/benchmarks.md ("Whole language models") from one or more
`bench --hf --json` files of the same model: ms a token at each context (the median over the
files of each run's median, with the lowest and highest run), the ratio to transformers, the
memory-bandwidth fraction of that median over the highest read rate any of the runs measured (a
run's own measurement can come out low: this VM's read rate drifts between runs, see each file's
`info`, and a step cannot read faster than the memory does), and each engine's greedy tokens
against transformers' where the files have them.

    python benchmarks/hf_table.py benchmarks/results/2026-11-24-cpu/hf-llama-decode-*.json
"""

import json
import statistics
import sys


def main(paths: list[str]) -> None:
    docs = [json.load(open(p)) for p in paths]
    runs = [[r for r in d["rows"] if r["phase"] == "decode" and r["median_ms"] == r["median_ms"]] for d in docs]
    contexts = sorted({r["context"] for rows in runs for r in rows})
    engines: list[tuple] = []
    for r in runs[0]:
        key = _key(r)
        if key not in engines:
            engines.append(key)

    def at(key, context):
        found = [r for rows in runs for r in rows if _key(r) == key and r["context"] == context]
        ms = [r["median_ms"] for r in found]
        return statistics.median(ms), min(ms), max(ms), found

    eager = {c: at(engines[0], c)[0] for c in contexts}  # transformers, timed first
    bandwidth = max(d["info"]["bandwidth_gbs"] for d in docs) * 1e9
    agreed = any(r.get("agreement") for rows in runs for r in rows)
    print("| engine | precision | form | flavor | how | " + " | ".join(f"ms at {c}" for c in contexts)
          + " | x transformers | bandwidth fraction |" + (" greedy tokens as transformers | teacher-forced vs fp32 |"
                                                         if agreed else ""))
    print("| --- | --- | --- | --- | --- | " + " | ".join("---:" for _ in contexts) + " | ---: | ---: |"
          + (" --- | --- |" if agreed else ""))
    for key in engines:
        cells, ratios, fractions = [], [], []
        for c in contexts:
            median, low, high, found = at(key, c)
            cells.append(f"{median:.2f} ({low:.2f}-{high:.2f})" if len(found) > 1 else f"{median:.2f}")
            ratios.append(f"{eager[c] / median:.2f}")
            fractions.append(f"{found[0]['step_bytes'] / (median * 1e-3) / bandwidth:.2f}")
        agreement = ""
        if agreed:  # each run's (the same model and prompts: they differ only if an engine is not deterministic)
            found = at(key, contexts[0])[3]
            texts = dict.fromkeys(_agreement(r.get("agreement")) for r in found)
            teacher = dict.fromkeys(_teacher(r.get("agreement")) for r in found)
            agreement = f" {'; '.join(texts)} | {'; '.join(teacher)} |"
        print(f"| {' | '.join(key)} | {' | '.join(cells)} | {'/'.join(ratios)} | {'/'.join(fractions)} |{agreement}")
    print(f"\nbandwidth fractions over {bandwidth / 1e9:.1f} GB/s, the highest read rate measured")
    for path, d in zip(paths, docs, strict=True):
        info = d["info"]
        print(f"\n{path}: memory read bandwidth {info['bandwidth_gbs']:.1f} GB/s (reduction "
              f"{info['reduction_gbs']:.1f}, one-row MatMul {info['gemv_gbs']:.1f}); not timed: "
              f"{info['skipped'] or 'nothing'}")


def _key(r: dict) -> tuple:
    """An engine's row key: files written before precisions were timed are all fp32."""
    return (r["engine"], r.get("precision", "fp32"), r["form"], r["flavor"], r["mode"])


def _teacher(a: dict | None) -> str:
    """Teacher-forced KL, top-1 and perplexity growth against the fp32 model, where measured."""
    if not a or "kl_mean" not in a:
        return "-"
    return f"KL {a['kl_mean']:.2g}, top-1 {a['top1']:.0%}, perplexity {a['perplexity_delta']:+.1%}"


def _agreement(a: dict | None) -> str:
    """A row's agreement, short: `240/240`, `158/160 (stops at its end token)`, or where each
    prompt departs."""
    if not a:
        return "-"
    if "error" in a:
        return a["error"]
    text = f"{a['equal_tokens']}/{a['compared_tokens']}"
    if a["compared_tokens"] < a["prompts"] * a["new_tokens"]:
        text += " (stops at its end-of-sequence token)"
    if a["equal_prompts"] < a["prompts"]:
        text += "; first departure per prompt: " + ", ".join("-" if f is None else str(f)
                                                             for f in a["first_difference"])
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
