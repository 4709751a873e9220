// The Node clients of the client suite, batched: one process runs every case.
// stdin: [{id, client: "openai-node" | "eventsource", base_url, stall, reconnect}]
// stall (a slow reader, else null): {url, max_ms}: after the first event the
// client stops reading until url answers "yes" (the upstream wrote it all) or
// max_ms passed.
// reconnect (eventsource only, optional): when its connection drops, the
// package reconnects by itself (re-sending the POST through its fetch option,
// with Last-Event-ID); the case records each request's Last-Event-ID
// ("last_event_ids", null for none) and keeps reading, at most 3 times.
// stdout: {id: outcome} (the shape of outcome.py's Outcome; "datas" are the
// dispatched SSE data, turned into chunks by the Python side).
import OpenAI from "openai";
import { EventSource } from "eventsource";
import { execFileSync } from "node:child_process";

const MODEL = "compat-model";
const MESSAGES = [{ role: "user", content: "Write the file." }];
const BODY = JSON.stringify({ model: MODEL, messages: MESSAGES, stream: true });

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function stall(spec) {
  const end = Date.now() + spec.max_ms;
  while (Date.now() < end && (await (await fetch(spec.url)).text()) !== "yes") await sleep(10);
}

// Blocks the event loop: nothing reads the socket meanwhile (a busy consumer).
function stallBlocking(spec) {
  const end = Date.now() + spec.max_ms;
  while (Date.now() < end && execFileSync("curl", ["-s", spec.url]).toString() !== "yes") { /* spin */ }
}

async function openaiNode(c) {
  const out = { status: null, chunks: [], error: null };
  const client = new OpenAI({ baseURL: c.base_url, apiKey: "compat", timeout: 30000 });
  try {
    const { data: stream, response } = await client.chat.completions
      .create({ model: MODEL, messages: MESSAGES, stream: true }).withResponse();
    out.status = response.status;
    for await (const chunk of stream) {
      out.chunks.push(chunk);
      if (c.stall && out.chunks.length === 1) await stall(c.stall);
    }
  } catch (e) {
    out.error = { kind: e.constructor.name, status: e.status ?? null, body: e.error ?? null,
                  message: String(e.message) };
  }
  return out;
}

function eventSource(c) {
  return new Promise((resolve) => {
    const out = { status: null, datas: [], ids: [], events: [], error: null };
    if (c.reconnect) out.last_event_ids = [];
    const source = new EventSource(`${c.base_url}/chat/completions`, {
      // The package's documented way to POST: its own fetch.
      fetch: async (input, init) => {
        if (c.reconnect) out.last_event_ids.push(init.headers["Last-Event-ID"] ?? null);
        const response = await fetch(input, { ...init, method: "POST", body: BODY,
          headers: { ...init.headers, "content-type": "application/json" } });
        out.status = response.status;
        return response;
      },
    });
    const finish = () => { source.close(); resolve(out); };
    source.onmessage = (event) => {
      out.datas.push(event.data);
      if (event.lastEventId) out.ids.push(event.lastEventId);
      if (event.data === "[DONE]") { finish(); return; }
      if (c.stall && out.datas.length === 1) stallBlocking(c.stall);
    };
    source.onerror = (event) => {
      // A dropped connection: the package reconnects by itself (readyState CONNECTING).
      if (c.reconnect && source.readyState === source.CONNECTING && out.last_event_ids.length <= 3) return;
      out.error = { kind: "error", status: event.code ?? null, body: null, message: event.message ?? "" };
      finish();
    };
  });
}

let input = "";
for await (const piece of process.stdin) input += piece;
const run = (c) => (c.client === "openai-node" ? openaiNode(c) : eventSource(c));
const cases = JSON.parse(input);
const results = {};
// Eight at a time (as the Python clients: more would make the servers' own loop
// the bottleneck), except the slow readers, which block or stall: one by one after.
const together = cases.filter((c) => !c.stall);
let next = 0;
const worker = async () => {
  while (next < together.length) { const c = together[next++]; results[c.id] = await run(c); }
};
await Promise.all(Array.from({ length: 8 }, worker));
for (const c of cases.filter((c) => c.stall)) results[c.id] = await run(c);
process.stdout.write(JSON.stringify(results));
