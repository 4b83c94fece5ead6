// attnexport's bridge to ONNX Runtime where apps deploy it: onnxruntime-node in this process, and
// onnxruntime-web's WASM and WebGPU backends in a headless Chromium driven by playwright-core.
//
// Python (attnexport/runtimes/js.py) starts one bridge per run and sends requests on stdin. Requests
// and answers are frames alike: 4 bytes of little-endian length and that many bytes of JSON, then 4
// bytes of length and a binary part (a model's bytes, or the tensors'). A tensor travels as {dtype,
// dims, offset, nbytes}: its little-endian bytes at `offset` in the frame's binary part. A feed may
// instead be {ref: NAME}: the session's own output NAME of its last run, kept here, so a cache that
// goes back and forth between steps (hundreds of MB a step for a long static buffer) is not sent
// back (the browser's page keeps its sessions' last outputs itself). Requests:
//   {op: "load", runtime, optimize, threads} + the model's bytes -> {id, inputs, outputs, placement, adapter}
//   {op: "run", id, feeds} + the tensors                    -> {outputs: {name: tensor}} + the tensors
//   {op: "time", id, feeds, runs} + the tensors             -> {ms: [one per run]}
//   {op: "release", id}, {op: "quit"}
// An error answers {error: "one line"}. The page is served from 127.0.0.1 only.
//
// ATTNEXPORT_JS_HOME is the folder holding node_modules (attnexport installs the pinned packages
// there); ATTNEXPORT_CHROMIUM the browser to drive.

import { createRequire } from 'node:module';
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const home = process.env.ATTNEXPORT_JS_HOME;
const require = createRequire(path.join(home, 'package.json'));
const here = path.dirname(fileURLToPath(import.meta.url));

// A package's folder and version (onnxruntime-web exports no package.json subpath).
function packageOf(name) {
  let dir = path.dirname(require.resolve(name));
  while (!fs.existsSync(path.join(dir, 'package.json')) ||
         JSON.parse(fs.readFileSync(path.join(dir, 'package.json'))).name !== name) dir = path.dirname(dir);
  return { dir, version: JSON.parse(fs.readFileSync(path.join(dir, 'package.json'))).version };
}

const sessions = new Map(); // id -> {runtime, session (node) | page-side id (browser)}
let nextId = 1;

// --- tensors --------------------------------------------------------------------------------------

const ARRAYS = {
  float32: Float32Array, float16: Uint16Array, int64: BigInt64Array, int32: Int32Array, bool: Uint8Array,
  uint8: Uint8Array, int8: Int8Array, float64: Float64Array,
};

function bytesOf(t, binary) { // a feed's bytes: its slice of the request's binary part
  return binary.subarray(t.offset, t.offset + t.nbytes);
}

function decode(ort, t, binary) {
  const bytes = bytesOf(t, binary);
  const Array_ = ARRAYS[t.dtype];
  const copy = new Uint8Array(bytes.length); // aligned for the typed array
  copy.set(bytes);
  return new ort.Tensor(t.dtype, new Array_(copy.buffer, 0, bytes.length / Array_.BYTES_PER_ELEMENT), t.dims);
}

// Tensors into an answer: each one's {dtype, dims, offset, nbytes}, its bytes appended to `parts`.
function encode(dtype, dims, bytes, parts) {
  const offset = parts.reduce((n, b) => n + b.length, 0);
  parts.push(bytes);
  return { dtype, dims: Array.from(dims), offset, nbytes: bytes.length };
}

function tensorBytes(tensor) {
  const d = tensor.data;
  return Buffer.from(d.buffer, d.byteOffset, d.byteLength);
}

