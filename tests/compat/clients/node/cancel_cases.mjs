// The Node clients of the cancel-by-id rows (tests/compat/clients/test_cancel_and_settings_clients.py),
// batched: one process runs every case, all at once.
// stdin: [{id, client, base, case}]: base is tokenwire's root URL, case the path
// segment that names the engine's case. Each client starts a long stream with
// the per-request settings headers, and while it reads:
//   after 3 text deltas, another caller (sk-mallory) cancels it: that must fail;
//   after 6, its owner (sk-alice) cancels it; the client reads on until its stream ends.
// openai-node cancels with its own `client.responses.cancel(id)` (the Responses
// API's POST .../responses/{id}/cancel, the id the engine named in
// response.created); the Anthropic TypeScript SDK has no cancel, so the
// application DELETEs /v1/streams/{id} with fetch, the id being the
// x-tokenwire-stream-id header of the SDK's own response (withResponse()).
// stdout: {id: outcome}: {stream_id, response_id (openai-node), deltas, mallory, owner, error,
// ended_cleanly}.
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";

const SETTINGS = { "Tokenwire-Keep-Generating": "true", "Tokenwire-Heartbeat-S": "0.1" };
const MALLORY_AT = 3;
const OWNER_AT = 6;

function sdkError(e) {
  return { kind: e?.constructor?.name ?? typeof e, status: e?.status ?? null, body: e?.error ?? null,
           message: String(e?.message ?? e) };
}

async function deleteStream(base, streamId, key) {
  const answer = await fetch(`${base}/v1/streams/${encodeURIComponent(streamId)}`,
                             { method: "DELETE", headers: { authorization: `Bearer ${key}` } });
  return { status: answer.status, body: await answer.json() };
}

async function openaiResponses(c) {
  const out = { deltas: 0, ended_cleanly: false };
  const options = (key) => ({ baseURL: `${c.base}/${c.case}/v1`, apiKey: key, maxRetries: 0, timeout: 30000 });
  const alice = new OpenAI(options("sk-alice"));
  const mallory = new OpenAI(options("sk-mallory"));
  try {
    const { data: stream, response } = await alice.responses.create(
      { model: "gpt-compat-1", input: "hi", stream: true }, { headers: SETTINGS }).withResponse();
    out.stream_id = response.headers.get("x-tokenwire-stream-id");
    let responseId = null;
    for await (const event of stream) {
      if (event.type === "response.created") responseId = out.response_id = event.response.id;
      if (event.type !== "response.output_text.delta") continue;
      out.deltas += 1;
      if (out.deltas === MALLORY_AT) {
        try {
          out.mallory = { answer: await mallory.responses.cancel(responseId) };
        } catch (e) {
          out.mallory = { error: sdkError(e) };
        }
      }
      if (out.deltas === OWNER_AT) {
        const cancelled = await alice.responses.cancel(responseId);
        out.owner = { id: cancelled.id, object: cancelled.object, status: cancelled.status };
      }
    }
    out.ended_cleanly = true;
  } catch (e) {
    out.error = sdkError(e);
  }
  return out;
}

async function anthropicCreate(c) {
  const out = { deltas: 0, ended_cleanly: false };
  const client = new Anthropic({ baseURL: `${c.base}/${c.case}`, apiKey: "sk-alice", maxRetries: 0,
                                 timeout: 30000 });
  try {
    const { data: stream, response } = await client.messages.create(
      { model: "claude-compat-1", max_tokens: 1024, messages: [{ role: "user", content: "hi" }], stream: true },
      { headers: SETTINGS }).withResponse();
    out.stream_id = response.headers.get("x-tokenwire-stream-id");
    for await (const event of stream) {
      if (event.type !== "content_block_delta") continue;
      out.deltas += 1;
      if (out.deltas === MALLORY_AT) out.mallory = await deleteStream(c.base, out.stream_id, "sk-mallory");
      if (out.deltas === OWNER_AT) out.owner = await deleteStream(c.base, out.stream_id, "sk-alice");
    }
    out.ended_cleanly = true;
  } catch (e) {
    out.error = sdkError(e);
  }
  return out;
}

const CLIENTS = { "openai-node-responses-cancel": openaiResponses, "anthropic-ts-delete": anthropicCreate };

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const cases = JSON.parse(Buffer.concat(chunks).toString());
const results = await Promise.all(cases.map(async (c) => [c.id, await CLIENTS[c.client](c)]));
process.stdout.write(JSON.stringify(Object.fromEntries(results)));
