"""Sentence encoders (`attnexport.pretrained.embeddings`, the Encoder family and its embed form):
the cost measures as an embedder's users judge it (cosine, top-k retrieval with ties), and small
random BERT and RoBERTa encoders from examples/tiny_encoders.py exported in every flavour with a
dynamic batch and sequence, their pooling as their sentence-transformers files say, verified on
every runtime present, and the refusals. The real all-MiniLM-L6-v2 is tests/test_real_encoders.py's."""

import json
import shutil

import numpy as np
import pytest

from attnexport.pretrained.encoders import measures as E


def _embeddings(seed=0, n=None):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n or len(E.sentences()), 16))


def test_the_same_embeddings_cost_nothing():
    want = _embeddings()
    cost = E.measure(want * 3.0, want, RT.BUDGETS["fp32"])  # a scale is no change to a cosine
    assert np.allclose(cost.cosines, 1.0, rtol=0, atol=1e-12) and cost.agreement == 1.0 and cost.top1 == 1.0
    assert cost.judge(RT.BUDGETS["fp32"]).failures == []


def test_a_turned_sentence_fails_the_cosine_and_names_it():
    want = _embeddings()
    got = want.copy()
    got[11] = _embeddings(seed=1)[11]
    cost = E.measure(got, want, RT.BUDGETS["fp32"])
    failures = cost.judge(RT.BUDGETS["fp32"]).failures
    assert cost.cosines.argmin() == 11 and any("sentence 11" in f for f in failures)


def test_a_nan_never_passes():
    got = _embeddings()
    got[0, 0] = np.nan
    cost = E.measure(got, _embeddings(), RT.BUDGETS["int4"])
    assert cost.judge(RT.BUDGETS["int4"]).failures and cost.agreement == 0.0


def test_a_tie_within_the_exports_own_error_agrees_and_a_real_swap_does_not():
    queries = len(E.QUERIES)
    want = _embeddings()
    scores = RT.unit(want[:queries]) @ RT.unit(want[queries:]).T
    ranked = np.argsort(-scores[0])
    inside, outside = queries + ranked[RT.TOP_K - 1], queries + ranked[RT.TOP_K]
    # Swap the k-th and the (k+1)-th documents' embeddings for query 0 only by moving the query.
    got = want.copy()
    got[0] = want[0] + 1e-9 * (RT.unit(want[outside]) - RT.unit(want[inside]))
    assert E.measure(got, want, RT.BUDGETS["fp32"]).agreement == 1.0  # a nudge far below any real difference
    got[0] = RT.unit(want[outside]) * np.linalg.norm(want[0])  # the query now is document k+1
    cost = E.measure(got, want, RT.BUDGETS["fp32"])
    assert cost.agreement < 1.0 and cost.judge(RT.BUDGETS["fp32"]).failures


# --- the encoder family, on small random encoders ----------------------------------------------------

transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from conftest import cli as run  # noqa: E402

from attnexport import signature as SG  # noqa: E402
from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained import registry  # noqa: E402
from attnexport.pretrained import retrieval as RT  # noqa: E402
from attnexport.pretrained.check import HFCheck, verify_hf  # noqa: E402


