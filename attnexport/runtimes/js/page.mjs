// The browser side of bridge.mjs: onnxruntime-web sessions on the WASM or WebGPU backend, their
// tensors fetched from and posted to the bridge's server as bytes. window.attnexport = {adapter, load, run, time, release}.
import * as ort from '/ort/ort.all.min.mjs';

ort.env.wasm.wasmPaths = '/ort/';
const sessions = new Map();
let threadsSet = false;

// ONNX Runtime's own log (where each node was placed) reaches the console: kept while a session is made.
let captured = null;
for (const level of ['log', 'info', 'warn', 'error', 'debug']) {
  const original = console[level].bind(console);
  console[level] = (...args) => {
    if (captured) captured.push(args.map(String).join(' '));
    original(...args);
  };
}

const ARRAYS = {
  float32: Float32Array, float16: Uint16Array, int64: BigInt64Array, int32: Int32Array, bool: Uint8Array,
  uint8: Uint8Array, int8: Int8Array, float64: Float64Array,
};

function bytesOf(base64) { // a small request's bytes, sent with it
  const text = atob(base64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes.buffer;
}

function base64Of(parts) {
  let text = '';
  for (const bytes of parts) {
    for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(text);
}

// A request's feeds: {dtype, dims, offset, nbytes} into its bytes (fetched from the bridge as they
// came), or {ref: NAME}, the session's own output NAME of its last run, kept here.
async function feedsOf(a) {
  const entry = sessions.get(a.id);
  const bytes = a.data !== undefined ? bytesOf(a.data) : await (await fetch(`/feeds/${a.token}`)).arrayBuffer();
  const given = {};
  for (const [name, t] of Object.entries(a.feeds)) {
    if (t.ref !== undefined) {
      if (!entry.last || !(t.ref in entry.last)) throw new Error(`no output ${t.ref} kept from the session's last run`);
      given[name] = entry.last[t.ref];
      continue;
    }
    const Array_ = ARRAYS[t.dtype];
    const data = bytes.slice(t.offset, t.offset + t.nbytes); // a copy of its own: aligned for the typed array
    given[name] = new ort.Tensor(t.dtype, new Array_(data, 0, t.nbytes / Array_.BYTES_PER_ELEMENT), t.dims);
  }
  return given;
}

// "Node(s) placed on [EP]. Number of nodes: N" and the nodes below it, or "All nodes placed on [EP]".
function placementOf(lines) {
  const placement = {};
  let provider = null;
  for (const line of lines) {
    let m = line.match(/All nodes placed on \[(\w+)\]/);
    if (m) {
      placement[m[1]] = ['*'];
      provider = null;
      continue;
    }
    m = line.match(/Node\(s\) placed on \[(\w+)\]/);
    if (m) {
      provider = m[1];
      placement[provider] = [];
      continue;
    }
    m = line.match(/VerifyEachNodeIsAssignedToAnEp\]\s+(\S+) \((.*)\)\s*$/);
    if (m && provider) placement[provider].push(`${m[1]}:${m[2]}`);
    else if (!/VerifyEachNodeIsAssignedToAnEp/.test(line)) provider = null;
  }
  return placement;
}

async function adapter() {
  if (!navigator.gpu) return { available: false, reason: 'navigator.gpu is missing (is WebGPU enabled?)' };
  const a = await navigator.gpu.requestAdapter();
  if (!a) return { available: false, reason: 'navigator.gpu.requestAdapter() gave no adapter' };
  const info = a.info || {};
  return { available: true, vendor: info.vendor || '', architecture: info.architecture || '', device: info.device || '',
           description: info.description || '', fallback: Boolean(a.isFallbackAdapter ?? info.isFallbackAdapter) };
}

let webgpuReady = false;

async function load({ id, ep, optimize, threads, webgpu }) {
  if (!threadsSet) { // the WASM backend takes its thread count before its first session only
    if (threads) ort.env.wasm.numThreads = threads;
    threadsSet = true;
  }
  const bytes = new Uint8Array(await (await fetch(`/model/${id}`)).arrayBuffer());
  if (ep === 'wasm' && webgpu && !webgpuReady) {
    // onnxruntime-web 1.30: a WebGPU session made after the page's first WASM session fails its
    // MatMul ("no GPU data for input"); a WebGPU session made first, then released, prevents it.
    // A model WebGPU cannot load (8-bit MatMulNBits: its kernel takes 2 and 4 bits) is made on WASM
    // all the same: the priming is for a later WebGPU session, which such a model cannot have anyway.
    try {
      await (await ort.InferenceSession.create(bytes, { executionProviders: ['webgpu'], logSeverityLevel: 3 })).release();
    } catch {
      // nothing to prime: the WASM session below is what was asked for
    }
  }
  if (ep === 'webgpu') webgpuReady = true;
  captured = [];
  let lines;
  let session;
  try {
    session = await ort.InferenceSession.create(bytes, {
      executionProviders: [ep], graphOptimizationLevel: optimize ? 'all' : 'disabled',
      logSeverityLevel: ep === 'webgpu' ? 0 : 3, logVerbosityLevel: 0,
    });
  } finally {
    lines = captured;
    captured = null;
  }
  sessions.set(id, { session, last: null });
  return { inputs: session.inputNames, outputs: session.outputNames, placement: placementOf(lines),
           threads: ort.env.wasm.numThreads, isolated: self.crossOriginIsolated };
}

// One run: its outputs kept (a later feed may name them) and their bytes, in one body, posted to the
// bridge or (small) returned as base64; returns {outputs: each one's {dtype, dims, offset, nbytes} into
// that body, data}.
async function run(a) {
  const entry = sessions.get(a.id);
  const out = await entry.session.run(await feedsOf(a));
  entry.last = out;
  const result = {};
  const parts = [];
  let offset = 0;
  for (const name of entry.session.outputNames) {
    const d = out[name].data;
    const bytes = new Uint8Array(d.buffer, d.byteOffset, d.byteLength);
    result[name] = { dtype: out[name].type, dims: Array.from(out[name].dims), offset, nbytes: bytes.length };
    parts.push(bytes);
    offset += bytes.length;
  }
  if (offset <= a.inline) return { outputs: result, data: base64Of(parts) };
  // One buffer, not a Blob: the browser keeps a Blob's bytes in its blob storage until the page's
  // garbage collector lets the Blob go, and a generation's posted logits (5 MB a step of a 262,144-token
  // vocabulary) filled it before that (net::ERR_BLOB_OUT_OF_MEMORY).
  const body = new Uint8Array(offset);
  offset = 0;
  for (const bytes of parts) {
    body.set(bytes, offset);
    offset += bytes.length;
  }
  // In pieces of at most `a.chunk` bytes: the browser reports each request's body to its debugging
  // protocol as one string, which must stay below Node's cap on a string (bridge.mjs, CHUNK).
  let pieces = 0;
  for (let start = 0; start < offset; start += a.chunk) {
    const piece = body.subarray(start, Math.min(offset, start + a.chunk));
    const posted = await fetch(`/outputs/${a.token}/${pieces++}`, { method: 'POST', body: piece });
    if (!posted.ok) throw new Error(`posting the outputs failed: ${posted.status}`);
  }
  return { outputs: result, pieces };
}

async function time(a) {
  const entry = sessions.get(a.id);
  const given = await feedsOf(a);
  const ms = [];
  for (let i = 0; i < a.runs; i++) {
    const t0 = performance.now();
    await entry.session.run(given);
    ms.push(performance.now() - t0);
  }
  return ms;
}

async function release(id) {
  const entry = sessions.get(id);
  sessions.delete(id);
  if (entry) await entry.session.release();
}

window.attnexport = { adapter, load, run, time, release };
