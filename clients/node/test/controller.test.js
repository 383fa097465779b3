// The controller's orders, its replicas, its checkpoint index and its all-or-nothing restore,
// against fake participants (which write real manifests into a temporary folder).
import assert from "node:assert/strict";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { after, test } from "node:test";
import { create, toJson } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import {
  CheckpointManifestSchema,
  ParticipantKind as Kind,
  ParticipantPhase as Phase,
} from "../gen/gymrpc/v1/participant_service_pb.js";
import {
  Controller,
  CoordinationError,
  GymrpcError,
  INDEX,
  episodeId,
  key,
  manifestPath,
  readIndex,
} from "../src/index.js";

const STACK = {
  "resources/counter": Kind.RESOURCES,
  "agent/counter": Kind.AGENT,
  "model/policy": Kind.MODEL,
  "resources/blackjack": Kind.RESOURCES,
};
const ROOT = mkdtempSync(path.join(tmpdir(), "gymrpc-node-controller-"));
after(() => rmSync(ROOT, { recursive: true, force: true }));
let folders = 0;
const newRoot = () => path.join(ROOT, `root-${folders++}`);

/**
 * A GymClient stand-in: every participant (replica) records its calls by label; `fail[op][label]`
 * makes one throw; `replicas[name]` registers that many replicas of a name. A commit writes the
 * manifest file, as a participant does; with `background`, a commit asked to persist in the
 * background only captures (`persisting`), and `Persist` writes it. The names in `packed` say (GetStatus)
 * that they read a Commit's packed scope.
 */
function fakeClient({
  fail = {},
  prepared = () => true,
  restarts = [],
  extra = {},
  replicas = {},
  background = false,
  packed = [],
} = {}) {
  const calls = [];
  const captures = new Map(); // label -> the commit request a background commit captured
  const kinds = { ...STACK, ...extra };
  const count = (name) => replicas[name] ?? 1;
  const stub = (name, endpointId = "0") => {
    const label = count(name) > 1 ? `${name}#${endpointId}` : name;
    const call = (op, reply) => async (request) => {
      calls.push([op, label, request]);
      if (fail[op]?.[label]) throw new GymrpcError(`${op} broke`, { code: fail[op][label] });
      return typeof reply === "function" ? reply(request) : reply;
    };
    const report = { blockers: [], restarts, blockerCount: 0, counts: {} };
    const phase = prepared(name) ? Phase.PREPARED : Phase.PREPARING;
    const write = (request) => {
      const manifest = create(CheckpointManifestSchema, {
        checkpointId: request.checkpointId,
        kind: kinds[name],
        name,
        endpointId,
        schemaVersion: 1,
      });
      const file = path.join(request.checkpointDir, manifestPath(kinds[name], name, endpointId));
      mkdirSync(path.dirname(file), { recursive: true });
      writeFileSync(file, JSON.stringify(toJson(CheckpointManifestSchema, manifest)));
      return manifest;
    };
    const commit = (request) => {
      if (background && request.persistInBackground) {
        captures.set(label, request);
        return { phase: Phase.COMMITTED, persisting: true };
      }
      return { phase: Phase.COMMITTED, manifest: write(request) };
    };
    const persist = (request) => {
      const captured = captures.get(label);
      assert.equal(request.checkpointId, captured?.checkpointId, "persist of a checkpoint never captured here");
      return { manifest: write(captured) };
    };
    return {
      getStatus: call("status", { kind: kinds[name], phase: Phase.IDLE, acceptsPackedScope: packed.includes(name) }),
      prepare: call("prepare", { phase, report }),
      commit: call("commit", commit),
      persist: call("persist", persist),
      resume: call("resume", { phase: Phase.IDLE }),
      restore: call("restore", { phase: Phase.RESTORED, restored: [] }),
      retire: call("retire", { retired: [] }),
      forget: call("forget", { forgotten: [] }),
    };
  };
  const endpoints = async () =>
    Object.keys(kinds).flatMap((name) =>
      Array.from({ length: count(name) }, (_, i) => ({ name, endpointId: String(i), address: `${name}@${i}` })),
    );
  return { calls, participant: stub, endpoints, replicas };
}

const order = (calls, op) => calls.filter(([o]) => o === op).map(([, label]) => label);
const requests = (calls, op) => new Map(calls.filter(([o]) => o === op).map(([, label, request]) => [label, request]));

async function checkpointed(client) {
  const controller = await Controller.discover(client);
  return controller.checkpoint(newRoot(), { checkpointId: "c1", episodeIds: [episodeId("r1")] });
}

test("discovery keeps participants in prepare order and leaves out non-participants", async () => {
  const client = fakeClient({
    extra: { "tools/search": undefined },
    fail: { status: { "tools/search": Code.Unimplemented } },
  });
  const controller = await Controller.discover(client);
  assert.deepEqual(
    controller.participants.map((p) => p.label),
    ["model/policy", "agent/counter", "resources/blackjack", "resources/counter"],
  );
});