// A page gets a request's tensors as they came (the request's binary part) and resolves a {ref} feed
// to its session's last output, which it keeps. Large tensors travel as bytes over HTTP on 127.0.0.1
// (the page fetches /feeds/TOKEN and posts its outputs to /outputs/TOKEN): as base64 text through the
// browser's debugging protocol a static cache cost seconds a step. Small ones travel with the call
// itself, which costs less than two requests. The outputs are posted in pieces of at most CHUNK bytes
// (/outputs/TOKEN/PIECE): the browser reports each request's body to its debugging protocol, and
// Playwright reads each report as one string, which Node caps at 512M characters; a static step of
// Gemma-3-270M at batch 3 posts some 90 MB of outputs, whose report passed the cap and ended this
// process ("Cannot create a string longer than 0x1fffffe8 characters"). A byte takes at most six
// characters there (an escaped control byte), so 8 MB pieces stay far below it.
const INLINE = 64 * 1024;
const CHUNK = 8 * 1024 * 1024;
let nextToken = 1;

async function runOnPage(op, id, feeds, binary, extra = {}) {
  const token = nextToken++;
  const args = { op, id, token, feeds, inline: INLINE, chunk: CHUNK, ...extra };
  if (binary.length <= INLINE) args.data = Buffer.from(binary).toString('base64');
  else browser.feeds.set(token, binary);
  try {
    const answer = await browser.page.evaluate((a) => window.attnexport[a.op](a), args);
    if (op !== 'run') return answer;
    const pieces = browser.outputs.get(token);
    const body = answer.data !== undefined ? Buffer.from(answer.data, 'base64')
      : pieces && pieces.length === answer.pieces && !pieces.includes(undefined) ? Buffer.concat(pieces) : null;
    if (!body) throw new Error('the page posted no outputs, or not all of them');
    return { outputs: answer.outputs, body };
  } finally {
    browser.feeds.delete(token);
    browser.outputs.delete(token);
  }
}

function refOf(last, name) {
  if (!last || !(name in last)) throw new Error(`no output ${name} kept from the session's last run`);
  return last[name];
}

// --- Node: onnxruntime-node -------------------------------------------------------------------------

let ortNode = null;

async function loadNode(req) {
  ortNode = ortNode || require('onnxruntime-node');
  const options = { graphOptimizationLevel: req.optimize ? req.level || 'all' : 'disabled', logSeverityLevel: 3 };
  if (req.threads) options.intraOpNumThreads = req.threads;
  const session = await ortNode.InferenceSession.create(req.binary, options);
  const id = nextId++;
  sessions.set(id, { runtime: 'ort-node', session });
  return { id, inputs: session.inputNames, outputs: session.outputNames,
           placement: { CPUExecutionProvider: ['*'] }, version: packageOf('onnxruntime-node').version };
}

function nodeFeeds(s, feeds, binary) {
  const given = {};
  for (const [name, t] of Object.entries(feeds)) {
    given[name] = t.ref !== undefined ? refOf(s.last, t.ref) : decode(ortNode, t, binary);
  }
  return given;
}

async function runNode(s, feeds, binary, parts) {
  const out = await s.session.run(nodeFeeds(s, feeds, binary));
  s.last = out;
  const result = {};
  for (const name of s.session.outputNames) {
    result[name] = encode(out[name].type, out[name].dims, tensorBytes(out[name]), parts);
  }
  return result;
}

async function timeNode(s, feeds, binary, runs) {
  const given = nodeFeeds(s, feeds, binary);
  const ms = [];
  for (let i = 0; i < runs; i++) {
    const t0 = performance.now();
    await s.session.run(given);
    ms.push(performance.now() - t0);
  }
  return ms;
}

// --- the browser: onnxruntime-web in headless Chromium ------------------------------------------------

let browser = null; // {page, server, models: Map(id -> bytes), adapter}

