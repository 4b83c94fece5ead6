// Speech recognition with transformers.js (@huggingface/transformers in Node) from a deployment
// folder of a Whisper model that attnexport wrote (export --hf --deploy): the client's own
// automatic-speech-recognition pipeline (its processor computes the log-mel features, its model
// loads encoder_model.onnx and decoder_model_merged.onnx and generates greedily), nothing of
// attnexport's. Called by attnexport/pretrained/whisper/clients.py:
//
//   node transcribe.mjs REQUEST.json   (REQUEST: {folder, clips: [[float]] at 16 kHz, max_new_tokens, threads})
//
// prints one JSON line: {tokens: [[int]] (each clip's tokens after the start tokens, without the
// end token), texts: [string] (the pipeline's own answers), ms} or {error}.
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
  const asr = await pipeline('automatic-speech-recognition', path.basename(folder), {
    dtype: 'fp32', device: 'cpu', ...(req.threads ? { session_options: { intraOpNumThreads: req.threads } } : {}),
  });
  const end = asr.model.generation_config.eos_token_id;
  const tokens = [];
  const texts = [];
  const started = performance.now();
  for (const samples of req.clips) {
    const audio = Float32Array.from(samples);
    const inputs = await asr.processor(audio);
    const out = await asr.model.generate({ ...inputs, max_new_tokens: req.max_new_tokens });
    const ids = Array.from(out.tolist()[0], Number);
    const start = ids.findIndex((t) => t < end); // the first text token after the start tokens
    const spoken = start < 0 ? [] : ids.slice(start);
    tokens.push(spoken.filter((t) => t !== end));
    texts.push((await asr(audio, { max_new_tokens: req.max_new_tokens })).text);
  }
  return { tokens, texts, ms: performance.now() - started };
}

main().then((answer) => {
  process.stdout.write(JSON.stringify(answer) + '\n');
}).catch((e) => {
  process.stdout.write(JSON.stringify({ error: String(e && e.message ? e.message : e).split('\n')[0] }) + '\n');
  process.exitCode = 1;
});
