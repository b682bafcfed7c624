// The ttsserve playground: plain JS, no dependencies. Every URL is relative, so the page also works behind a
// proxy that serves the API under a path prefix.
"use strict";

const RATE = 24000; // the server's native rate: response_format "pcm" is 24 kHz, 16-bit little-endian, mono
const $ = (id) => document.getElementById(id);
const state = { voicesLoaded: null, lastRequest: null, pcmChunks: [], clip: null, recorder: null, abort: null };

// ---- HTTP helpers ----------------------------------------------------------------------------------
function authHeaders(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function errorText(r) {
  const body = await r.text();
  try {
    const j = JSON.parse(body);
    return `${r.status}: ${(j.error && j.error.message) || body}`;
  } catch (_) {
    return `${r.status} ${r.statusText}: ${body.slice(0, 200)}`;
  }
}

async function getJSON(path) {
  const r = await fetch(path, { headers: authHeaders() });
  if (!r.ok) throw new Error(await errorText(r));
  return r.json();
}

function setStatus(id, text, kind = "") {
  const el = $(id);
  el.textContent = text;
  el.className = `status ${kind}`;
}

// ---- voices and models -----------------------------------------------------------------------------
async function loadVoices(select) {
  const list = await getJSON("v1/audio/voices");
  const voiceSelect = $("voice");
  const keep = select || voiceSelect.value;
  voiceSelect.textContent = "";
  const groups = { builtin: "Built-in", saved: "Saved" };
  for (const [kind, label] of Object.entries(groups)) {
    const voices = list.data.filter((v) => (v.type === "builtin") === (kind === "builtin"));
    if (!voices.length) continue;
    const group = document.createElement("optgroup");
    group.label = label;
    for (const v of voices) group.append(new Option(v.name, v.name));
    voiceSelect.append(group);
  }
  if (keep && [...voiceSelect.options].some((o) => o.value === keep)) voiceSelect.value = keep;
  return list.data;
}

async function loadModels() {
  const list = await getJSON("v1/models");
  const sel = $("model");
  sel.textContent = "";
  for (const m of list.data) sel.append(new Option(m.id, m.id));
}

// ---- streamed playback -----------------------------------------------------------------------------
// Each chunk of PCM becomes an AudioBuffer scheduled right after the previous one, so sound starts with the
// first chunk while the rest is still being generated.
const player = {
  ctx: null, next: 0, sources: new Set(), played: 0, received: 0,
  async start() {
    if (!this.ctx) this.ctx = new AudioContext({ sampleRate: RATE });
    await this.ctx.resume();
    this.stop();
    this.next = this.ctx.currentTime + 0.05;
    this.played = 0;
    this.received = 0;
    this.show();
  },
  push(samples) {
    const buf = this.ctx.createBuffer(1, samples.length, RATE);
    buf.copyToChannel(samples, 0);
    const src = this.ctx.createBufferSource();
    src.buffer = buf;
    src.connect(this.ctx.destination);
    const at = Math.max(this.next, this.ctx.currentTime + 0.01);
    src.start(at);
    this.next = at + buf.duration;
    this.sources.add(src);
    this.received += samples.length;
    src.onended = () => {
      if (!this.sources.delete(src)) return; // stopped, not played out
      this.played += samples.length;
      this.show();
    };
    this.show();
  },
  stop() {
    const sources = [...this.sources];
    this.sources.clear();
    for (const s of sources) s.stop();
  },
  idle() { return this.sources.size === 0; },
  show() {
    $("played-samples").textContent = String(this.played);
    $("received-samples").textContent = String(this.received);
  },
};

function speechBody(format) {
  const body = { model: $("model").value, input: $("text").value, voice: $("voice").value, response_format: format };
  const speed = parseFloat($("speed").value);
  if (!Number.isNaN(speed)) body.speed = speed;
  const temp = parseFloat($("temperature").value);
  if (!Number.isNaN(temp)) body.temperature = temp;
  // A seed is always sent (a random one when the field is empty) so that a download in another format repeats
  // the same audio.
  const seed = $("seed").value.trim();
  body.seed = seed === "" ? Math.floor(Math.random() * 2 ** 31) : parseInt(seed, 10);
  return body;
}

async function synthesizeAndPlay() {
  if (state.abort) state.abort.abort();
  const abort = (state.abort = new AbortController());
  await player.start();
  $("download").disabled = true;
  $("first-audio").textContent = "–";
  const body = speechBody("pcm");
  $("seed-used").textContent = String(body.seed);
  state.lastRequest = body;
  state.pcmChunks = [];
  setStatus("speak-status", "synthesizing…");
  const t0 = performance.now();
  const r = await fetch("v1/audio/speech", {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify(body),
    signal: abort.signal,
  });
  if (!r.ok) throw new Error(await errorText(r));
  const reader = r.body.getReader();
  let carry = null; // an odd trailing byte: half of a sample split across chunks
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    let bytes = value;
    if (carry !== null) {
      bytes = new Uint8Array(value.length + 1);
      bytes[0] = carry;
      bytes.set(value, 1);
      carry = null;
    }
    if (bytes.length % 2) {
      carry = bytes[bytes.length - 1];
      bytes = bytes.subarray(0, bytes.length - 1);
    }
    if (!bytes.length) continue;
    const ints = new Int16Array(bytes.slice().buffer);
    if (!state.pcmChunks.length) $("first-audio").textContent = `${Math.round(performance.now() - t0)} ms`;
    state.pcmChunks.push(ints);
    const floats = new Float32Array(ints.length);
    for (let i = 0; i < ints.length; i++) floats[i] = ints[i] / 32768;
    player.push(floats);
  }
  const seconds = player.received / RATE;
  setStatus("speak-status", `done: ${seconds.toFixed(2)} s of audio`, "ok");
  $("download").disabled = player.received === 0;
}

