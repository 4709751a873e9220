// The Node clients of the dialect rows (tests/compat/clients/test_dialect_clients.py),
// batched: one process runs every case.
// stdin: [{id, client, base_url, stall}]; base_url is the one the client is
// configured with (the Anthropic SDK's is the server root: it adds /v1/messages).
// stall (a slow reader, else null): {url, max_ms}: after the first event the
// client stops reading until url answers "yes" (the upstream wrote it all) or
// max_ms passed. A client that reads its stream by itself (the SDKs' stream
// helpers, the AI SDK's streamText) stalls by blocking the event loop, so
// nothing reads the socket meanwhile (a busy consumer), as run_cases.mjs does.
// stdout: {id: outcome} (the shape of dialect_clients.py's DialectOutcome;
// an error is {kind, status, body, message}, completed on the Python side).
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";
import { streamText, tool, jsonSchema } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createAnthropic } from "@ai-sdk/anthropic";
import { execFileSync } from "node:child_process";

const ANTHROPIC_MODEL = "claude-compat-1";
const RESPONSES_MODEL = "gpt-compat-1";
const CHAT_MODEL = "compat-model";
const PROMPT = "Write the file.";
const MAX_TOKENS = 1024;
const TOOL = "write_file";
const SCHEMA = { type: "object", properties: { path: { type: "string" }, content: { type: "string" } },
                 required: ["path", "content"] };
const ANTHROPIC_ARGS = { model: ANTHROPIC_MODEL, max_tokens: MAX_TOKENS,
  tools: [{ name: TOOL, description: "Write a file.", input_schema: SCHEMA }],
  messages: [{ role: "user", content: PROMPT }] };
const RESPONSES_ARGS = { model: RESPONSES_MODEL, input: PROMPT,
  tools: [{ type: "function", name: TOOL, description: "Write a file.", parameters: SCHEMA, strict: false }] };

// The AI SDK logs its warnings with console.info (stdout, which carries the results).
globalThis.AI_SDK_LOG_WARNINGS = false;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function stall(spec) {
  const end = Date.now() + spec.max_ms;
  while (Date.now() < end && (await (await fetch(spec.url)).text()) !== "yes") await sleep(10);
}

// Blocks the event loop: nothing reads the socket meanwhile.
function stallBlocking(spec) {
  const end = Date.now() + spec.max_ms;
  while (Date.now() < end && execFileSync("curl", ["-s", spec.url]).toString() !== "yes") { /* spin */ }
}

function sdkError(e) {
  return { kind: e?.constructor?.name ?? typeof e, status: e?.status ?? null, body: e?.error ?? null,
           message: String(e?.message ?? e) };
}

const plain = (value) => JSON.parse(JSON.stringify(value ?? null));

// Anthropic TypeScript SDK ----------------------------------------------------

const anthropicClient = (c) => new Anthropic({ baseURL: c.base_url, apiKey: "compat", timeout: 30000 });

// messages.stream(): its events, then finalMessage() (the SDK accumulates the message).
async function anthropicStream(c) {
  const out = { status: null, text: "", error: null };
  try {
    const stream = anthropicClient(c).messages.stream(ANTHROPIC_ARGS);
    let seen = 0;
    for await (const event of stream) {
      if (event.type === "content_block_delta" && event.delta.type === "text_delta") out.text += event.delta.text;
      if (c.stall && ++seen === 1) stallBlocking(c.stall);
    }
    const message = await stream.finalMessage();
    out.final = plain(message);
    out.stop = message.stop_reason;
    out.usage = plain(message.usage);
  } catch (e) {
    out.error = sdkError(e);
  }
  return out;
}

// An SDK's create({stream: true}): the raw events.
async function rawEvents(c, create) {
  const out = { status: null, events: [], error: null };
  try {
    const { data: stream, response } = await create().withResponse();
    out.status = response.status;
    for await (const event of stream) {
      out.events.push(event);
      if (c.stall && out.events.length === 1) await stall(c.stall);
    }
  } catch (e) {
    out.error = sdkError(e);
  }
  return out;
}

// messages.create({stream: true}): the raw events.
const anthropicCreate = (c) =>
  rawEvents(c, () => anthropicClient(c).messages.create({ ...ANTHROPIC_ARGS, stream: true }));

// openai-node, Responses ------------------------------------------------------

const openaiClient = (c) => new OpenAI({ baseURL: c.base_url, apiKey: "compat", timeout: 30000 });

// responses.create({stream: true}): the raw events.
const responsesCreate = (c) =>
  rawEvents(c, () => openaiClient(c).responses.create({ ...RESPONSES_ARGS, stream: true }));

