// Sentence embeddings with transformers.js (@huggingface/transformers in Node) from a deployment
// folder of a sentence encoder that attnexport wrote (export --hf --deploy): the client's own
// tokenizer, model loading and feature-extraction pipeline (its pooling and normalisation), nothing
// of attnexport's. Called by attnexport/pretrained/encoders/clients.py:
//
//   node embed.mjs REQUEST.json   (REQUEST: {folder, texts: [text], pooling: mean|cls, normalize, threads})
//
// prints one JSON line: {embeddings: [[float]], ms} or {error}.
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
  const extractor = await pipeline('feature-extraction', path.basename(folder), {
    dtype: 'fp32', device: 'cpu', ...(req.threads ? { session_options: { intraOpNumThreads: req.threads } } : {}),
    // The weights beside the graph (export --external-data: onnx/model.onnx_data), where they are.
    use_external_data_format: fs.existsSync(path.join(folder, 'onnx', 'model.onnx_data')),
  });
  const started = performance.now();
  const out = await extractor(req.texts, { pooling: req.pooling, normalize: req.normalize });
  return { embeddings: out.tolist(), ms: performance.now() - started };
}

main().then((answer) => {
  process.stdout.write(JSON.stringify(answer) + '\n');
}).catch((e) => {
  process.stdout.write(JSON.stringify({ error: String(e && e.message ? e.message : e).split('\n')[0] }) + '\n');
  process.exitCode = 1;
});