test("every replica is a member of its own, called at its own endpoint, labelled name#id", async () => {
  const client = fakeClient({ replicas: { "resources/counter": 3 } });
  const controller = await Controller.discover(client);
  assert.deepEqual(
    controller.participants.map((p) => p.label),
    [
      "model/policy",
      "agent/counter",
      "resources/blackjack",
      "resources/counter#0",
      "resources/counter#1",
      "resources/counter#2",
    ],
  );
  const result = await controller.checkpoint(newRoot(), { checkpointId: "c1" });
  assert.ok(result.committed);
  for (const op of ["prepare", "commit", "resume"]) assert.equal(order(client.calls, op).length, 6, op);
  assert.deepEqual(
    [...result.manifests].filter(([label]) => label.startsWith("resources/counter")).map(([, m]) => m.endpointId),
    ["0", "1", "2"],
  );
  assert.equal((await controller.status()).size, 6);
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

test("a checkpoint commits the episodes that can continue into <root>/<id>, indexes them, then resumes", async () => {
  const client = fakeClient({ restarts: [episodeId("r2")] });
  const controller = await Controller.discover(client);
  const root = newRoot();
  const result = await controller.checkpoint(root, {
    checkpointId: "c1",
    episodeIds: [episodeId("r1"), episodeId("r2")],
  });
  assert.ok(result.committed);
  assert.equal(result.checkpointDir, path.join(root, "c1"));
  assert.deepEqual(result.continued.map(key), ["r1/a0"]);
  assert.deepEqual(result.restarted.map(key), ["r2/a0"]);
  const commits = [...requests(client.calls, "commit").values()];
  assert.ok(commits.every((r) => r.checkpointDir === result.checkpointDir && r.episodeIds.map(key).join() === "r1/a0"));
  assert.equal(order(client.calls, "resume").length, 4);
  // The index lists every member's manifest, as the Python controller reads it.
  const index = JSON.parse(readFileSync(path.join(result.checkpointDir, INDEX), "utf8"));
  assert.equal(index.checkpoint_id, "c1");
  assert.deepEqual(
    index.members.map((m) => m.manifest_path),
    [
      "model/policy/manifest.json",
      "agent/counter/manifest.json",
      "resources/blackjack/manifest.json",
      "resources/counter/manifest.json",
    ],
  );
  assert.equal(readIndex(result.checkpointDir).members.length, 4);
});

test("the commit scope goes packed to members that read it, as EpisodeId messages to the others", async () => {
  const client = fakeClient({ packed: ["model/policy", "resources/counter"] });
  const controller = await Controller.discover(client);
  const result = await controller.checkpoint(newRoot(), {
    checkpointId: "c1",
    episodeIds: [episodeId("r1"), episodeId("r2", 3)],
  });
  assert.ok(result.committed);
  const commits = requests(client.calls, "commit");
  for (const label of ["model/policy", "resources/counter"]) {
    const r = commits.get(label);
    assert.deepEqual([r.scopeRolloutIds, r.scopeAttempts, r.episodeIds ?? []], [["r1", "r2"], [0, 3], []], label);
    assert.ok(r.explicitScope);
  }
  for (const label of ["agent/counter", "resources/blackjack"]) {
    const r = commits.get(label);
    assert.deepEqual([r.scopeRolloutIds ?? [], r.episodeIds.map(key)], [[], ["r1/a0", "r2/a3"]], label);
    assert.ok(r.explicitScope);
  }
});

test("a non-stop checkpoint resumes right after the capture, then persists and indexes", async () => {
  const client = fakeClient({ background: true });
  const controller = await Controller.discover(client);
  const result = await controller.checkpoint(newRoot(), { checkpointId: "c1" });
  assert.ok(result.committed);
  assert.ok([...requests(client.calls, "commit").values()].every((r) => r.persistInBackground));
  const ops = client.calls.map(([op]) => op).filter((op) => op !== "status" && op !== "prepare");
  assert.deepEqual([...new Set(ops)], ["commit", "resume", "persist"]); // parked for the capture only
  assert.equal(ops.lastIndexOf("resume") < ops.indexOf("persist"), true);
  assert.equal(readIndex(result.checkpointDir).members.length, 4);
  assert.deepEqual(
    [...result.manifests.values()].map((m) => m.name),
    ["model/policy", "agent/counter", "resources/blackjack", "resources/counter"],
  );
});

test("a non-stop checkpoint whose persist fails is resumed, raises, and is never indexed", async () => {
  const client = fakeClient({ background: true, fail: { persist: { "resources/counter": Code.FailedPrecondition } } });
  const controller = await Controller.discover(client);
  const root = newRoot();
  await assert.rejects(controller.checkpoint(root, { checkpointId: "c1" }), (err) => {
    assert.ok(err instanceof CoordinationError);
    assert.deepEqual([...err.failures.keys()], ["resources/counter"]);
    return true;
  });
  assert.equal(order(client.calls, "resume").length, 4); // once, after the capture, not again
  assert.ok(!existsSync(path.join(root, "c1", INDEX)));
});

test("with nonstop false or stop, the commit writes before anyone resumes", async () => {
  for (const options of [{ nonstop: false }, { stop: true }]) {
    const client = fakeClient({ background: true });
    const controller = await Controller.discover(client);
    const result = await controller.checkpoint(newRoot(), { checkpointId: "c1", ...options });
    assert.ok(result.committed, JSON.stringify(options));
    assert.ok([...requests(client.calls, "commit").values()].every((r) => !r.persistInBackground));
    assert.deepEqual(order(client.calls, "persist"), []);
    assert.equal(order(client.calls, "resume").length, options.stop ? 0 : 4);
  }
});

test("a commit that fails on one replica leaves no index, and a restore refuses the folder", async () => {
  const fail = { commit: { "resources/counter#1": Code.Unavailable } };
  const client = fakeClient({ replicas: { "resources/counter": 2 }, fail });
  const controller = await Controller.discover(client);
  const root = newRoot();
  await assert.rejects(controller.checkpoint(root, { checkpointId: "c1" }), CoordinationError);
  const folder = path.join(root, "c1");
  assert.ok(existsSync(path.join(folder, "resources/counter/manifest.json")));
  assert.ok(!existsSync(path.join(folder, INDEX)));

  const fresh = fakeClient({ replicas: { "resources/counter": 2 } });
  const restorer = await Controller.discover(fresh);
  await assert.rejects(
    restorer.restore("r-1", { checkpointDir: folder, episodeIds: [episodeId("r1", 0)] }),
    (err) => err.reason === "CHECKPOINT_INCOMPLETE" && /the checkpoint is incomplete/.test(err.message),
  );
  assert.deepEqual(order(fresh.calls, "restore"), []); // refused before any participant was asked
  // The escape hatch: the caller names the replicas that committed.
  const sources = { "resources/counter": ["0"] };
  await restorer.restore("r-2", { checkpointDir: folder, episodeIds: [episodeId("r1", 0)], sources });
  assert.deepEqual(requests(fresh.calls, "restore").get("resources/counter#1").sourceEndpointIds, ["0"]);
});

test("a restore reads the replicas the index lists and places them over the replicas there are now", async () => {
  const { checkpointDir } = await checkpointed(fakeClient({ replicas: { "resources/counter": 2 } }));
  const fresh = fakeClient({ replicas: { "resources/counter": 3, "model/policy": 2 } });
  const controller = await Controller.discover(fakeClient()); // a stack seen earlier: restore discovers again
  controller.client = fresh;
  const replies = await controller.restore("r-1", { checkpointDir, episodeIds: [episodeId("r1", 0)] });
  assert.equal(replies.size, 7);
  const sent = requests(fresh.calls, "restore");
  for (const id of ["0", "1", "2"]) {
    const request = sent.get(`resources/counter#${id}`);
    assert.deepEqual(request.sourceEndpointIds, ["0", "1"]);
    assert.deepEqual(request.endpointIds, ["0", "1", "2"]);
    assert.equal(request.endpointId, id);
  }
  assert.deepEqual(sent.get("model/policy#1").sourceEndpointIds, ["0"]);
  assert.deepEqual(sent.get("model/policy#1").endpointIds, ["0", "1"]);
  assert.deepEqual(sent.get("agent/counter").endpointIds, ["0"]);
});

test("a tampered manifest or index is refused before any participant is asked", async () => {
  for (const damage of [
    (dir) => writeFileSync(path.join(dir, "resources/counter#1/manifest.json"), "{}"),
    (dir) => {
      const index = JSON.parse(readFileSync(path.join(dir, INDEX), "utf8"));
      index.members = index.members.filter((m) => m.endpoint_id !== "1");
      writeFileSync(path.join(dir, INDEX), JSON.stringify(index));
    },
    (dir) => writeFileSync(path.join(dir, INDEX), "{not json"),
  ]) {
    const { checkpointDir } = await checkpointed(fakeClient({ replicas: { "resources/counter": 2 } }));
    damage(checkpointDir);
    const fresh = fakeClient({ replicas: { "resources/counter": 2 } });
    await assert.rejects(
      (await Controller.discover(fresh)).restore("r-1", { checkpointDir, episodeIds: [episodeId("r1", 0)] }),
      (err) => err.code === Code.DataLoss,
    );
    assert.deepEqual(order(fresh.calls, "restore"), []);
  }
});

test("a failed restore retires the new attempts, callers first, and resumes everyone", async () => {
  const { checkpointDir } = await checkpointed(fakeClient());
  const client = fakeClient({ fail: { restore: { "resources/counter": Code.DataLoss } } });
  const controller = await Controller.discover(client);
  await assert.rejects(
    controller.restore("r-1", { checkpointDir, episodeIds: [episodeId("r1", 0)] }),
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
