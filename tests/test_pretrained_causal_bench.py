"""`bench --hf LM --decode` (`attnexport.pretrained.causal.bench`): every form timed beside transformers, each
with its answers' agreement; a decode step's least bytes. Timings are printed, never asserted. The [hf] extra."""

import json

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli as run  # noqa: E402

from attnexport.pretrained import model as hf  # noqa: E402

ARCHITECTURES = ("llama", "mistral", "qwen2", "phi3", "gpt2")


FORMS = {"none": [], "concat": ["--kv-cache"], "static": ["--kv-cache", "static", "--max-seq", "64"]}


@pytest.fixture(scope="module")
def folders(tiny_lm):
    return {arch: tiny_lm(arch) for arch in ARCHITECTURES}


def _json(result):
    return json.loads(result.output[result.output.index("{"):])


def test_bench_times_every_form_beside_transformers(folders):
    r = run("bench", "--hf", folders["llama"], "--decode", "--context", "8,32", "--flavor", "ort", "--threads", "1",
            "--iters", "3", "--warmup", "1", "--json")
    assert r.exit_code == 0, r.output
    doc = _json(r)
    rows = [row for row in doc["rows"] if row["engine"] in ("attnexport", "transformers")]
    found = {(row["engine"], row["form"], row["phase"], row["context"]) for row in rows}
    for context in (8, 32):
        for engine, form in (("transformers", "DynamicCache"), ("attnexport", "concat"), ("attnexport", "static")):
            assert (engine, form, "decode", context) in found and (engine, form, "prefill", context) in found
    decode = [row for row in rows if row["phase"] == "decode"]
    assert all(row["median_ms"] > 0 and row["ratio_to_transformers"] > 0 and 0 < row["bandwidth_fraction"]
               for row in decode)
    static = [row for row in decode if row["form"] == "static"]
    assert all(row["mode"] == "in-place (IO binding)" for row in static)


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_steps_least_bytes_count_the_embedding_table_once_when_the_head_reads_it(tied):
    """One row of an untied input table; the whole matrix when the head is the same matrix."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnexport.pretrained.causal.bench import step_bytes
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    layout = hf.Layout(form="concat", layers=2, kv_heads=2, head_dim=4, vocab=50)
    per_layer = 16 * 16 * 2 + 16 * 8 * 2 + 16 * 32 * 3 + 16 * 2  # q, o; k, v; the MLP; two norms
    head = 50 * 16  # the head's matrix, read whole; tied, it is the embedding table, else one row of that
    params = 2 * per_layer + 16 + head + (0 if tied else 16)  # the layers, the final norm, the head, the row
    cache = 2 * 2 * 2 * 10 * 4  # keys and values, layers, kv heads, 10 positions, head_dim
    assert step_bytes(model, layout, 10) == 4 * (params + cache)



def test_a_genai_precision_carries_the_builder_s_options_and_a_wrong_one_is_refused_in_one_line(folders):
    """`--genai-precision int4:algo_config=k_quant_mixed` builds with the builder's --extra_options (its
    best int4 beside its default); a name it does not take, an option it does not know or an option on
    fp32 is refused before anything loads, in one line (exit 2)."""
    from attnexport.pretrained.causal import bench as CB
    specs = CB.genai_precisions("fp32, int4,int4:algo_config=k_quant_mixed:is_symmetric=false,int4")
    assert specs == ("fp32", "int4", "int4:algo_config=k_quant_mixed:is_symmetric=false")
    assert CB.builder_arguments(specs[2]) == ["-p", "int4", "--extra_options", "algo_config=k_quant_mixed",
                                              "is_symmetric=false"]
    assert CB.builder_arguments("fp32") == ["-p", "fp32"] and CB.genai_precisions(None) == ("fp32",)
    for wrong in ("int8", "int4:algo=rtn", "fp32:block_size=32", "int4:block_size", ","):
        r = run("bench", "--hf", folders["llama"], "--decode", "--genai-precision", wrong)
        assert r.exit_code == 2 and "--genai-precision takes fp32, int4" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
