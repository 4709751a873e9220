// gRPC cases for @grpc/grpc-js (tests/sidecar/test_grpc_node.py), batched in one process.
// argv[2]: the .proto (tokenwire/v1/streaming.proto). stdin: {target, cases: [{id, service,
// request, metadata, deadline_ms, cancel_after}]}: cancel_after (messages, optional) cancels
// the call after that many messages. stdout: {id: {code, details, texts, event_ids,
// initial, trailing}} (texts: each message's content; trailing: the trailing metadata).
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";
import { readFileSync } from "node:fs";

const definition = protoLoader.loadSync(process.argv[2], { keepCase: true, longs: Number, defaults: true });
const api = grpc.loadPackageDefinition(definition).tokenwire.v1;
const spec = JSON.parse(readFileSync(0, "utf8"));

function runCase(c) {
  const client = new api[c.service](spec.target, grpc.credentials.createInsecure());
  const metadata = new grpc.Metadata();
  for (const [key, value] of Object.entries(c.metadata || {})) metadata.set(key, value);
  const options = c.deadline_ms ? { deadline: new Date(Date.now() + c.deadline_ms) } : {};
  const out = { code: null, details: null, texts: [], event_ids: [], initial: {}, trailing: {} };
  return new Promise((resolve) => {
    const call = client.Create(c.request, metadata, options);
    call.on("metadata", (m) => { out.initial = m.getMap(); });
    call.on("data", (message) => {
      out.texts.push((message.choices || []).map((choice) => choice.content ?? choice.text ?? "").join(""));
      out.event_ids.push(message.event_id);
      if (c.cancel_after && out.texts.length === c.cancel_after) call.cancel();
    });
    call.on("error", () => {});
    call.on("status", (status) => {
      out.code = status.code;
      out.details = status.details;
      out.trailing = status.metadata.getMap();
      client.close();
      resolve(out);
    });
  });
}

const results = {};
await Promise.all(spec.cases.map(async (c) => { results[c.id] = await runCase(c); }));
process.stdout.write(JSON.stringify(results));