async function startBrowser() {
  const { chromium } = require('playwright-core');
  const web = packageOf('onnxruntime-web');
  const dist = path.join(web.dir, 'dist');
  const models = new Map();
  const feeds = new Map(); // token -> a request's binary part, which the page fetches
  const outputs = new Map(); // token -> the outputs' bytes the page posted
  // Cross-origin isolation: WASM threads need SharedArrayBuffer.
  const isolated = { 'Cross-Origin-Opener-Policy': 'same-origin', 'Cross-Origin-Embedder-Policy': 'require-corp',
                     'Cache-Control': 'no-store' };
  const server = http.createServer((req, res) => {
    const url = new URL(req.url, 'http://127.0.0.1');
    let body = null;
    let type = 'application/octet-stream';
    if (url.pathname === '/') {
      body = fs.readFileSync(path.join(here, 'page.html'));
      type = 'text/html';
    } else if (url.pathname === '/page.mjs') {
      body = fs.readFileSync(path.join(here, 'page.mjs'));
      type = 'text/javascript';
    } else if (url.pathname.startsWith('/ort/')) {
      const file = path.join(dist, path.basename(url.pathname));
      if (fs.existsSync(file)) {
        body = fs.readFileSync(file);
        type = file.endsWith('.wasm') ? 'application/wasm' : 'text/javascript';
      }
    } else if (url.pathname.startsWith('/model/')) {
      body = models.get(Number(path.basename(url.pathname))) || null;
    } else if (url.pathname.startsWith('/feeds/')) {
      body = feeds.get(Number(path.basename(url.pathname))) || null;
    } else if (url.pathname.startsWith('/outputs/') && req.method === 'POST') {
      const chunks = [];
      // A post cut short (the page's renderer ended mid-way) is an error of the request, never of this
      // process: the run that waited for it fails, saying the page crashed.
      req.on('error', () => {});
      req.on('data', (c) => chunks.push(c));
      req.on('end', () => { // /outputs/TOKEN/PIECE: a run's outputs, a piece at a time
        const [token, piece] = url.pathname.split('/').slice(2).map(Number);
        if (!outputs.has(token)) outputs.set(token, []);
        outputs.get(token)[piece] = Buffer.concat(chunks);
        res.writeHead(204, isolated);
        res.end();
      });
      return;
    }
    if (body === null) {
      res.writeHead(404, isolated);
      res.end();
      return;
    }
    res.writeHead(200, { ...isolated, 'content-type': type });
    res.end(body);
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const launched = await chromium.launch({
    executablePath: process.env.ATTNEXPORT_CHROMIUM, headless: true,
    args: ['--no-sandbox', '--enable-unsafe-webgpu', '--disable-background-networking', '--disable-component-update',
           '--no-first-run', '--disable-sync', '--disable-quic', '--disable-extensions'],
  });
  const page = await launched.newPage();
  const logs = [];
  page.on('console', (m) => { logs.push(m.text()); if (logs.length > 100) logs.splice(0, logs.length - 100); });
  page.on('pageerror', (e) => logs.push(`page error: ${e.message}`));
  // The renderer ended (killed for memory, or crashed): every session on the page is gone with it.
  // The browser is closed and its sessions forgotten when the request that met it fails (`handle`),
  // so the next load starts a new one.
  page.on('crash', () => { if (browser) browser.crashed = true; });
  await page.goto(`http://127.0.0.1:${server.address().port}/`);
  await page.waitForFunction(() => window.attnexport !== undefined, null, { timeout: 60000 });
  const adapter = await page.evaluate(() => window.attnexport.adapter());
  browser = { launched, page, server, models, feeds, outputs, adapter, logs, version: web.version };
  return browser;
}

async function loadBrowser(req) {
  const b = browser || await startBrowser();
  const ep = req.runtime === 'ort-webgpu' ? 'webgpu' : 'wasm';
  if (ep === 'webgpu' && !b.adapter.available) {
    throw new Error(`Chromium has no WebGPU adapter here: ${b.adapter.reason}`);
  }
  const id = nextId++;
  b.models.set(id, req.binary);
  try {
    const info = await b.page.evaluate((a) => window.attnexport.load(a),
                                       { id, ep, optimize: req.optimize, threads: req.threads || 0,
                                         webgpu: b.adapter.available });
    sessions.set(id, { runtime: req.runtime });
    return { id, ...info, adapter: ep === 'webgpu' ? b.adapter : null, version: b.version };
  } finally {
    b.models.delete(id);
  }
}

// --- the loop ----------------------------------------------------------------------------------------

async function handle(req) {
  if (req.op === 'hello') return { node: process.version };
  if (req.op === 'load') return req.runtime === 'ort-node' ? loadNode(req) : loadBrowser(req);
  const s = sessions.get(req.id);
  if (req.op === 'release') {
    sessions.delete(req.id);
    if (s && s.runtime !== 'ort-node') await browser.page.evaluate((id) => window.attnexport.release(id), req.id);
    return {};
  }
  if (!s) throw new Error(`no session ${req.id}`);
  if (req.op === 'run') {
    const parts = [];
    if (s.runtime === 'ort-node') return { outputs: await runNode(s, req.feeds, req.binary, parts), parts };
    const got = await runOnPage('run', req.id, req.feeds, req.binary);
    parts.push(got.body); // the outputs' offsets are into the posted bytes, which become the answer's binary part
    return { outputs: got.outputs, parts };
  }
  if (req.op === 'time') {
    if (s.runtime === 'ort-node') return { ms: await timeNode(s, req.feeds, req.binary, req.runs) };
    return { ms: await runOnPage('time', req.id, req.feeds, req.binary, { runs: req.runs }) };
  }
  throw new Error(`unknown request ${req.op}`);
}

function send(message) { // an answer's `parts` (tensors' bytes) travel as its binary part
  const parts = message.parts || [];
  delete message.parts;
  const body = Buffer.from(JSON.stringify(message));
  const head = Buffer.alloc(4);
  head.writeUInt32LE(body.length, 0);
  const tail = Buffer.alloc(4);
  tail.writeUInt32LE(parts.reduce((n, b) => n + b.length, 0), 0);
  process.stdout.write(Buffer.concat([head, body, tail]));
  for (const b of parts) process.stdout.write(b);
}

async function dropBrowser() { // after a crash: the browser closed, its sessions forgotten
  const gone = browser;
  browser = null;
  for (const [id, s] of sessions) if (s.runtime !== 'ort-node') sessions.delete(id);
  await gone.launched.close().catch(() => {});
  gone.server.close();
}

async function close() {
  if (browser) {
    await browser.launched.close().catch(() => {});
    browser.server.close();
  }
  process.exit(0);
}

// A request frame is the JSON's length and the JSON, then the length of a binary part and its bytes
// (a model to load; empty otherwise). Chunks are kept as they come and joined once a whole frame is
// there: joining at every chunk would copy a model of hundreds of MB thousands of times.
let chunks = [];
let buffered = 0;
let queue = Promise.resolve();

function peek(count) { // the first `count` bytes buffered
  if (chunks[0].length < count) chunks = [Buffer.concat(chunks)];
  return chunks[0].subarray(0, count);
}

process.stdin.on('data', (chunk) => {
  chunks.push(chunk);
  buffered += chunk.length;
  while (buffered >= 4) {
    const n = peek(4).readUInt32LE(0);
    if (buffered < 8 + n) break;
    const m = peek(8 + n).readUInt32LE(4 + n);
    if (buffered < 8 + n + m) break;
    const pending = Buffer.concat(chunks);
    const req = JSON.parse(pending.subarray(4, 4 + n).toString());
    req.binary = pending.subarray(8 + n, 8 + n + m);
    const rest = pending.subarray(8 + n + m);
    chunks = rest.length ? [rest] : [];
    buffered = rest.length;
    queue = queue.then(async () => {
      if (req.op === 'quit') return close();
      try {
        send(await handle(req));
      } catch (e) {
        const recent = browser ? browser.logs.slice(-3).join(' | ') : '';
        let error = String(e && e.message ? e.message : e).split('\n')[0];
        if (browser && browser.crashed) {
          error = `the browser's page crashed (its renderer ended: out of memory?), and every session on it with it; `
            + `the next model loaded starts a new browser (${error})`;
          await dropBrowser();
        }
        send({ error, log: recent });
      }
    });
  }
});
process.stdin.on('end', () => { queue.then(close); });
