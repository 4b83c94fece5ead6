// The browser side of bridge.mjs: onnxruntime-web sessions on the WASM or WebGPU backend, fed and
// read as base64 tensors. window.attnexport = {adapter, load, run, time, release}.
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

function decode(t) {
  const text = atob(t.data);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  const Array_ = ARRAYS[t.dtype];
  return new ort.Tensor(t.dtype, new Array_(bytes.buffer, 0, bytes.length / Array_.BYTES_PER_ELEMENT), t.dims);
}

function encode(tensor) {
  const d = tensor.data;
  const bytes = new Uint8Array(d.buffer, d.byteOffset, d.byteLength);
  let text = '';
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return { dtype: tensor.type, dims: Array.from(tensor.dims), data: btoa(text) };
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
  sessions.set(id, session);
  return { inputs: session.inputNames, outputs: session.outputNames, placement: placementOf(lines),
           threads: ort.env.wasm.numThreads, isolated: self.crossOriginIsolated };
}

async function run(id, feeds) {
  const session = sessions.get(id);
  const given = {};
  for (const [name, t] of Object.entries(feeds)) given[name] = decode(t);
  const out = await session.run(given);
  const result = {};
  for (const name of session.outputNames) result[name] = encode(out[name]);
  return result;
}

async function time(id, feeds, runs) {
  const session = sessions.get(id);
  const given = {};
  for (const [name, t] of Object.entries(feeds)) given[name] = decode(t);
  const ms = [];
  for (let i = 0; i < runs; i++) {
    const t0 = performance.now();
    await session.run(given);
    ms.push(performance.now() - t0);
  }
  return ms;
}

async function release(id) {
  const session = sessions.get(id);
  sessions.delete(id);
  if (session) await session.release();
}

window.attnexport = { adapter, load, run, time, release };