// ---- download --------------------------------------------------------------------------------------
function wavBlob(chunks) {
  const n = chunks.reduce((a, c) => a + c.length, 0);
  const header = new DataView(new ArrayBuffer(44));
  const text = (off, s) => [...s].forEach((ch, i) => header.setUint8(off + i, ch.charCodeAt(0)));
  text(0, "RIFF"); header.setUint32(4, 36 + 2 * n, true); text(8, "WAVE");
  text(12, "fmt "); header.setUint32(16, 16, true); header.setUint16(20, 1, true); header.setUint16(22, 1, true);
  header.setUint32(24, RATE, true); header.setUint32(28, 2 * RATE, true);
  header.setUint16(32, 2, true); header.setUint16(34, 16, true);
  text(36, "data"); header.setUint32(40, 2 * n, true);
  return new Blob([header, ...chunks], { type: "audio/wav" });
}

// wav and pcm are built from the samples already played; another format repeats the request (same seed).
async function audioBlob(format) {
  if (format === "wav") return wavBlob(state.pcmChunks);
  if (format === "pcm") return new Blob(state.pcmChunks, { type: "application/octet-stream" });
  setStatus("speak-status", `encoding ${format}…`);
  const r = await fetch("v1/audio/speech", {
    method: "POST",
    headers: authHeaders({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...state.lastRequest, response_format: format }),
  });
  if (!r.ok) throw new Error(await errorText(r));
  const blob = await r.blob();
  setStatus("speak-status", `${format}: ${blob.size} bytes`, "ok");
  return blob;
}

async function download() {
  const format = $("format").value;
  const blob = await audioBlob(format);
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `speech.${format}`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

// ---- saving a voice --------------------------------------------------------------------------------
function setClip(blob, filename) {
  state.clip = { blob, filename };
  const preview = $("clip-preview");
  preview.src = URL.createObjectURL(blob);
  preview.hidden = false;
  $("save-voice").disabled = false;
  setStatus("clone-status", `clip ready: ${filename}, ${blob.size} bytes`);
}

async function startRecording() {
  const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  const rec = new MediaRecorder(stream);
  const parts = [];
  rec.ondataavailable = (e) => e.data.size && parts.push(e.data);
  const stopped = new Promise((resolve) => {
    rec.onstop = () => {
      stream.getTracks().forEach((t) => t.stop());
      const type = rec.mimeType || "audio/webm";
      const ext = type.includes("ogg") ? "ogg" : type.includes("mp4") ? "m4a" : "webm";
      setClip(new Blob(parts, { type }), `recording.${ext}`);
      resolve();
    };
  });
  rec.start();
  state.recorder = { rec, stopped };
  $("record").textContent = "■ Stop recording";
  $("record").classList.add("recording");
  setStatus("clone-status", "recording…");
}

async function stopRecording() {
  const { rec, stopped } = state.recorder;
  state.recorder = null;
  rec.stop();
  await stopped;
  $("record").textContent = "● Record";
  $("record").classList.remove("recording");
}

async function saveVoice() {
  const name = $("voice-name").value.trim();
  const transcript = $("transcript").value.trim();
  if (!name || !transcript || !state.clip) throw new Error("a name, a transcript and a clip are needed");
  const form = new FormData();
  form.append("name", name);
  form.append("transcript", transcript);
  form.append("audio_sample", state.clip.blob, state.clip.filename);
  setStatus("clone-status", "encoding the clip…");
  const r = await fetch("v1/audio/voices", { method: "POST", headers: authHeaders(), body: form });
  if (!r.ok) throw new Error(await errorText(r));
  const voice = await r.json();
  await loadVoices(voice.name);
  setStatus("clone-status", `saved "${voice.name}" (${voice.id})`, "ok");
  return voice;
}

// ---- the server's live state -----------------------------------------------------------------------
function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (m) values[m[1]] = (values[m[1]] || 0) + parseFloat(m[3]);
  }
  return values;
}

