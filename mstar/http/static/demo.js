// mstar's browser demo: text in, speech (or text) out through the Realtime websocket at /v1/realtime.
// Plays response.output_audio.delta (base64 PCM16 LE, 24 kHz mono) as it arrives, measures time to first audio,
// and keeps what it measured on window.mstarDemo (and in the page) so a headless browser test can read it.
// A key typed in the page goes with every call, for a server started with --api-key.
// For a model that hears, the microphone streams 24 kHz PCM16 in ~100 ms appends; the server's VAD (on by
// default) commits each turn and answers it, and speech during an answer cuts it (barge-in).
"use strict";

const RATE = 24000;  // the server speaks 24 kHz mono PCM16 both ways

const state = window.mstarDemo = {
  models: [], model: null, connected: false, session: null,
  active: false, responseId: null, status: "idle", responses: [],  // statuses of response.done, in order
  audioBytes: 0, audioSeconds: 0, ttfaMs: null, ttftMs: null, transcript: "", text: "", errors: [],
  audioState: "none", scheduled: 0,  // AudioContext state and sources still playing
  vad: "off", turns: [],  // "off" | "listening" | "speech"; each turn's [audio_start_ms, audio_end_ms]
};
const APPEND_SAMPLES = RATE / 10;  // the microphone's audio goes out every 100 ms

const $ = (id) => document.getElementById(id);
let ws = null;
let ready = null;       // promise of the open socket's session.created
let t0 = 0;             // performance.now() when response.create went out
let sentMore = 0;       // texts sent into the running response
let spokenMore = 0;     // of them, those the server announced as spoken (a transcript delta each)
let said = 0;           // transcript deltas of the running response
let audio = null;       // AudioContext, made on the first click (autoplay rules want a gesture)
let playAt = 0;         // context time where the next chunk starts, so chunks play back to back
let sources = new Set();
let muted = false;      // after Stop: deltas still in flight are counted, not played
let mic = null;         // {stream, node, ctx} while the microphone records
let createId = null;    // event_id of the page's response.create the server has not yet answered
let eventSeq = 0;

function render() {
  $("connection").textContent = state.connected ? `open (${state.model})` : "closed";
  $("status").textContent = state.status;
  $("ttfa").textContent = state.ttfaMs === null ? "-" : state.ttfaMs.toFixed(0);
  $("ttft").textContent = state.ttftMs === null ? "-" : state.ttftMs.toFixed(0);
  $("audioBytes").textContent = String(state.audioBytes);
  $("audioSeconds").textContent = state.audioSeconds.toFixed(2);
  $("responses").textContent = state.responses.join(", ");
  $("vad").textContent = state.vad;
  $("transcript").textContent = state.transcript;
  $("textOut").textContent = state.text;
  $("stop").disabled = !state.active && state.scheduled === 0;
  $("sendMore").disabled = !state.active;
}

function addError(code, message) {
  state.errors.push({code, message});
  const li = document.createElement("li");
  li.textContent = `${code}: ${message}`;
  $("errors").appendChild(li);
}

// ------------------------------------------------------------------ socket

