"""The injected-bug check: one plausible bug at a time in a copy of the checkout, and the tests
that must catch it (see tests/README.md). Not a test itself (pytest does not collect it); run it
from the checkout with the project's Python: `python tests/inject_bugs.py [NAME ...]`."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

# The whole-model package, where half the bugs go.
PRE = "attnexport/pretrained/"

BUGS = [
    ("dropped scale (primitives scores unscaled)",
     [("attnexport/onnx_attention.py", "    return op.Mul(scores, _const(scale, scores))", "    return scores")], False,
     ["tests/test_export.py", "-k", "fp32_matches or static_scale"]),
    ("causal mask not offset by the cache",
     [("attnexport/models/core.py", "            rows = rows + past", "            rows = rows")], False,
     ["tests/test_models.py", "tests/test_decode.py"]),
    ("hand-written attention routed without its scale",
     [("attnexport/recognize.py", "                scale *= n if t is aten.mul.Tensor else 1.0 / n",
       "                scale *= 1.0")], False,
     ["tests/test_recognize.py"]),
    ("static cache reads the whole buffer",
     [("attnexport/models/core.py", "    valid = valid_keys(write_pos, key.shape[2])",
       "    valid = write_pos * 0 + caches[0].shape[2]")], False,
     ["tests/test_models.py", "tests/test_decode.py", "tests/test_verify.py", "-k", "static or mha"]),
    ("verify skips the weights output",
     [("attnexport/verify/execute.py",
       'declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)]',
       'declared = ["output"] if step.decode_chunk else '
       '[s.name for s in variant.outputs(case.options) if s.name != "weights"]')], False,
     ["tests/test_verify.py", "-k", "wrong_value"]),
    ("verify compares the first output only",
     [("attnexport/verify/execute.py",
       'declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)]',
       'declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)][:1]')],
     False, ["tests/test_verify.py", "-k", "wrong_value"]),
    ("FP16_FACTOR 4 -> 400", [("attnexport/compare.py", "FP16_FACTOR = 4.0", "FP16_FACTOR = 400.0")], False,
     ["tests/test_compare.py"]),
    ("fp32 atol 1e-5 -> 1e-3",
     [("attnexport/compare.py", '"fp32": Tolerance(rtol=1e-4, atol=1e-5)', '"fp32": Tolerance(rtol=1e-4, atol=1e-3)')],
     False, ["tests/test_compare.py"]),
    ("mha FLOPs: attention term halved",
     [("attnexport/variants.py", "    return proj + 2 * B * H * Tq * Tk * 2 * hd",
       "    return proj + B * H * Tq * Tk * 2 * hd")], False,
     ["tests/test_variants.py", "tests/test_bench.py"]),
    ("mha-tied scaled by 1/sqrt(head size) in module and reference, golden rewritten",
     [("attnexport/models/multi_head.py", "self.scale = 1.0 / math.sqrt(dim)",
       "self.scale = 1.0 / math.sqrt(dim // heads)"),
      ("attnexport/reference.py", "scale=1.0 / np.sqrt(E))", "scale=1.0 / np.sqrt(E // h))")], True,
     ["tests/test_oracles.py", "tests/test_models.py", "tests/test_golden.py"]),
    ("a whole model's budget factor 4 -> 400",
     [("attnexport/compare.py", "FP32_FACTOR = 4.0", "FP32_FACTOR = 400.0")], False,
     ["tests/test_pretrained_reference.py", "tests/test_compare.py"]),
    ("a whole model's padding compared",
     [(PRE + "causal/forms.py", '    mask = np.asarray(feed["attention_mask"]).astype(bool)  # (B, past + T)',
       '    mask = np.ones_like(np.asarray(feed["attention_mask"]), bool)  # (B, past + T)')], False,
     ["tests/test_pretrained_reference.py"]),
    ("a whole model's float64 reference rounded to float32 inside (the casts kept)",
     [(PRE + "reference.py", "        if func is torch.Tensor.float:\n            func = torch.Tensor.double\n",
       "")], False, ["tests/test_pretrained_reference.py"]),
    ("kernel weights softmax(-d^2) in module and reference, golden rewritten",
     [("attnexport/models/kernel.py", "torch.softmax(-(diff * diff) / 2, dim=-1)",
       "torch.softmax(-(diff * diff), dim=-1)"),
      ("attnexport/reference.py", "w = softmax_rows(_r(-(d**2) / 2))", "w = softmax_rows(_r(-(d**2)))")], True,
     ["tests/test_oracles.py", "tests/test_models.py", "tests/test_golden.py"]),
    # --- the whole-model and quantization code (2026-11-28); the [hf] tests need transformers ---------
    ("KL measured from the model to fp32 (the other direction)",
     [(PRE + "causal/accuracy.py", "    kl = B.kl_per_position(base.eval32, got_eval)",
       "    kl = B.kl_per_position(got_eval, base.eval32)")], False,
     ["tests/test_pretrained_causal_accuracy.py", "-k", "hand or nats"]),
    ("KL in bits, not nats",
     [(PRE + "cost.py", "        kl = (np.exp(p) * (p - q)).sum(axis=-1)",
       "        kl = (np.exp(p) * (p - q)).sum(axis=-1) / np.log(2)")], False,
     ["tests/test_pretrained_causal_accuracy.py", "-k", "hand or nats"]),
    ("top-1 of the whole text, not per position",
     [(PRE + "causal/accuracy.py", "    top1 = float((base.eval32.argmax(-1) == got_eval.argmax(-1)).mean())",
       "    top1 = float(base.eval32.argmax() == got_eval.argmax())")], False,
     ["tests/test_pretrained_causal_accuracy.py", "-k", "hand"]),
    ("a first token decided only where fp32 leads by more than the margin",
     [(PRE + "causal/accuracy.py", "return sum(f == 0 and m >= self.margin", "return sum(f == 0 and m > self.margin")],
     False, ["tests/test_pretrained_causal_accuracy.py", "-k", "margin"]),
    ("fp32's lead measured to its least likely token, not its second",
     [(PRE + "causal/accuracy.py", "ranked[:, -1] - ranked[:, -2]", "ranked[:, -1] - ranked[:, 0]")], False,
     ["tests/test_pretrained_causal_accuracy.py", "-k", "margin or hand"]),
    ("a run's own failure forgiven where its baseline holds",
     [("attnexport/verify/executor.py", '            row.passed = row.passed and row.baseline["passed"]',
       '            row.passed = row.baseline["passed"]')], False, ["tests/test_executor.py"]),
    ("the quantized twin's budget factor 16 -> 160",
     [("attnexport/compare.py", "QUANTIZED_FACTOR = 16.0", "QUANTIZED_FACTOR = 160.0")], False,
     ["tests/test_compare.py"]),
    ("the quantized twin checked with fp32's factor",
     [(PRE + "export.py", "r.rtol, r.atol, QUANTIZED_FACTOR)", "r.rtol, r.atol, None)")], False,
     ["tests/test_pretrained_causal_accuracy.py", "-k", "quantized_factor"]),
    ("the logits compared at the block's first positions (left padding read as tokens)",
     [(PRE + "causal/forms.py", '"logits": mask[:, -block:, None]', '"logits": mask[:, :block, None]')], False,
     ["tests/test_pretrained_reference.py", "-k", "positions"]),
    ("a static buffer's window ending at the write position (the block's own rows not compared)",
     [(PRE + "causal/forms.py", 'ends = np.asarray(feed["write_pos"]).reshape(-1) + block',
       'ends = np.asarray(feed["write_pos"]).reshape(-1)')], False,
     ["tests/test_pretrained_reference.py", "-k", "write_position"]),
    ("the check before writing judges the logits only",
     [(PRE + "export.py", "comparisons = expected.compare(got, layout.outputs)",
       "comparisons = expected.compare(got, layout.outputs[:1])")], False,
     ["tests/test_pretrained_reference.py", "-k", "every_output"]),
    ("verify's step rows of a language model judge the logits only",
     [(PRE + "check.py", "functools.partial(expected.compare, names=ctx.layout.outputs)",
       "functools.partial(expected.compare, names=ctx.layout.outputs[:1])")], False,
     ["tests/test_pretrained_causal_check.py", "-k", "every_output"]),
    ("a folded weight's residual taken from the wrong residual row",
     [(PRE + "precision.py", "w[:, self.k:self.k + self.k // self.block].repeat_interleave(self.block, dim=1)",
       "w[:, self.k:self.k + self.k // self.block].repeat(1, self.block)")], False,
     ["tests/test_pretrained_precision.py"]),
    ("a folded weight's residual step read from its code block's scale",
     [(PRE + "precision.py", "per_row = np.repeat(scale[k // block:], block, axis=0)[:k // block]",
       "per_row = np.repeat(scale[:k // block], block, axis=0)[:k // block]")], False,
     ["tests/test_pretrained_precision.py", "-k", "folded"]),
    ("a stamped layer reads the template layer's weights",
     [("attnexport/stamping.py", "params[what] = _stamped_param(what, plan.views[what], layers[k], k)",
       "params[what] = _stamped_param(what, plan.views[what], layers[TEMPLATE], k)")], False,
     ["tests/test_pretrained_stamping.py", "-k", "whole_trace_does"]),
    ("the weights read as each is written, not pinned before the work beside the write starts",
     [("attnexport/weights.py", "    pinned = [_pinned(v.const_value) for v in values]",
       "    pinned = [None for v in values]")], False,
     ["tests/test_weights.py", "-k", "beside"]),
    ("a GGUF file's reader kept by its path alone, a changed file not read again",
     [(PRE + "model.py", "        key = (*_file_key(path), mode)", "        key = (os.path.realpath(path), mode)")],
     False, ["tests/test_pretrained_ggml.py", "-k", "parsed_once"]),
    ("the rewriter's shortcut fails rules of several outputs at their own op",
     [("attnexport/export.py", "if first is not None and first != node.op_identifier():",
       "if first is not None and first == node.op_identifier():")], False,
     ["tests/test_export.py", "-k", "shortcut"]),
    ("the Optimum client keeps the prompt's last token as a new one",
     [(PRE + "causal/clients.py", "tokens.append(out[0, len(ids):].tolist())",
       "tokens.append(out[0, len(ids) - 1:-1].tolist())")], False,
     ["tests/test_pretrained_causal_clients.py", "-k", "loop"]),
    ("the static form's write position not advanced after a generated token",
     [(PRE + "causal/forms.py", "        self.write_pos = self.write_pos + 1",
       "        self.write_pos = self.write_pos")], False,
     ["tests/test_pretrained_causal_check.py", "-k", "static and llama"]),
    ("a family exports a form it does not declare",
     [(PRE + "registry.py", "        return FM.form(name, self.forms)", "        return FM.form(name)")], False,
     ["tests/test_pretrained_registry.py", "-k", "own_forms"]),
    # --- the sentence encoders (2026-11-28) ----------------------------------------------------------
    ("an embedding's cosine without the norms",
     [(PRE + "retrieval.py", "    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-300)",
       "    return v")], False,
     ["tests/test_pretrained_encoders_measures.py", "-k", "cost_nothing or turned"]),
    ("retrieval ties as wide as the export's error, uncapped",
     [(PRE + "retrieval.py", "    tie = min(2 * error, budget.tie)", "    tie = 2 * error")], False,
     ["tests/test_pretrained_encoders_measures.py", "-k", "tie"]),
    ("an encoder's padding compared",
     [(PRE + "encoders/form.py", '        return {"last_hidden_state": mask[:, :, None],',
       '        return {"last_hidden_state": np.ones_like(mask)[:, :, None],')], False,
     ["tests/test_pretrained_encoders_form.py", "-k", "embed_form"]),
    ("mean pooling over the padding too",
     [(PRE + "encoders/form.py",
       "            pooled = (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)",
       "            pooled = states.mean(dim=1)")], False,
     ["tests/test_pretrained_encoders_measures.py", "-k", "dynamic_batch"]),
    # --- the encoders' ort flavour and per-layer cost (2026-11-29) -------------------------------------
    ("an encoder's fused attention without its padding mask",
     [(PRE + "fusions/encoder.py", "[x, weight, bias, MASK_INT32]", "[x, weight, bias]")], False,
     ["tests/test_pretrained_fusions_encoder.py", "-k", "packed"]),
    ("the reference evaluator's MultiHeadAttention ignores the key padding mask",
     [("attnexport/runtimes/reference.py", "        s = s + np.where(key_padding_mask[:, None, None, :] == 0,",
       "        s = s + 0 * np.where(key_padding_mask[:, None, None, :] == 0,")], False,
     ["tests/test_pretrained_fusions_encoder.py", "-k", "half"]),
    ("an encoder's per-layer costs with every layer quantized at once",
     [(PRE + "emulate.py", "        with as_file_holds(model, onnx_model, {group}), torch.no_grad():",
       "        with as_file_holds(model, onnx_model, None), torch.no_grad():")], False,
     ["tests/test_pretrained_encoders_measures.py", "-k", "each_layer"]),
    ("Whisper's decoder self-attention not causal",
     [(PRE + "whisper/graphs.py", "self_attention(layer.self_attn, layer.self_attn_layer_norm(x), True,",
       "self_attention(layer.self_attn, layer.self_attn_layer_norm(x), False,")], False,
     ["tests/test_pretrained_whisper_export.py", "-k", "writes_the_folder"]),
    ("Whisper's positions not offset by the past",
     [(PRE + "whisper/graphs.py",
       "        positions = d.embed_positions.weight[past_len:past_len + input_ids.shape[1]]",
       "        positions = d.embed_positions.weight[:input_ids.shape[1]]")], False,
     ["tests/test_pretrained_whisper_export.py", "-k", "writes_the_folder"]),
    ("the log-mel window symmetric, not periodic",
     [(PRE + "whisper/audio.py", "np.arange(N_FFT) / N_FFT)", "np.arange(N_FFT) / (N_FFT - 1))")],
     False, ["tests/test_pretrained_whisper_audio.py", "-k", "log_mel"]),
    ("the merged decoder's branches swapped",
     [(PRE + "encdec/graphs.py", "then_branch=then_branch,\n                            else_branch=else_branch)",
       "then_branch=else_branch,\n                            else_branch=then_branch)")],
     False, ["tests/test_pretrained_whisper_export.py", "-k", "writes_the_folder"]),
    ("a quantized Whisper's KL measured against itself",
     [(PRE + "encdec/cost.py", "kl.append(B.kl_per_position(reference[i], got))",
       "kl.append(B.kl_per_position(got, got))")], False,
     ["tests/test_pretrained_whisper_cost.py", "-k", "speech_budget and verify"]),
    ("a quantized Whisper's word errors not counted",
     [(PRE + "encdec/cost.py", "    return d[len(got)]", "    return 0")], False,
     ["tests/test_pretrained_encdec_cost.py", "-k", "word_errors"]),
    ("Whisper's tied head left float",
     [(PRE + "encdec/export.py", "rewrite=_tied_head if g != G.ENCODER else None", "rewrite=None")], False,
     ["tests/test_pretrained_whisper_cost.py", "-k", "matmulnbits"]),
    ("Whisper's static positions not offset by write_pos",
     [(PRE + "whisper/graphs.py", "weight[write_pos.reshape(-1, 1) + torch.arange(input_ids.shape[1])]",
       "weight[torch.arange(input_ids.shape[1])].expand(input_ids.shape[0], -1, -1)")],
     False, ["tests/test_pretrained_whisper_static.py", "-k", "written_in_place"]),
    ("the merged decoder checked with int8 activations",
     [("attnexport/runtimes/base.py", "                yield from all_nodes(g)", "                pass")], False,
     ["tests/test_pretrained_whisper_cost.py", "-k", "matmulnbits"]),
    # --- issue 77: the encoders', Whisper's and the reference evaluator's measures (2026-12-02) ------------
    ("an embedding's cosine taken without making the file's embedding unit length",
     [(PRE + "retrieval.py", "    g, w = unit(got), unit(want)",
       "    g, w = np.asarray(got, np.float64), unit(want)")],
     False, ["tests/test_pretrained_encoders_measures.py", "-k", "hand_worked"]),
    ("retrieval's k-th score read from the file's own ranking",
     [(PRE + "retrieval.py", "        kth = np.sort(scores_want[q])[::-1][TOP_K - 1]",
       "        kth = np.sort(scores_got[q])[::-1][TOP_K - 1]")], False,
     ["tests/test_pretrained_encoders_measures.py", "-k", "hand_worked"]),
    ("q4f16 judged by fp16's embedding budget",
     [(PRE + "retrieval.py", '_JUDGED_AS = {"q4f16": "int4"}', '_JUDGED_AS = {"q4f16": "fp16"}')], False,
     ["tests/test_pretrained_encoders_measures.py", "-k", "own_embedding_budget"]),
    ("mean pooling over the padding too",
     [(PRE + "encoders/measures.py", "        out = (states * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)",
       "        out = states.mean(axis=1)")], False,
     ["tests/test_pretrained_encoders_measures.py", "-k", "by_hand"]),
    ("Whisper's teacher-forced KL measured from the file to fp32",
     [(PRE + "encdec/cost.py", "kl.append(B.kl_per_position(reference[i], got))",
       "kl.append(B.kl_per_position(got, reference[i]))")], False,
     ["tests/test_pretrained_encdec_cost.py", "-k", "hand_worked"]),
    ("Whisper's WER over the file's words, not fp32's",
     [(PRE + "encdec/cost.py", "errors / max(sum(len(w) for _, w in words), 1)",
       "errors / max(sum(len(g) for g, _ in words), 1)")], False,
     ["tests/test_pretrained_encdec_cost.py", "-k", "hand_worked or word_errors"]),
    ("a near tie judged by fp32's lead over its least likely token",
     [(PRE + "encdec/cost.py", "    return float(chosen - allowed.max())",
       "    return float(chosen - allowed[np.isfinite(allowed)].min())")], False,
     ["tests/test_pretrained_encdec_cost.py", "-k", "near_tie or hand_worked"]),
    ("a near tie's clip judged as the file said it, not taken fp32's way",
     [(PRE + "encdec/cost.py", "        judged.append(taken)", "        judged.append(own)")], False,
     ["tests/test_pretrained_encdec_cost.py", "-k", "hand_worked"]),
    ("CTranslate2 asked for the start and the budget as its max_length (it decodes half)",
     [(PRE + "whisper/bench.py", "    return min(positions, max(2 * new_tokens, start + new_tokens))",
       "    return min(positions, start + new_tokens)")], False,
     ["tests/test_pretrained_anchors.py", "-k", "whisper_anchors"]),
    ("CTranslate2's int8 row loaded in float32",
     [(PRE + "whisper/bench.py", '(("fp32", "float32"), ("int8", "int8"))',
       '(("fp32", "float32"), ("int8", "float32"))')],
     False, ["tests/test_pretrained_anchors.py", "-k", "whisper_anchors"]),
    ("an encoder anchor's token states mean-pooled whatever the model says",
     [(PRE + "encoders/bench.py", "        return E.pooled(states, feed[\"attention_mask\"], pooling, normalize)",
       "        return E.pooled(states, feed[\"attention_mask\"], \"mean\", True)")], False,
     ["tests/test_pretrained_anchors.py", "-k", "states_alone"]),
    ("the reference's SkipLayerNormalization without its beta",
     [("attnexport/runtimes/reference.py", "out = (t64 - mean) * inv * gamma + (beta if beta is not None else 0)",
       "out = (t64 - mean) * inv * gamma")], False, ["tests/test_reference_contrib_ops.py"]),
    ("the reference's Attention without its bias",
     [("attnexport/runtimes/reference.py", "            qkv = x @ weights + (bias if bias is not None else 0)",
       "            qkv = x @ weights")], False, ["tests/test_reference_contrib_ops.py"]),
    ("the reference's padding mask filling the attended keys",
     [("attnexport/runtimes/reference.py", "np.where(key_padding_mask[:, None, None, :] == 0, mask_filter_value, 0.0)",
       "np.where(key_padding_mask[:, None, None, :] == 1, mask_filter_value, 0.0)")], False,
     ["tests/test_reference_contrib_ops.py"]),
    ("the reference's MultiHeadAttention bias split with k and v swapped",
     [("attnexport/runtimes/reference.py", "zip((query, key, value), np.split(bias, 3), strict=True)",
       "zip((query, value, key), np.split(bias, 3), strict=True)")], False, ["tests/test_reference_contrib_ops.py"]),
    ("a truncated WAV read as what it holds",
     [(PRE + "whisper/audio.py", "            if start + size > len(data):", "            if False:")], False,
     ["tests/test_pretrained_whisper_audio.py"]),
    ("Optimum's Whisper client given the folder as it was named (relative)",
     [(PRE + "clients.py", "    return str(Path(folder).resolve())", "    return str(folder)"),
      (PRE + "encdec/export.py",
       "        (staging / GRAPH_DIR / \"generation_config.json\").write_text(generation)\n", "")],
     False, ["tests/test_pretrained_whisper_clients.py", "-k", "last_position"]),
    # --- the text encoder-decoders (2026-12-02) ---------------------------------------------------------
    ("T5's decoder bias not counting the past",
     [(PRE + "seq2seq/graphs.py", "bias = _t5_bias(first, t, past + t, past)",
       "bias = _t5_bias(first, t, past + t, 0)")],
     False, ["tests/test_pretrained_seq2seq_graphs.py"]),
    ("Marian's positions not offset by the past",
     [(PRE + "seq2seq/graphs.py", "positions = table[past_len:past_len + input_ids.shape[1]]",
       "positions = table[:input_ids.shape[1]]")], False, ["tests/test_pretrained_seq2seq_graphs.py"]),
    ("Marian's cross-attention over the encoder's padding",
     [(PRE + "seq2seq/graphs.py", "L.cross_attention(layer.encoder_attn, x, ck, cv, mask)",
       "L.cross_attention(layer.encoder_attn, x, ck, cv)")], False, ["tests/test_pretrained_seq2seq_graphs.py"]),
    ("the end token not forced at the budget's last position",
     [(PRE + "encdec/graphs.py", "(tokens.forced_end and step == max_tokens - 1)",
       "(False and step == max_tokens - 1)")],
     False, ["tests/test_pretrained_seq2seq_check.py", "-k", "every_runtime and marian"]),
    ("a matrix written before the trace named a block past where it was written",
     [("attnexport/weights.py", "                        offset = hashed[0]\n",
       "                        offset = hashed[0] + alignment\n")], False,
     ["tests/test_weights.py", "-k", "before_the_trace"]),
    ("torch's run and each layer's alone taken from the wrong halves of the doubled feed",
     [(PRE + "reference.py", "return {n: a[:batch] for n, a in both.items()}, {i: t[batch:] for i, t in outs.items()}",
       "return {n: a[batch:] for n, a in both.items()}, {i: t[:batch] for i, t in outs.items()}")], False,
     ["tests/test_pretrained_layers.py", "-k", "one_run"]),
    ("an error of the forked reference taken for its result",
     [("attnexport/aside.py", "        if kind == \"error\":\n            raise value\n",
       "        if kind == \"error\":\n            return None\n")], False,
     ["tests/test_aside.py"]),
    ("the forked child runs on the parent's thread pools, which its fork left behind",
     [("attnexport/aside.py", "            return\n        _one_thread()\n", "            return\n")], False,
     ["tests/test_aside.py", "-k", "parallel_operators"]),
    ("the forked child's collector frees the parent's garbage",
     [("attnexport/aside.py", "        gc.freeze()\n", "")], False,
     ["tests/test_aside.py", "-k", "garbage_alone"]),
    ("a forked child asleep for good is waited for forever",
     [("attnexport/aside.py", "            elif time.monotonic() - since > STALL_SECONDS:\n",
       "            elif False:\n")], False,
     ["tests/test_aside.py", "-k", "stuck_on_a_lock", "--timeout", "60"]),
    ("a whole model's failing row localized whatever memory the fresh export takes",
     [(PRE + "check.py", "            if short is not None:\n                return Localization(",
       "            if False:\n                return Localization(")], False,
     ["tests/test_pretrained_causal_check.py", "-k", "divergence_names"]),
    ("a reshape kept without the view's translation",
     [("attnexport/decomposed.py", "    return {torch.ops.aten.reshape.default: aten_view}", "    return {}")], False,
     ["tests/test_decomposed.py"]),
    ("a composite op the retrace decomposes kept as it is",
     [("attnexport/decomposed.py", "            elif _is_cia_op(t) and not _is_preservable_cia_op(t):",
       "            elif False:")], False,
     ["tests/test_decomposed.py"]),
    ("a cast dropped as if it were to the same type",
     [("attnexport/decomposed.py", '            if t in to_ops and x.meta["val"].dtype != dtype:',
       "            if False:")], False, ["tests/test_decomposed.py"]),
    ("a forked child's work told to its parent's terminal",
     [("attnexport/usage.py", "        _COUNTS[:] = []\n", "")], False, ["tests/test_usage.py"]),
    ("the float64 model's run counted nowhere",
     [(PRE + "reference.py", "with torch.no_grad(), M.export_semantics(), mode, counting:",
       "with torch.no_grad(), M.export_semantics(), mode:")], False,
     ["tests/test_pretrained_reference.py", "-k", "terminal"]),
    ("a terminal's phase lines dropped while its bars are drawn",
     [("attnexport/render.py", "    usage.tell_phases(lambda p: bars.console.print(", "    (lambda p: bars.console.print(")],
     False, ["tests/test_render_progress.py"]),
]
SRC = pathlib.Path(__file__).resolve().parent.parent
# pytest's exit codes that mean a bug went uncaught: 0, every selected test passed; 4, a named test file or
# option not found; 5, no test selected (a `-k` that matches nothing catches nothing).
NOT_CAUGHT = (0, 4, 5)


def stale(bugs=BUGS) -> list[str]:
    """The entries that no longer apply to the checkout: an edit whose file or text is gone, a test
    file that does not exist."""
    out = []
    for name, edits, _, tests in bugs:
        for f, old, _ in edits:
            path = SRC / f
            if not path.exists() or old not in path.read_text():
                out.append(f"{name}: {f} no longer holds {old.strip()[:60]!r}")
        out += [f"{name}: no test file {t}" for t in tests if t.startswith("tests/") and not (SRC / t).exists()]
    return out


def main(only: list[str]) -> int:
    py = sys.executable
    results = []
    gone = stale()
    if gone:
        print("\n".join(gone))
        return 2
    for name, edits, rewrite, tests in BUGS:
        if only and not any(o in name for o in only):
            continue
        dst = pathlib.Path(tempfile.mkdtemp(prefix="attnexport-inject-")) / "checkout"

        def ignore(folder, names):
            skip = {".git", ".venv", ".ci-venv", "__pycache__"} | ({"models"} if pathlib.Path(folder) == SRC else set())
            return [n for n in names if n in skip]
        shutil.copytree(SRC, dst, ignore=ignore)
        for f, old, new in edits:
            p = dst / f
            p.write_text(p.read_text().replace(old, new))
        env = dict(os.environ, PYTHONPATH=str(dst))
        if rewrite:
            subprocess.run([py, "-m", "attnexport", "golden", "--write", "--dir", "golden"], cwd=dst, env=env,
                           check=True, capture_output=True)
        r = subprocess.run([py, "-m", "pytest", "-q", "-n", "2", "-p", "no:logging", *tests], cwd=dst, env=env,
                           capture_output=True, text=True)
        failed = [line.split(" - ")[0].replace("FAILED ", "") for line in r.stdout.splitlines()
                  if line.startswith("FAILED")]
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
        results.append((name, r.returncode, failed, last))
        print(f"{name}: rc={r.returncode} {last}", flush=True)
        for f in failed[:4]:
            print("   caught by", f, flush=True)
        shutil.rmtree(dst.parent, ignore_errors=True)
    missed = [name for name, rc, _, _ in results if rc in NOT_CAUGHT]
    print("every bug was caught" if not missed else f"NOT caught: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
