// The Node clients of the recovery rows (tests/compat/clients/test_recovery_clients.py),
// batched: one process runs every case given, one after another.
// stdin: [{id, client, ...}], by client:
//   "eventsource" {url, limit_ms}: the eventsource package opens url (GET) and
//     reconnects by itself (with Last-Event-ID) whenever the connection drops;
//     it is left to do so until it gives up (CLOSED), reads "[DONE]" or limit_ms.
//   "openai-node-create" {base_url, headers}: chat.completions.create({stream: true})
//   "openai-node-stream" {base_url, headers}: chat.completions.stream(), then finalChatCompletion()
//   "ai-sdk-chat" {base_url, headers}: the Vercel AI SDK's streamText with @ai-sdk/openai's openai.chat()
// stdout: {id: what the client saw}; every judgement is the test's.
import OpenAI from "openai";
import { EventSource } from "eventsource";
import { streamText } from "ai";
import { createOpenAI } from "@ai-sdk/openai";

const MODEL = "compat-model";
const MESSAGES = [{ role: "user", content: "hi" }];

// The AI SDK logs its warnings with console.info (stdout, which carries the results).
globalThis.AI_SDK_LOG_WARNINGS = false;

const plain = (value) => JSON.parse(JSON.stringify(value ?? null));

function sdkError(e) {
  return { kind: e?.constructor?.name ?? typeof e, name: e?.name ?? null, status: e?.status ?? null,
           body: e?.error ?? null, message: String(e?.message ?? e) };
}

function eventSource(c) {
  return new Promise((resolve) => {
    const out = { messages: [], errors: [], opens: 0, ended: null };
    const started = Date.now();
    const source = new EventSource(c.url);
    const finish = (why) => { clearTimeout(late); source.close(); out.ended = why; resolve(out); };
    const late = setTimeout(() => finish("timeout"), c.limit_ms);
    source.onopen = () => { out.opens += 1; };
    source.onmessage = (event) => {
      out.messages.push({ data: event.data, id: event.lastEventId, at_ms: Date.now() - started });
      if (event.data === "[DONE]") finish("done");
    };
    source.onerror = (event) => {
      // A dropped connection (CONNECTING: it reconnects by itself), or one it gives up on (CLOSED).
      out.errors.push({ state: source.readyState, code: event.code ?? null, message: event.message ?? null,
                        at_ms: Date.now() - started });
      if (source.readyState === source.CLOSED) finish("closed");
    };
  });
}

const openaiClient = (c) => new OpenAI({ baseURL: c.base_url, apiKey: "compat", timeout: 30000, maxRetries: 0,
                                         defaultHeaders: c.headers });

// The raw chunks, and what the usual loop (`chunk.choices[0]?.delta?.content`) makes of each.
async function openaiCreate(c) {
  const out = { chunks: [], usual_text: "", usual_error: null, error: null };
  try {
    const stream = await openaiClient(c).chat.completions.create({ model: MODEL, messages: MESSAGES, stream: true });
    for await (const chunk of stream) {
      out.chunks.push(chunk);
      if (out.usual_error === null) {
        try {
          out.usual_text += chunk.choices[0]?.delta?.content || "";
        } catch (e) {
          out.usual_error = sdkError(e);
        }
      }
    }
  } catch (e) {
    out.error = sdkError(e);
  }
  return out;
}

// The stream helper: its content deltas, then the completion it accumulated.
async function openaiStream(c) {
  const out = { text: "", final: null, error: null };
  try {
    const stream = openaiClient(c).chat.completions.stream({ model: MODEL, messages: MESSAGES });
    stream.on("content", (delta) => { out.text += delta; });
    const final = await stream.finalChatCompletion();
    out.final = { content: final.choices[0].message.content, finish_reason: final.choices[0].finish_reason };
  } catch (e) {
    out.error = sdkError(e);
  }
  return out;
}

// streamText(...).fullStream: every part, as the AI SDK's docs read them.
async function aiSdk(c) {
  const out = { text: "", parts: [], errors: [], finish: null, error: null };
  try {
    const openai = createOpenAI({ baseURL: c.base_url, apiKey: "compat", headers: c.headers });
    const result = streamText({ model: openai.chat(MODEL), prompt: "hi", onError: () => {} });
    for await (const part of result.fullStream) {
      out.parts.push(part.type);
      if (part.type === "text-delta") out.text += part.text;
      else if (part.type === "error") {
        out.errors.push({ name: part.error?.name ?? null, message: String(part.error?.message ?? part.error),
                          value: plain(part.error?.value ?? null) });
      } else if (part.type === "finish") out.finish = { reason: part.finishReason, usage: plain(part.totalUsage) };
    }
  } catch (e) {
    out.error = sdkError(e);
  }
  return out;
}

const CLIENTS = {
  "eventsource": eventSource,
  "openai-node-create": openaiCreate,
  "openai-node-stream": openaiStream,
  "ai-sdk-chat": aiSdk,
};

let input = "";
for await (const piece of process.stdin) input += piece;
const results = {};
for (const c of JSON.parse(input)) results[c.id] = plain(await CLIENTS[c.client](c));
process.stdout.write(JSON.stringify(results));