function connect(model) {
  if (ws && ws.model === model && ws.readyState <= WebSocket.OPEN) return ready;
  if (ws) {
    if (state.active) endResponse("disconnected");
    ws.close();
  }
  // a browser cannot set headers on a websocket: the key goes as a subprotocol, as OpenAI's realtime API takes it
  const key = apiKey();
  const sock = ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}` +
                                  `/v1/realtime?model=${encodeURIComponent(model)}`,
                                  key ? ["realtime", `openai-insecure-api-key.${key}`] : []);
  sock.model = model;
  let started = false;
  ready = new Promise((resolve, reject) => {
    sock.onmessage = (msg) => {
      const ev = JSON.parse(msg.data);
      if (ev.type === "session.created") {
        started = true;
        resolve(ev.session);
      }
      if (sock === ws) onEvent(ev);
    };
    sock.onclose = (e) => {
      reject(new Error("the websocket closed before the session started"));
      if (sock !== ws) return;  // a socket we replaced: its end changes nothing
      if (!started) addError("websocket", `could not open a realtime session for ${model}`);
      // the page closes only sockets it replaced, so this end was the server's or the network's
      else addError("websocket", `the realtime session closed: ${e.reason || `code ${e.code}`}`);
      state.connected = false;
      if (state.active) endResponse("disconnected");
      render();
    };
  });
  ready.catch(() => {});  // callers that care await it; the failure is shown by onclose
  return ready;
}

function apiKey() {
  return $("apiKey").value.trim();
}

function send(obj) {
  ws.send(JSON.stringify(obj));
}

function onEvent(ev) {
  switch (ev.type) {
    case "session.created":
    case "session.updated":
      state.connected = true;
      state.session = ev.session;
      if (ev.type === "session.created") sessionStarted(ev.session);
      break;
    case "response.created":
      createId = null;
      if (!state.active) serverResponse();  // the VAD answered a turn
      state.responseId = ev.response.id;
      break;
    case "input_audio_buffer.speech_started":
      state.vad = "speech";
      state.turns.push([ev.audio_start_ms, null]);
      silence();  // barge-in: the server cancels the answer; what is already here stops too
      break;
    case "input_audio_buffer.speech_stopped":
      state.vad = mic ? "listening" : "off";
      if (state.turns.length) state.turns[state.turns.length - 1][1] = ev.audio_end_ms;
      t0 = performance.now();  // time to first audio counts from the end of the turn
      break;
    case "response.output_audio.delta":
      if (state.ttfaMs === null) state.ttfaMs = performance.now() - t0;
      play(ev.delta);
      break;
    case "response.output_audio_transcript.delta":
      if (said++ > 0) spokenMore += 1;  // the first delta is the text that started the response
      state.transcript += ev.delta;
      break;
    case "response.output_text.delta":
      if (state.ttftMs === null) state.ttftMs = performance.now() - t0;
      state.text += ev.delta;
      break;
    case "response.done":
      endResponse(ev.response.status);
      break;
    case "error":
      addError(ev.error.code, ev.error.message);
      // a refused response.create starts no response, so no response.done would ever end the page's wait
      if (createId !== null && ev.error.event_id === createId) {
        createId = null;
        if (state.active && state.responseId === null) endResponse("failed");
      }
      break;
  }
  render();
}

function endResponse(status) {
  state.active = false;
  state.responseId = null;
  state.status = status;
  state.responses.push(status);
  // text sent after the server closed the response's input waits on the server for the next response
  if (sentMore > spokenMore && status !== "cancelled" && status !== "disconnected" && ws.readyState === 1) {
    startResponse();
  }
}

function sessionStarted(session) {
  const card = state.models.find((m) => m.id === session.model) || {};
  const voices = card.voices || (session.mstar && session.mstar.voices) || [];
  const select = $("voice");
  select.replaceChildren(...voices.map((v) => new Option(v, v)));
  const current = session.audio && session.audio.output && session.audio.output.voice;
  if (current) select.value = current;
  select.disabled = voices.length === 0;
  // the session announces audio input only where the model takes it
  const hearing = Boolean(session.mstar && session.mstar.audio_input);
  $("mic").disabled = !hearing;
  $("micNote").textContent = hearing ? "" : "this model takes no audio input";
}

// ---------------------------------------------------------------- actions

async function speak() {
  const text = $("text").value.trim();
  if (!text) return;
  if (state.active) return sendMore();
  ensureAudio();
  try {
    await connect($("model").value);
  } catch (e) {
    return;  // already shown
  }
  const voice = $("voice").value;
  const output = state.session && state.session.output_modalities;
  if (voice && output && output.includes("audio")) {
    send({type: "session.update", session: {type: "realtime", audio: {output: {voice}}}});
  }
  sendText(text);
  Object.assign(state, {audioBytes: 0, audioSeconds: 0, ttfaMs: null, ttftMs: null, transcript: "", text: ""});
  startResponse();
}

function startResponse() {
  const response = {};
  const limit = parseInt($("maxTokens").value, 10);
  if (limit > 0) response.max_output_tokens = limit;
  state.active = true;
  state.status = "in_progress";
  sentMore = spokenMore = said = 0;
  muted = false;
  t0 = performance.now();
  createId = `demo_create_${++eventSeq}`;
  send({type: "response.create", event_id: createId, response});
  render();
}

// a response the server started (its VAD committed a turn)
function serverResponse() {
  Object.assign(state, {active: true, status: "in_progress", audioBytes: 0, audioSeconds: 0, ttfaMs: null,
                        ttftMs: null, transcript: "", text: ""});
  sentMore = spokenMore = said = 0;
  muted = false;
  if (!t0) t0 = performance.now();
}

function sendText(text) {
  send({type: "conversation.item.create",
        item: {type: "message", role: "user", content: [{type: "input_text", text}]}});
  if ($("streamMode").checked) $("text").value = "";
}

// more text for the running response: the server appends it, spoken after what is queued
function sendMore() {
  const text = $("text").value.trim();
  if (!text || !state.active) return;
  sendText(text);
  sentMore += 1;
}

// barge-in: the server drops the rest, and what is already here stops playing now
function stop() {
  if (state.active) send({type: "response.cancel"});
  silence();
}

function silence() {
  for (const s of sources) {
    s.onended = null;
    s.stop();
  }
  sources.clear();
  muted = true;
  state.scheduled = 0;
  if (audio) playAt = audio.currentTime;
  render();
}

// ------------------------------------------------------------------ audio

function ensureAudio() {
  if (!audio) {
    try {
      audio = new AudioContext({sampleRate: RATE});
    } catch (e) {
      addError("audio", `no audio output: ${e.message}`);  // bytes are still counted
      return;
    }
  }
  if (audio.state === "suspended") audio.resume();
  state.audioState = audio.state;
}

function play(b64) {
  const bin = atob(b64);
  state.audioBytes += bin.length;
  state.audioSeconds = state.audioBytes / 2 / RATE;
  if (!audio || muted) return;
  const n = bin.length >> 1;
  const buffer = audio.createBuffer(1, n, RATE);
  const samples = buffer.getChannelData(0);
  for (let i = 0; i < n; i++) {
    const v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);  // little endian
    samples[i] = (v >= 0x8000 ? v - 0x10000 : v) / 32768;
  }
  const source = audio.createBufferSource();
  source.buffer = buffer;
  source.connect(audio.destination);
  playAt = Math.max(playAt, audio.currentTime);
  source.start(playAt);
  playAt += buffer.duration;
  sources.add(source);
  source.onended = () => {
    sources.delete(source);
    state.scheduled = sources.size;
    render();
  };
  state.scheduled = sources.size;
  state.audioState = audio.state;
}

// ------------------------------------------------------------- microphone

// Records 24 kHz PCM16 into input_audio_buffer.append, 100 ms at a time. With the server's VAD on, turns are
// committed and answered there (a turn still under way when recording stops is committed by the second click);
// with it off, the second click commits and asks for a response.
// Enabled only when the session says the model takes audio input.
async function toggleMic() {
  if (mic) {
    mic.node.disconnect();
    mic.stream.getTracks().forEach((t) => t.stop());
    await mic.ctx.close();
    flush(mic);
    mic = null;
    $("mic").textContent = "Microphone";
    const speaking = state.vad === "speech";
    state.vad = "off";
    const detecting = state.session && state.session.audio && state.session.audio.input.turn_detection;
    if (!detecting) {
      send({type: "input_audio_buffer.commit"});
      startResponse();
    } else if (speaking) {
      // the VAD would wait for silence that no longer comes: the turn under way ends where the recording did,
      // and the server stops, commits and answers it as it would have
      send({type: "input_audio_buffer.commit"});
    }
    render();
    return;
  }
  ensureAudio();
  await connect($("model").value);
  // the browser's echo cancelling keeps the answer playing from starting a turn of its own
  const stream = await navigator.mediaDevices.getUserMedia(
    {audio: {channelCount: 1, echoCancellation: true, noiseSuppression: true}});
  const ctx = new AudioContext({sampleRate: RATE});  // the browser resamples the microphone to 24 kHz
  const worklet = "registerProcessor('pcm-tap', class extends AudioWorkletProcessor {" +
    "process(inputs) { if (inputs[0][0]) this.port.postMessage(inputs[0][0].slice()); return true; } });";
  await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([worklet], {type: "text/javascript"})));
  const node = new AudioWorkletNode(ctx, "pcm-tap");
  const rec = {stream, node, ctx, pending: [], count: 0};
  node.port.onmessage = (msg) => {
    rec.pending.push(msg.data);
    rec.count += msg.data.length;
    if (rec.count >= APPEND_SAMPLES) flush(rec);
  };
  ctx.createMediaStreamSource(stream).connect(node);
  mic = rec;
  state.vad = "listening";
  $("mic").textContent = "Stop recording";
  render();
}

// what the microphone gathered since the last append, as one input_audio_buffer.append
function flush(rec) {
  if (!rec.count || !ws || ws.readyState !== WebSocket.OPEN) return;
  const pcm = new DataView(new ArrayBuffer(rec.count * 2));
  let at = 0;
  for (const block of rec.pending) {
    block.forEach((x) => { pcm.setInt16(at, Math.max(-1, Math.min(1, x)) * 32767, true); at += 2; });
  }
  rec.pending = [];
  rec.count = 0;
  let bin = "";
  new Uint8Array(pcm.buffer).forEach((b) => { bin += String.fromCharCode(b); });
  send({type: "input_audio_buffer.append", audio: btoa(bin)});
}

// ------------------------------------------------------------------ start

async function init() {
  $("speak").onclick = speak;
  $("sendMore").onclick = sendMore;
  $("stop").onclick = stop;
  $("mic").onclick = () => toggleMic().catch((e) => addError("microphone", e.message));
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && $("streamMode").checked) {
      e.preventDefault();
      speak();  // while a response runs this sends more
    }
  });
  $("model").onchange = () => {
    state.model = $("model").value;
    connect(state.model).catch(() => {});
  };
  $("apiKey").onchange = () => {
    // the old socket's close is ignored once it is replaced, so its response must end here
    if (state.active) endResponse("disconnected");
    silence();
    if (ws) ws.close();
    ws = null;
    state.connected = false;
    loadModels();
  };
  await loadModels();
}

// the served models, then a session on the first; a server with --api-key wants the key first
async function loadModels() {
  const key = apiKey();
  try {
    const r = await fetch("/v1/models", {headers: key ? {Authorization: `Bearer ${key}`} : {}});
    if (r.status === 401) {
      addError("auth", key ? "the server refused this API key" : "the server wants an API key: enter it above");
      render();
      return;
    }
    state.models = (await r.json()).data;
  } catch (e) {
    addError("models", e.message);
    return;
  }
  $("model").replaceChildren(...state.models.map((m) => new Option(m.id, m.id)));
  state.model = $("model").value;
  render();
  connect(state.model).catch(() => {});
}

init();
