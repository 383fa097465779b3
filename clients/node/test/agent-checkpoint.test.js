// The checkpoint scenario of checkpoint.test.js through the agent server (the agent serves
// ParticipantService; tests/clients/test_node.py skips this file on a stack whose agent does not).
//   checkpoint: an episode started with RunStream and checkpointed mid-way (prepare, commit,
//               resume), then a SIGKILL of the whole stack while the episode is still running;
//   restore:    in a fresh stack, restore the checkpoint, resume, and Run the episode as
//               attempt 1: the agent continues it from where the checkpoint left it.
import assert from "node:assert/strict";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { Code } from "@connectrpc/connect";
import { EpisodePhase } from "../gen/gymrpc/v1/agent_service_pb.js";
import { ParticipantKind, ParticipantPhase } from "../gen/gymrpc/v1/participant_service_pb.js";
import { Controller, GymClient, episodeId, key, newCheckpointId } from "../src/index.js";
import { NEEDS_STACK, counterTask, killStack } from "./support.js";

const PHASE = process.env.GYMRPC_NODE_PHASE;
const SCENARIO_DIR = process.env.GYMRPC_NODE_SCENARIO_DIR;
const ROLLOUT = "node-ckpt";
const AGENT = "agent/counter";

function phase(name) {
  if (NEEDS_STACK) return NEEDS_STACK;
  if (PHASE === name && SCENARIO_DIR) return false;
  return `a phase of the checkpoint scenario: set GYMRPC_NODE_PHASE=${name} and GYMRPC_NODE_SCENARIO_DIR`;
}

const handOver = () => path.join(SCENARIO_DIR, "agent-handover.json");

const CHECKPOINT = "checkpoint: an episode is checkpointed mid-way, then the whole stack is SIGKILLed";
const RESTORE = "restore: a fresh stack continues the episode as attempt 1";

test(CHECKPOINT, { skip: phase("checkpoint") }, async () => {
  const gym = new GymClient();
  try {
    const controller = await Controller.discover(gym);
    const kinds = Object.fromEntries(controller.participants.map((p) => [p.name, p.kind]));
    assert.equal(kinds[AGENT], ParticipantKind.AGENT);
    assert.equal(kinds["resources/counter"], ParticipantKind.RESOURCES);
    assert.equal(kinds["model/policy"], ParticipantKind.MODEL);
    for (const status of (await controller.status()).values()) assert.equal(status.phase, ParticipantPhase.IDLE);

    // Start the episode and wait until both increments have run: the model's second call
    // (slow: the stack's model emits tokens with a delay) is then in flight.
    const request = { task: counterTask(0), episodeId: episodeId(ROLLOUT, 0), policyVersion: "node:0" };
    const events = gym.agent(AGENT).runStream({ request })[Symbol.asyncIterator]();
    for (;;) {
      const { value, done } = await events.next();
      assert.ok(!done && value.event.case === "progress", "the episode ended before the checkpoint");
      const progress = value.event.value;
      if (progress.phase === EpisodePhase.READY_FOR_MODEL && progress.step === 1) break;
    }

    const result = await controller.checkpoint(path.join(SCENARIO_DIR, "checkpoints"), {
      checkpointId: newCheckpointId("node"),
      episodeIds: [episodeId(ROLLOUT, 0)],
    });
    assert.ok(result.committed, `not prepared; blockers: ${JSON.stringify([...result.prepare.blockers().keys()])}`);
    assert.deepEqual(result.continued.map(key), [`${ROLLOUT}/a0`]);
    assert.deepEqual([...result.manifests.keys()].sort(), controller.participants.map((p) => p.name).sort());
    for (const name of [AGENT, "resources/counter"]) {
      assert.deepEqual(result.manifests.get(name).episodeIds.map(key), [`${ROLLOUT}/a0`], name);
    }

    killStack();
    // The stack is gone: the open episode fails instead of finishing.
    await assert.rejects(
      (async () => {
        for (let next = await events.next(); !next.done; next = await events.next());
      })(),
      (err) => err.code === Code.Unavailable,
    );
    mkdirSync(SCENARIO_DIR, { recursive: true });
    writeFileSync(handOver(), JSON.stringify({ checkpointDir: result.checkpointDir }));
  } finally {
    gym.close();
  }
});

test(RESTORE, { skip: phase("restore") }, async () => {
  const { checkpointDir } = JSON.parse(readFileSync(handOver(), "utf8"));
  const restoreId = newCheckpointId("restore");
  const gym = new GymClient();
  try {
    const controller = await Controller.discover(gym);
    const restored = await controller.restore(restoreId, { checkpointDir, episodeIds: [episodeId(ROLLOUT, 0)] });
    assert.deepEqual(restored.get(AGENT).restored.map(key), [`${ROLLOUT}/a1`]);
    for (const status of (await controller.status()).values()) assert.equal(status.phase, ParticipantPhase.RESTORED);
    await controller.resume(restoreId);

    const trajectory = await gym.run(counterTask(0), {
      agent: AGENT,
      episodeId: episodeId(ROLLOUT, 1),
      policyVersion: "node:0",
      timeoutMs: 60_000,
    });
    assert.equal(key(trajectory.episodeId), `${ROLLOUT}/a1`);
    assert.equal(trajectory.resumeCount, 1);
    // The increments ran once, before the checkpoint: run again on the restored counter
    // they would count 9, and a fresh session would count 3. Only a true continuation reads 6.
    assert.deepEqual(
      trajectory.toolCalls.map((r) => `${r.call.name} ${r.output}`),
      ['increment_counter {"success": true}', 'increment_counter {"success": true}', 'get_counter_value {"count": 6}'],
    );
    assert.equal(trajectory.reward, 1);
  } finally {
    gym.close();
  }
});