// responses.stream(): its events (deltas added up), then finalResponse().
async function responsesStream(c) {
  const out = { status: null, text: "", thinking: "", tools: [], error: null };
  const args = {};
  try {
    const stream = openaiClient(c).responses.stream(RESPONSES_ARGS);
    let seen = 0;
    for await (const event of stream) {
      if (event.type === "response.output_text.delta") out.text += event.delta;
      else if (event.type === "response.reasoning_text.delta") out.thinking += event.delta;
      else if (event.type === "response.function_call_arguments.delta") {
        args[event.item_id] = (args[event.item_id] ?? "") + event.delta;
      } else if (event.type === "error") (out.events ??= []).push(event);
      if (c.stall && ++seen === 1) stallBlocking(c.stall);
    }
    const response = await stream.finalResponse();
    out.final = plain(response);
    out.stop = response.status;
    out.usage = plain(response.usage);
  } catch (e) {
    out.error = sdkError(e);
  }
  out.tools = Object.entries(args).map(([id, a]) => ({ id, arguments: a }));
  return out;
}

// The Vercel AI SDK -----------------------------------------------------------

const aiTools = { [TOOL]: tool({ description: "Write a file.", inputSchema: jsonSchema(SCHEMA) }) };

function aiModel(c) {
  if (c.client === "ai-sdk-anthropic") return createAnthropic({ baseURL: c.base_url, apiKey: "compat" })(ANTHROPIC_MODEL);
  const openai = createOpenAI({ baseURL: c.base_url, apiKey: "compat" });
  return c.client === "ai-sdk-openai-chat" ? openai.chat(CHAT_MODEL) : openai.responses(RESPONSES_MODEL);
}

function aiError(error) {
  const out = sdkError(error);
  out.kind = error?.name ?? out.kind;
  out.status = error?.statusCode ?? null;
  out.body = error?.data ?? (error && typeof error === "object" && !(error instanceof Error) ? plain(error) : null);
  return out;
}

const BEFORE_ANSWER = new Set(["start", "start-step"]);

// streamText(...).fullStream: the parts, as the AI SDK's docs read them.
async function aiSdk(c) {
  const out = { status: null, text: "", thinking: "", tools: [], parts: [], error: null };
  const errors = [];
  try {
    const result = streamText({ model: aiModel(c), prompt: PROMPT, tools: aiTools, maxOutputTokens: MAX_TOKENS,
                                onError: () => {} });  // the error parts below carry the same errors
    let seen = 0;
    for await (const part of result.fullStream) {
      if (out.parts.at(-1) !== part.type) out.parts.push(part.type);
      if (part.type === "text-delta") out.text += part.text;
      else if (part.type === "reasoning-delta") out.thinking += part.text;
      else if (part.type === "tool-call") out.tools.push({ id: part.toolCallId, name: part.toolName, arguments: part.input });
      else if (part.type === "finish") { out.stop = part.finishReason; out.usage = plain(part.totalUsage); }
      else if (part.type === "error") errors.push(aiError(part.error));
      // "start" is enqueued before the request is sent, "start-step" maybe before the
      // answer's first byte: a stall there could come before tokenwire had anything to hold.
      if (c.stall && !BEFORE_ANSWER.has(part.type) && ++seen === 1) stallBlocking(c.stall);
    }
  } catch (e) {
    errors.push(aiError(e));
  }
  // The first error, and the kind and message of each (an error part, then maybe the stream's own failure).
  if (errors.length) out.error = { ...errors[0], count: errors.length, all: errors.map((e) => [e.kind, e.message]) };
  return out;
}

const CLIENTS = {
  "anthropic-ts-stream": anthropicStream,
  "anthropic-ts-create": anthropicCreate,
  "openai-node-responses-create": responsesCreate,
  "openai-node-responses-stream": responsesStream,
  "ai-sdk-anthropic": aiSdk,
  "ai-sdk-openai-responses": aiSdk,
  "ai-sdk-openai-chat": aiSdk,
};

let input = "";
for await (const piece of process.stdin) input += piece;
const cases = JSON.parse(input);
const results = {};
// Eight at a time, the slow readers one by one after (they stall, or block).
const together = cases.filter((c) => !c.stall);
let next = 0;
const worker = async () => {
  while (next < together.length) { const c = together[next++]; results[c.id] = plain(await CLIENTS[c.client](c)); }
};
await Promise.all(Array.from({ length: 8 }, worker));
for (const c of cases.filter((c) => c.stall)) results[c.id] = plain(await CLIENTS[c.client](c));
process.stdout.write(JSON.stringify(results));
