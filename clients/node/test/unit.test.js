// Unit tests: no stack needed.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { BinaryWriter } from "@bufbuild/protobuf/wire";
import { Code, ConnectError } from "@connectrpc/connect";
import { Role } from "../gen/gymrpc/v1/common_pb.js";
import { canonicalJson, codeName, taskFromRow, toGymrpcError } from "../src/index.js";
import { socketPath } from "../src/transport.js";

test("ErrorInfo and RetryInfo details become reason, metadata and retry delay", () => {
  const info = new BinaryWriter()
    .tag(1, 2)
    .string("LEASE_HELD")
    .tag(2, 2)
    .string("gymrpc.v1")
    .tag(3, 2)
    .bytes(new BinaryWriter().tag(1, 2).string("rollout_id").tag(2, 2).string("r1").finish())
    .finish();
  const retry = new BinaryWriter()
    .tag(1, 2)
    .bytes(new BinaryWriter().tag(1, 0).int64(1).tag(2, 0).int32(500_000_000).finish())
    .finish();
  const wire = new ConnectError("episode r1 is running", Code.Aborted);
  wire.details.push({ type: "google.rpc.ErrorInfo", value: info }, { type: "google.rpc.RetryInfo", value: retry });

  const err = toGymrpcError(wire);
  assert.equal(err.code, Code.Aborted);
  assert.equal(err.codeName, "ABORTED");
  assert.equal(err.reason, "LEASE_HELD");
  assert.deepEqual(err.metadata, { rollout_id: "r1" });
  assert.equal(err.retryDelayMs, 1500);
  assert.equal(String(err), "ABORTED LEASE_HELD: episode r1 is running");
});

test("an error without details keeps its code as the reason", () => {
  const err = toGymrpcError(new ConnectError("gone", Code.Unavailable));
  assert.equal(err.reason, "UNAVAILABLE");
  assert.equal(codeName(Code.FailedPrecondition), "FAILED_PRECONDITION");
});

test("a reference task row becomes a Task, environment fields as sorted JSON", () => {
  const row = JSON.parse(
    readFileSync(new URL("../../../envs/counter/data/example.jsonl", import.meta.url), "utf8").split("\n")[0],
  );
  const task = taskFromRow(row, "7");
  assert.equal(task.taskId, "7");
  assert.equal(task.input[0].role, Role.USER);
  assert.equal(task.input[0].content, "add 1 then add 2 then get the count");
  assert.deepEqual(
    task.tools.map((t) => t.name),
    ["increment_counter", "get_counter_value"],
  );
  assert.equal(task.envJson, '{"expected_count":6,"initial_count":3}');
  assert.throws(() => taskFromRow({ expected_count: 1 }), /responses_create_params/);
});

test("canonical JSON sorts keys at every depth", () => {
  assert.equal(canonicalJson({ b: 1, a: { d: [{ z: 1, y: 2 }], c: 0 } }), '{"a":{"c":0,"d":[{"y":2,"z":1}]},"b":1}');
});

test("unix targets map to socket paths; TCP targets to none", () => {
  assert.equal(socketPath("unix:/run/x/registry.sock"), "/run/x/registry.sock");
  assert.equal(socketPath("unix:///run/x/registry.sock"), "/run/x/registry.sock");
  assert.equal(socketPath("unix-abstract:gymrpc"), "\0gymrpc");
  assert.equal(socketPath("127.0.0.1:5000"), undefined);
});
