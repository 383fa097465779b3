// The checkpoint scenario of agent-checkpoint.test.js with two replicas of resources/counter,
// restored onto three: the controller reaches every replica, each commits its own folder (two
// manifests), and each new replica installs the sessions placed on it, where the agent's calls
// then go. tests/clients/test_node.py starts the stacks (resources x2, then x3) and passes where
// `gymrpc.balancing.place` puts each episode's session (GYMRPC_NODE_PLACEMENT).
//   checkpoint: episodes run to a boundary, a `stop` checkpoint parks them, the stack is SIGKILLed;
//   restore:    a fresh stack with another replica count restores, and every episode continues.
import assert from "node:assert/strict";
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { EpisodePhase } from "../gen/gymrpc/v1/agent_service_pb.js";
import { ParticipantKind } from "../gen/gymrpc/v1/participant_service_pb.js";
import { Controller, GymClient, episodeId, key, newCheckpointId, readIndex } from "../src/index.js";
import { NEEDS_STACK, counterTask, killStack } from "./support.js";

const PHASE = process.env.GYMRPC_NODE_PHASE;
const SCENARIO_DIR = process.env.GYMRPC_NODE_SCENARIO_DIR;
const PLACEMENT = process.env.GYMRPC_NODE_PLACEMENT; // {checkpoint: {rollout: id}, restore: {rollout: id}}
const AGENT = "agent/counter";
const RESOURCES = "resources/counter";
const EPISODES = Array.from({ length: 6 }, (_, i) => `node-rep-${i}`);

function phase(name) {
  if (NEEDS_STACK) return NEEDS_STACK;
  if (PHASE === name && SCENARIO_DIR && PLACEMENT) return false;
  const needs = "GYMRPC_NODE_SCENARIO_DIR and GYMRPC_NODE_PLACEMENT";
  return `a phase of the replica scenario: set GYMRPC_NODE_PHASE=${name}, ${needs}`;
}

const handOver = () => path.join(SCENARIO_DIR, "replicas-handover.json");
/** Rollout ids by the replica `place` puts their session on, for `ids` replicas. */
function placed(which, ids) {
  const table = JSON.parse(PLACEMENT)[which];
  return Object.fromEntries(ids.map((id) => [id, EPISODES.filter((e) => table[e] === id)]));
}

const CHECKPOINT = "checkpoint: both replicas of resources/counter commit their own folder";
const RESTORE = "restore: three replicas install the sessions placed on them and every episode continues";

test(CHECKPOINT, { skip: phase("checkpoint") }, async () => {
  const gym = new GymClient();
  try {
    const controller = await Controller.discover(gym);
    assert.deepEqual(
      controller.participants.filter((p) => p.kind === ParticipantKind.RESOURCES).map((p) => p.label),
      [`${RESOURCES}#0`, `${RESOURCES}#1`],
    );

    // Every episode runs until its second model call: both increments ran on its session's replica.
    const streams = EPISODES.map((rollout, i) => {
      const request = { task: counterTask(i % 5), episodeId: episodeId(rollout, 0), policyVersion: "node:0" };
      return gym.agent(AGENT).runStream({ request })[Symbol.asyncIterator]();
    });
    await Promise.all(
      streams.map(async (events) => {
        for (;;) {
          const { value, done } = await events.next();
          assert.ok(!done && value.event.case === "progress", "an episode ended before the checkpoint");
          if (value.event.value.phase === EpisodePhase.READY_FOR_MODEL && value.event.value.step === 1) return;
        }
      }),
    );

    const scope = EPISODES.map((e) => episodeId(e, 0));
    const result = await controller.checkpoint(path.join(SCENARIO_DIR, "checkpoints"), {
      checkpointId: newCheckpointId("node-replicas"),
      episodeIds: scope,
      stop: true, // the stack is about to go: nothing moves past the checkpoint
    });
    assert.ok(result.committed, `not prepared; blockers: ${JSON.stringify([...result.prepare.blockers().keys()])}`);
    // Two manifests of resources/counter, each holding the sessions of its own replica.
    const expected = placed("checkpoint", ["0", "1"]);
    for (const id of ["0", "1"]) {
      const manifest = result.manifests.get(`${RESOURCES}#${id}`);
      assert.equal(manifest.endpointId, id);
      assert.deepEqual(manifest.episodeIds.map(key).sort(), expected[id].map((e) => `${e}/a0`).sort(), id);
    }
    assert.deepEqual(result.manifests.get(AGENT).episodeIds.map(key).sort(), scope.map(key).sort());
    // Indexed last: every member, replicas apart.
    assert.deepEqual(
      readIndex(result.checkpointDir).members.map((m) => m.manifestPath),
      [
        "model/policy/manifest.json",
        "agent/counter/manifest.json",
        "resources/counter/manifest.json",
        "resources/counter#1/manifest.json",
      ],
    );

    killStack();
    await Promise.allSettled(streams.map((events) => events.return?.()));
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
    const next = (rollouts) => rollouts.map((e) => `${e}/a1`).sort();
    const episodeIds = EPISODES.map((e) => episodeId(e, 0));
    const restored = await controller.restore(restoreId, { checkpointDir, episodeIds });
    const expected = placed("restore", ["0", "1", "2"]);
    for (const id of ["0", "1", "2"]) {
      assert.deepEqual(restored.get(`${RESOURCES}#${id}`).restored.map(key).sort(), next(expected[id]), id);
    }
    assert.deepEqual(restored.get(AGENT).restored.map(key).sort(), next(EPISODES));
    await controller.resume(restoreId);

    const trajectories = await Promise.all(
      EPISODES.map((rollout, i) =>
        gym.run(counterTask(i % 5), {
          agent: AGENT,
          episodeId: episodeId(rollout, 1),
          policyVersion: "node:0",
          timeoutMs: 60_000,
        }),
      ),
    );
    for (const [i, trajectory] of trajectories.entries()) {
      // Continued from the checkpoint (not started over), on the session its increments ran on once.
      assert.equal(key(trajectory.episodeId), `${EPISODES[i]}/a1`);
      assert.equal(trajectory.resumeCount, 1, EPISODES[i]);
      assert.equal(trajectory.reward, 1, EPISODES[i]);
    }
  } finally {
    gym.close();
  }
});
