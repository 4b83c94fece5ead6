"""docs/whisper.md's speed table from `bench --hf WHISPER --json` runs: one row an engine, each
run's median (and p10-p90) side by side, the transcript's agreement with transformers' fp32 one.

    attnexport bench --hf TINY_EN --audio beckett.wav --threads 2 --iters 10 --warmup 2 --json > run1.json
    python benchmarks/whisper_table.py run1.json run2.json
"""

import json
import sys


def main() -> None:
    runs = [json.load(open(path)) for path in sys.argv[1:]]
    keys = [(r["engine"], r["flavor"], r["precision"]) for r in runs[0]["rows"]]
    by = [{(r["engine"], r["flavor"], r["precision"]): r for r in run["rows"]} for run in runs]
    n = len(runs)
    print("| engine | precision | encoder ms (30 s) | ms a token | transcription ms | real-time factor | "
          "x CTranslate2 (same precision) | transcript |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in keys:
        rows = [b[key] for b in by if key in b]
        engine, flavor, precision = key
        name = engine + (f" ({flavor})" if flavor != "-" else "")
        encoder = " / ".join(_spread(r, "encoder") for r in rows)
        token = " / ".join(f"{r['token_ms']:.1f}" for r in rows)
        whole = " / ".join(_spread(r, "transcription") for r in rows)
        rtf = " / ".join(f"{r['real_time_factor']:.3f}" for r in rows)
        ratio = " / ".join(f"{r['ratio_to_ctranslate2']:.2f}" if r["ratio_to_ctranslate2"] else "-" for r in rows)
        said = "equal" if all(r["equal"] for r in rows) else \
            " / ".join(f"{r['agreement']:.0%} tokens, WER {r['word_error_rate']:.2f}" for r in rows)
        print(f"| {name} | {precision} | {encoder} | {token} | {whole} | {rtf} | {ratio} | {said} |")
    info = runs[0]["info"]
    print(f"\n{n} run(s), {info['threads']} threads, {info['audio_s']:.1f} s of audio, "
          f"{len(info['transcript'])} tokens")


def _spread(row: dict, what: str) -> str:
    return f"{row[what + '_ms']:.0f} ({row[what + '_p10_ms']:.0f}-{row[what + '_p90_ms']:.0f})"


if __name__ == "__main__":
    main()