async function pollState() {
  try {
    const r = await fetch("metrics", { headers: authHeaders() });
    if (!r.ok) throw new Error(`metrics: ${r.status}`);
    const v = parseMetrics(await r.text());
    const pick = (...names) => names.map((n) => v[n]).find((x) => x !== undefined);
    const running = pick("ttsserve_num_requests_running", "vllm:num_requests_running");
    const waiting = pick("ttsserve_num_requests_waiting", "vllm:num_requests_waiting");
    const kv = pick("ttsserve_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc");
    $("state-running").textContent = running === undefined ? "–" : String(running);
    $("state-waiting").textContent = waiting === undefined ? "–" : String(waiting);
    $("state-kv").textContent = kv === undefined ? "–" : `${(100 * kv).toFixed(1)} %`;
    $("state-status").textContent = "live";
    $("state-status").className = "ok";
  } catch (e) {
    $("state-status").textContent = String(e.message || e);
    $("state-status").className = "err";
  }
}

// ---- wiring ----------------------------------------------------------------------------------------
function guarded(statusId, fn) {
  return async () => {
    try {
      await fn();
    } catch (e) {
      if (e.name !== "AbortError") setStatus(statusId, String(e.message || e), "err");
    }
  };
}

async function init() {
  $("api-key").value = localStorage.getItem("ttsserve.apiKey") || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("ttsserve.apiKey", $("api-key").value.trim());
    refresh();
  });
  $("play").addEventListener("click", guarded("speak-status", synthesizeAndPlay));
  $("stop").addEventListener("click", () => {
    if (state.abort) state.abort.abort();
    player.stop();
    setStatus("speak-status", "stopped");
  });
  $("download").addEventListener("click", guarded("speak-status", download));
  $("record").addEventListener("click", guarded("clone-status", () => (state.recorder ? stopRecording() : startRecording())));
  $("clip-file").addEventListener("change", () => {
    const f = $("clip-file").files[0];
    if (f) setClip(f, f.name);
  });
  $("save-voice").addEventListener("click", guarded("clone-status", saveVoice));
  refresh();
  pollState();
  setInterval(pollState, 3000);
}

function refresh() {
  state.voicesLoaded = Promise.all([loadVoices(), loadModels()]).catch((e) => {
    setStatus("speak-status", `cannot list voices or models: ${e.message || e}`, "err");
    throw e;
  });
  return state.voicesLoaded;
}

// ---- self-test (?selftest=1): the browser test drives the page through it ---------------------------
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function until(pred, timeoutMs, what) {
  const end = Date.now() + timeoutMs;
  while (!pred()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(50);
  }
}

async function selftest(params) {
  const out = { ok: false };
  try {
    await state.voicesLoaded;
    await synthesizeAndPlay();
    await until(() => player.played > 0 && player.idle(), 20000, "playback");
    out.played_samples = player.played;
    out.received_samples = player.received;
    out.download = {};
    for (const format of ["wav", "mp3"]) {
      const blob = await audioBlob(format);
      const head = new Uint8Array(await blob.slice(0, 4).arrayBuffer());
      out.download[format] = { bytes: blob.size, type: blob.type, head: String.fromCharCode(...head) };
    }
    await startRecording(); // the fake microphone (--use-fake-device-for-media-stream) plays a beep
    await sleep(parseInt(params.get("record_ms") || "1500", 10));
    await stopRecording();
    out.clip = { type: state.clip.blob.type, bytes: state.clip.blob.size };
    $("voice-name").value = params.get("voice_name") || "selftest-voice";
    $("transcript").value = "A short test tone.";
    out.voice = await saveVoice();
    await pollState();
    out.state = $("state-status").textContent;
    out.ok = true;
  } catch (e) {
    out.error = String(e.message || e);
  }
  const el = $("selftest-result");
  el.textContent = JSON.stringify(out);
  el.dataset.done = "1";
}

init();
const params = new URLSearchParams(location.search);
if (params.get("selftest") === "1") selftest(params);
