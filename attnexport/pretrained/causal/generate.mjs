// Greedy generation with transformers.js (@huggingface/transformers in Node) from a deployment folder
// that attnexport wrote (export --hf --deploy): the client's own tokenizer, model loading and
// generation loop, nothing of attnexport's. Called by attnexport/pretrained/causal/clients.py:
//
//   node generate.mjs REQUEST.json   (REQUEST: {folder, prompts: [text] | null, ids: [[id]] | null,
//                                      chats: [[{role, content}]] | null, new_tokens, threads})
//
// A chat is encoded as its users encode one: the tokenizer's chat template with the generation prompt.
//
// prints one JSON line: {prompt_ids: [[id]], tokens: [[id]] (the new ones), ms} or {error}.
// ATTNEXPORT_JS_HOME is the folder holding node_modules.

import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const require = createRequire(path.join(process.env.ATTNEXPORT_JS_HOME, 'package.json'));

async function main() {
  const req = JSON.parse(fs.readFileSync(process.argv[2]));
  const tjs = await import(pathToFileURL(require.resolve('@huggingface/transformers')).href);
  const { AutoModelForCausalLM, AutoTokenizer, Tensor, env } = tjs;
  const folder = path.resolve(req.folder);
  env.allowRemoteModels = false; // the folder on disk, never the Hub
  env.localModelPath = path.dirname(folder);
  env.useBrowserCache = false;
  const name = path.basename(folder);
  const model = await AutoModelForCausalLM.from_pretrained(name, {
    dtype: 'fp32', device: 'cpu', ...(req.threads ? { session_options: { intraOpNumThreads: req.threads } } : {}),
    // The weights beside the graph (export --external-data: onnx/model.onnx_data), where they are.
    use_external_data_format: fs.existsSync(path.join(folder, 'onnx', 'model.onnx_data')),
  });
  const tokenizer = req.prompts || req.chats ? await AutoTokenizer.from_pretrained(name) : null;
  const promptIds = [];
  const tokens = [];
  const started = performance.now();
  const count = (req.prompts || req.chats || req.ids).length;
  for (let i = 0; i < count; i++) {
    let ids;
    if (req.chats) {
      const encoded = tokenizer.apply_chat_template(req.chats[i], { add_generation_prompt: true, return_tensor: false });
      ids = Array.from(encoded.input_ids ?? encoded, Number); // an encoding, or the ids alone
    } else {
      ids = req.prompts ? Array.from(tokenizer(req.prompts[i]).input_ids.data, Number) : req.ids[i];
    }
    promptIds.push(ids);
    const input = new Tensor('int64', BigInt64Array.from(ids.map(BigInt)), [1, ids.length]);
    const mask = new Tensor('int64', new BigInt64Array(ids.length).fill(1n), [1, ids.length]);
    // Greedy, exactly new_tokens tokens: no end-of-sequence stop (eos_token_id set to no token).
    const out = await model.generate({
      input_ids: input, attention_mask: mask, max_new_tokens: req.new_tokens, min_new_tokens: 0,
      do_sample: false, eos_token_id: [], num_beams: 1,
    });
    tokens.push(Array.from(out.data, Number).slice(ids.length));
  }
  return { prompt_ids: promptIds, tokens, ms: performance.now() - started };
}

main().then((answer) => {
  process.stdout.write(JSON.stringify(answer) + '\n');
}).catch((e) => {
  process.stdout.write(JSON.stringify({ error: String(e && e.message ? e.message : e).split('\n')[0] }) + '\n');
  process.exitCode = 1;
});
