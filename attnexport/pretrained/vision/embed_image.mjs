// Image embeddings with transformers.js (@huggingface/transformers in Node) from a deployment folder
// of a vision transformer that attnexport wrote (export --hf --deploy): the client's own image
// processor (the folder's preprocessor_config.json), model loading and image-feature-extraction
// pipeline (its pooled output), nothing of attnexport's. Called by attnexport/pretrained/vision/clients.py:
//
//   node embed_image.mjs REQUEST.json   (REQUEST: {folder, images: [{height, width, data: [uint8 RGB]}], threads})
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
  const { pipeline, env, RawImage } = tjs;
  const folder = path.resolve(req.folder);
  env.allowRemoteModels = false; // the folder on disk, never the Hub
  env.localModelPath = path.dirname(folder);
  env.useBrowserCache = false;
  const extractor = await pipeline('image-feature-extraction', path.basename(folder), {
    dtype: 'fp32', device: 'cpu', ...(req.threads ? { session_options: { intraOpNumThreads: req.threads } } : {}),
    // The weights beside the graph (export --external-data: onnx/model.onnx_data), where they are.
    use_external_data_format: fs.existsSync(path.join(folder, 'onnx', 'model.onnx_data')),
  });
  const started = performance.now();
  const embeddings = [];
  for (const image of req.images) {
    const raw = new RawImage(Uint8ClampedArray.from(image.data), image.width, image.height, 3);
    const out = await extractor(raw, { pool: true });
    embeddings.push(Array.from(out.data, Number));
  }
  return { embeddings, ms: performance.now() - started };
}

main().then((answer) => {
  process.stdout.write(JSON.stringify(answer) + '\n');
}).catch((e) => {
  process.stdout.write(JSON.stringify({ error: String(e && e.message ? e.message : e).split('\n')[0] }) + '\n');
  process.exitCode = 1;
});