def _sentences(folder, texts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return {k: np.asarray(v, np.int64) for k, v in tokenizer(texts, padding=True, return_tensors="np").items()}


def _torch_embeddings(folder, feed, pooling="mean", normalize=True):
    """What sentence-transformers computes, written out here from the model's token states."""
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()  # the folder's weights (random, seed 0)
    with torch.no_grad():
        states = model(**{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state.double().numpy()
    mask = feed["attention_mask"][..., None].astype(np.float64)
    pooled = {"mean": (states * mask).sum(1) / mask.sum(1), "cls": states[:, 0],
              "max": np.where(mask > 0, states, -1e9).max(1)}[pooling]
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True) if normalize else pooled




@pytest.mark.parametrize("flavor", ["attention", "primitives", "ort"])
def test_a_bert_encoder_exports_with_a_dynamic_batch_and_sequence_and_embeds_as_sentence_transformers(
        tiny_encoder, tmp_path, flavor):
    folder = tiny_encoder("bert")
    out = tmp_path / "bert.onnx"
    result, layout = hf_export.export_hf(hf_export.HFExport(folder, flavor=flavor, output=out))
    assert layout.family is registry.of_task("feature-extraction") and layout.form == "embed"
    model = onnx.load(out)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [o.name for o in model.graph.output] == ["last_hidden_state", "sentence_embedding"]
    recorded = SG.of(model).model
    assert (recorded["pooling"], recorded["normalize"], recorded["max_seq"]) == ("mean", True, 128)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for texts in (E.CORPUS[:1], E.CORPUS[:5], E.QUERIES):  # batches and lengths the trace never saw
        feed = _sentences(folder, list(texts))
        got = session.run(["sentence_embedding"], feed)[0]
        want = _torch_embeddings(folder, feed)
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize(("arch", "pooling", "normalize"), [("bert", "cls", False), ("roberta", "max", True)])
def test_the_pooling_and_normalisation_are_the_folders_own(tiny_encoder, tmp_path, arch, pooling, normalize):
    folder = tiny_encoder(arch, pooling=pooling, normalize=normalize)
    out = tmp_path / "m.onnx"
    _, layout = hf_export.export_hf(hf_export.HFExport(folder, output=out))
    assert (layout.pooling, layout.normalize) == (pooling, normalize)
    inputs = [i.name for i in onnx.load(out).graph.input]
    assert inputs == ["input_ids", "attention_mask", "token_type_ids"]  # RoBERTa's one type too: as Optimum's
    feed = _sentences(folder, list(E.QUERIES))
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(["sentence_embedding"], feed)[0]
    assert np.abs(got - _torch_embeddings(folder, feed, pooling, normalize)).max() < 1e-4






def test_refusals_are_one_line_and_write_nothing(tiny_encoder, tiny_lm, tmp_path):
    folder = tiny_encoder("bert")
    r = run("export", "--hf", folder, "--kv-cache", "-o", tmp_path / "a.onnx")
    assert r.exit_code == 2 and "keeps no cache" in r.output and len(r.output.strip().splitlines()) == 1
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(folder, bare)
    for f in bare.glob("*"):  # what a transformers version saves of a tokenizer: its files, whichever
        if f.name.startswith(("tokenizer", "vocab", "special_tokens")):
            f.unlink()
    r = run("export", "--hf", bare, "-o", tmp_path / "b.onnx")
    assert r.exit_code == 2 and "needs its tokenizer" in r.output and len(r.output.strip().splitlines()) == 1
    short = tmp_path / "short"
    shutil.copytree(folder, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 12}))
    (short / "model.safetensors").unlink()  # its weights hold 128 positions: drawn for 12 from a seed instead
    assert run("export", "--hf", short, "-o", tmp_path / "c.onnx", "--seed", "0").exit_code == 0  # its checks fit
    r = run("verify", tmp_path / "c.onnx", "--hf", short, "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "the model's positions take 12" in r.output
    pooled = tmp_path / "pooled"
    shutil.copytree(folder, pooled)
    (pooled / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    r = run("export", "--hf", pooled, "-o", tmp_path / "d.onnx")
    assert r.exit_code == 2 and "weightedmean" in r.output
    assert sorted(p.name for p in tmp_path.glob("*.onnx")) == ["c.onnx"]
    r = run("verify", tmp_path / "c.onnx", "--hf", tiny_lm("llama"), "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "is a sentence encoder's export" in r.output and "causal language model" in r.output
    with pytest.raises(UsageError, match="not a causal language model"):
        registry.of_config(transformers.T5Config(architectures=["T5Model"]), "t5")
    assert hf.Layout.of(onnx.load(tmp_path / "c.onnx")).max_seq == 12


def test_a_quantized_encoder_reports_what_each_layer_costs_alone_and_keep_takes_its_layers(tiny_encoder, tmp_path):
    """verify's per-layer row for an encoder: each layer's matrices as the file holds them, alone, in
    the fp32 model, and the lowest cosine that costs, most costly first; --keep names an encoder's
    layers as a language model's (BERT's parameters are encoder.layer.I)."""
    from attnexport.pretrained import precision as P
    folder = tiny_encoder("bert")
    out = tmp_path / "int4.onnx"
    hf_export.export_hf(hf_export.HFExport(folder, precision="int4", output=out))
    groups = {e["group"] for e in P.record_of(onnx.load(out))["matrices"]}
    assert groups == {"layer:0", "layer:1"}
    report = verify_hf(HFCheck(out, folder, runtimes=["ort-cpu"]))
    row = next(r for r in report.rows if "each layer quantized alone" in r.case)
    costs = row.detail["layer_costs"]
    assert [c["group"] for c in costs] in (["layer:0", "layer:1"], ["layer:1", "layer:0"])
    assert costs[0]["cost"] > costs[1]["cost"] > 0 and row.passed  # each layer alone: two costs, not one twice
    kept = tmp_path / "kept.onnx"
    hf_export.export_hf(hf_export.HFExport(folder, precision="int4", output=kept, plan=P.Plan(
        bits=4, keep=P.parse_keep(costs[0]["group"]))))
    held = {e["group"] for e in P.record_of(onnx.load(kept))["matrices"] if not e["bits"]}  # left float
    assert held == {costs[0]["group"]}


def _corpus_of(scores: np.ndarray) -> np.ndarray:
    """Embeddings whose query-document cosines are `scores` (queries, documents), worked by hand: each
    query a unit axis of its own, each document its column of scores plus what makes it unit length
    on one more axis; a last axis left empty (room to turn a sentence away from every other)."""
    q, d = scores.shape
    extra = np.sqrt(1 - (scores ** 2).sum(axis=0))
    docs = np.concatenate([scores, extra[None, :], np.zeros((1, d))], axis=0).T  # (d, q + 2)
    return np.concatenate([np.eye(q, q + 2), docs])


def test_the_measures_are_the_hand_worked_ones():
    """Query 0's float64 top 5 are documents 0-4 (scores 0.50 ... 0.30, document 5 at 0.25; the other
    queries rank their documents 0.20 ... 0.05 apart). Where the file scores document 5 at 0.35 (ranked
    fourth, in place of document 4), 4 of its top 5 are the float64 ones: agreement (7 + 0.8) / 8 =
    0.975, its first still the first (top-1 1.0), the largest score change 0.10; every score of query 0
    raised by 0.10, its ranking kept, retrieves the same documents (agreement 1). A document turned by
    60 degrees from itself (onto the empty axis), three times as long, has cosine 0.5."""
    queries, documents = len(E.QUERIES), len(E.CORPUS)
    assert queries == 8 and documents >= 7
    scores = np.tile(np.linspace(0.20, 0.05, documents), (queries, 1))
    scores[0, :6] = [0.50, 0.45, 0.40, 0.35, 0.30, 0.25]
    want = _corpus_of(scores)
    assert np.allclose(RT.unit(want[:queries]) @ RT.unit(want[queries:]).T, scores)
    moved = scores.copy()
    moved[0, 5] = 0.35
    cost = E.measure(_corpus_of(moved), want, RT.BUDGETS["fp32"])
    assert cost.agreement == pytest.approx(0.975) and cost.top1 == 1.0
    assert cost.score_error == pytest.approx(0.10)
    a, b = want[queries + 5], _corpus_of(moved)[queries + 5]  # document 5 itself moved: its cosine by hand
    moved_cosine = float(a @ b)  # both unit length
    assert cost.cosines[queries + 5] == pytest.approx(moved_cosine) and moved_cosine < 0.999
    assert cost.judge(RT.BUDGETS["fp32"]).failures == [f"sentence {queries + 5}'s cosine {moved_cosine:.7f} < 0.99999",
                                                "top-5 agreement 0.975 < 1"]
    # the same swap within the tie: min(2 x the largest score change, int4's 2 sqrt(2 (1 - 0.98)) = 0.4) = 0.2
    assert RT.BUDGETS["int4"].tie == pytest.approx(0.4)
    assert E.measure(_corpus_of(moved), want, RT.BUDGETS["int4"]).agreement == 1.0
    raised = scores.copy()
    raised[0] += 0.10  # every score of query 0 higher, its ranking the same: the same documents retrieved
    assert E.measure(_corpus_of(raised), want, RT.BUDGETS["fp32"]).agreement == 1.0
    turned = want.copy()
    last = queries + documents - 1  # the lowest-scoring document: no ranking moves
    turned[last] = 3.0 * (0.5 * want[last] + np.sqrt(0.75) * np.eye(queries + 2)[-1])
    cost = E.measure(turned, want, RT.BUDGETS["fp32"])
    assert cost.cosines[last] == pytest.approx(0.5, abs=1e-12) and np.allclose(np.delete(cost.cosines, last), 1.0)
    assert cost.judge(RT.BUDGETS["fp32"]).failures == [f"sentence {last}'s cosine 0.5000000 < 0.99999"]
    assert cost.agreement == 1.0


def test_each_precision_is_judged_by_its_own_embedding_budget():
    assert RT.budget_for("fp32") == RT.EmbeddingBudget(0.99999, 1.0)
    assert RT.budget_for("fp16") == RT.EmbeddingBudget(0.999, 0.95)
    assert RT.budget_for("int8") == RT.EmbeddingBudget(0.99, 0.9)
    assert RT.budget_for("int4") == RT.budget_for("q4f16") == RT.EmbeddingBudget(0.98, 0.85)
    with pytest.raises(ValueError, match="no embedding budget for precision 'int2'"):
        RT.budget_for("int2")


def test_pooling_is_sentence_transformers_own_by_hand():
    """Two tokens (1, 3) and (3, 5) and a padded third (100, 100): mean (2, 4), cls (1, 3), max (3, 5);
    normalised, mean is (2, 4) / sqrt(20)."""
    states = np.array([[[1.0, 3.0], [3.0, 5.0], [100.0, 100.0]]])
    mask = np.array([[1, 1, 0]])
    assert E.pooled(states, mask, "mean", False).tolist() == [[2.0, 4.0]]
    assert E.pooled(states, mask, "cls", False).tolist() == [[1.0, 3.0]]
    assert E.pooled(states, mask, "max", False).tolist() == [[3.0, 5.0]]
    assert np.allclose(E.pooled(states, mask, "mean", True), [[2 / np.sqrt(20), 4 / np.sqrt(20)]])
