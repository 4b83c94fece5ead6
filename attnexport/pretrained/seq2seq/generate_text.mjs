// Text-to-text generation with transformers.js (@huggingface/transformers in Node) from a deployment
// folder of a text encoder-decoder (T5, Marian) that attnexport wrote (export --hf --deploy): the
// client's own tokenizer and model (encoder_model.onnx, decoder_model_merged.onnx), generating
// greedily with the folder's generation config, nothing of attnexport's. Called by
// attnexport/pretrained/seq2seq/clients.py:
//
//   node generate_text.mjs REQUEST.json   (REQUEST: {folder, texts: [string], max_new_tokens, threads})
//
// prints one JSON line: {tokens: [[int]] (each text's tokens after the start token, without the end
// token), texts: [string] (the text2text-generation pipeline's own answers), ms} or {error}.
// ATTNEXPORT_JS_HOME is the folder holding node_modules.

import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const require = createRequire(path.join(process.env.ATTNEXPORT_JS_HOME, 'package.json'));

async function main() {
  const req = JSON.parse(fs.readFileSync(process.argv[2]));
  const tjs = await import(pathToFileURL(require.resolve('@huggingface/transformers')).href);
  const { pipeline, env } = tjs;
  const folder = path.resolve(req.folder);
  env.allowRemoteModels = false; // the folder on disk, never the Hub
  env.localModelPath = path.dirname(folder);
  env.useBrowserCache = false;
  const generator = await pipeline('text2text-generation', path.basename(folder), {
    dtype: 'fp32', device: 'cpu', ...(req.threads ? { session_options: { intraOpNumThreads: req.threads } } : {}),
  });
  const config = generator.model.generation_config;
  const start = config.decoder_start_token_id;
  const end = Array.isArray(config.eos_token_id) ? config.eos_token_id[0] : config.eos_token_id;
  const tokens = [];
  const texts = [];
  const started = performance.now();
  for (const text of req.texts) {
    const inputs = await generator.tokenizer(text);
    const out = await generator.model.generate({ ...inputs, max_new_tokens: req.max_new_tokens, do_sample: false });
    let ids = Array.from(out.tolist()[0], Number);
    if (ids[0] === start) ids = ids.slice(1);
    const stop = ids.indexOf(end);
    tokens.push(stop < 0 ? ids : ids.slice(0, stop));
    texts.push((await generator(text, { max_new_tokens: req.max_new_tokens }))[0].generated_text);
  }
  return { tokens, texts, ms: performance.now() - started };
}

main().then((answer) => {
  process.stdout.write(JSON.stringify(answer) + '\n');
}).catch((e) => {
  process.stdout.write(JSON.stringify({ error: String(e && e.message ? e.message : e).split('\n')[0] }) + '\n');
  process.exitCode = 1;
});
