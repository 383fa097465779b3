// The controller's orders and its all-or-nothing restore, against fake participants.
import assert from "node:assert/strict";
import { test } from "node:test";
import { Code } from "@connectrpc/connect";
import { ParticipantKind as Kind, ParticipantPhase as Phase } from "../gen/gymrpc/v1/participant_service_pb.js";
import { Controller, CoordinationError, GymrpcError, episodeId, key } from "../src/index.js";

const STACK = {
  "resources/counter": Kind.RESOURCES,
  "agent/counter": Kind.AGENT,
  "model/policy": Kind.MODEL,
  "resources/blackjack": Kind.RESOURCES,
};

/** A GymClient stand-in: every participant records its calls; `fail[op][name]` makes one throw. */
function fakeClient({ fail = {}, prepared = () => true, restarts = [], extra = {} } = {}) {
  const calls = [];
  const stub = (name) => {
    const call = (op, reply) => async (request) => {
      calls.push([op, name, request]);
      if (fail[op]?.[name]) throw new GymrpcError(`${op} broke`, { code: fail[op][name] });
      return reply;
    };
    const report = { blockers: [], restarts, blockerCount: 0, counts: {} };
    const phase = prepared(name) ? Phase.PREPARED : Phase.PREPARING;
    return {
      getStatus: call("status", { kind: { ...STACK, ...extra }[name], phase: Phase.IDLE }),
      prepare: call("prepare", { phase, report }),
      commit: call("commit", { phase: Phase.COMMITTED, manifest: { name } }),
      resume: call("resume", { phase: Phase.IDLE }),
      restore: call("restore", { phase: Phase.RESTORED, restored: [] }),
      retire: call("retire", { retired: [] }),
      forget: call("forget", { forgotten: [] }),
    };
  };
  const names = Object.keys({ ...STACK, ...extra });
  return { calls, participant: stub, endpoints: async () => names.map((name) => ({ name })) };
}

const order = (calls, op) => calls.filter(([o]) => o === op).map(([, name]) => name);

test("discovery keeps participants in prepare order and leaves out non-participants", async () => {
  const client = fakeClient({
    extra: { "tools/search": undefined },
    fail: { status: { "tools/search": Code.Unimplemented } },
  });
  const controller = await Controller.discover(client);
  assert.deepEqual(
    controller.participants.map((p) => p.name),
    ["model/policy", "agent/counter", "resources/blackjack", "resources/counter"],
  );
});

test("prepare goes stage by stage and stops at the first stage not prepared", async () => {
  const client = fakeClient({ prepared: (name) => name !== "agent/counter" });
  const controller = await Controller.discover(client);
  const result = await controller.prepare("c1");
  assert.equal(result.prepared, false);
  assert.deepEqual(order(client.calls, "prepare"), ["model/policy", "agent/counter"]); // resources never closed
});

test("resume runs in reverse order past failures, then reports them", async () => {
  const client = fakeClient({ fail: { resume: { "agent/counter": Code.Unavailable } } });
  const controller = await Controller.discover(client);
  await assert.rejects(controller.resume("c1"), (err) => {
    assert.ok(err instanceof CoordinationError);
    assert.deepEqual([...err.failures.keys()], ["agent/counter"]);
    return true;
  });
  assert.deepEqual(order(client.calls, "resume"), [
    "resources/blackjack",
    "resources/counter",
    "agent/counter",
    "model/policy",
  ]);
});

test("a checkpoint commits the episodes that can continue into <root>/<id>, then resumes", async () => {
  const client = fakeClient({ restarts: [episodeId("r2")] });
  const controller = await Controller.discover(client);
  const result = await controller.checkpoint("/ckpts", {
    checkpointId: "c1",
    episodeIds: [episodeId("r1"), episodeId("r2")],
  });
  assert.ok(result.committed);
  assert.equal(result.checkpointDir, "/ckpts/c1");
  assert.deepEqual(result.continued.map(key), ["r1/a0"]);
  assert.deepEqual(result.restarted.map(key), ["r2/a0"]);
  const commits = client.calls.filter(([op]) => op === "commit").map(([, , request]) => request);
  assert.ok(commits.every((r) => r.checkpointDir === "/ckpts/c1" && r.episodeIds.map(key).join() === "r1/a0"));
  assert.equal(order(client.calls, "resume").length, 4);
});

test("a failed restore retires the new attempts, callers first, and resumes everyone", async () => {
  const client = fakeClient({ fail: { restore: { "resources/counter": Code.DataLoss } } });
  const controller = await Controller.discover(client);
  await assert.rejects(
    controller.restore("r-1", { checkpointDir: "/ckpts/c1", episodeIds: [episodeId("r1", 0)] }),
    (err) => err instanceof CoordinationError && err.failures.get("resources/counter").code === Code.DataLoss,
  );
  assert.deepEqual(order(client.calls, "retire"), [
    "agent/counter",
    "model/policy",
    "resources/blackjack",
    "resources/counter",
  ]);
  const retired = client.calls.find(([op]) => op === "retire")[2];
  assert.deepEqual(retired.episodeIds.map(key), ["r1/a1"]);
  assert.equal(order(client.calls, "resume").length, 4);
});
