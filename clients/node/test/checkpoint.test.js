// The coordinated-checkpoint scenario, in two phases against two stacks (docs/design.md §7):
//   checkpoint: an episode runs to a boundary, its next model call is in flight, and the
//               controller checkpoints the stack (the model cuts the call); then a SIGKILL of
//               the whole stack;
//   restore:    in a fresh stack, restore, resume, check that attempt 0 is fenced, and
//               continue the episode as attempt 1 from the checkpointed boundary.
// The episode is driven from Node by a stand-in agent (./standin-agent.js), so the scenario
// talks to the resources and model participants directly and reads the committed records
// itself; agent-checkpoint.test.js is the same scenario through AgentService.
// tests/clients/test_node.py runs the phases with GYMRPC_NODE_PHASE and GYMRPC_NODE_SCENARIO_DIR
// (the checkpoint root and the hand-over between the phases) and starts each stack itself.
import assert from "node:assert/strict";
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { ParticipantKind, ParticipantPhase } from "../gen/gymrpc/v1/participant_service_pb.js";
import { Controller, GymClient, GymrpcError, episodeId, key, newCheckpointId, readRecords } from "../src/index.js";
import { Phase, StandInEpisode } from "./standin-agent.js";
import { NEEDS_STACK, counterTask, killStack } from "./support.js";

const PHASE = process.env.GYMRPC_NODE_PHASE;
const SCENARIO_DIR = process.env.GYMRPC_NODE_SCENARIO_DIR;
const ROLLOUT = "node-standin";

function phase(name) {
  if (NEEDS_STACK) return NEEDS_STACK;
  if (PHASE === name && SCENARIO_DIR) return false;
  return `a phase of the checkpoint scenario: set GYMRPC_NODE_PHASE=${name} and GYMRPC_NODE_SCENARIO_DIR`;
}

const handOver = () => path.join(SCENARIO_DIR, "standin-handover.json");

test(
  "checkpoint: a model call in flight is cut, the stack is checkpointed, then SIGKILLed",
  { skip: phase("checkpoint") },
  async () => {
    const gym = new GymClient();
    try {
      const controller = await Controller.discover(gym);
      assert.deepEqual(
        controller.participants.map((p) => [p.name, p.kind]),
        [
          ["model/policy", ParticipantKind.MODEL],
          ["resources/counter", ParticipantKind.RESOURCES],
        ],
      );

      // Both increments run (the counter goes 3 -> 6), then the second model call starts; the
      // stack's model emits a token every 50 ms, so the call is still running at the checkpoint.
      const agentDies = new AbortController();
      const episode = StandInEpisode.start(gym, ROLLOUT, counterTask(0), { signal: agentDies.signal });
      await episode.runUntil((s) => s.phase === Phase.MODEL && s.step === 1);
      const boundary = episode.toJSON();
      const inFlight = episode.advance();
      await sleep(50);

      const result = await controller.checkpoint(path.join(SCENARIO_DIR, "checkpoints"), {
        checkpointId: newCheckpointId("node"),
        episodeIds: [episodeId(ROLLOUT, 0)],
        stop: true, // the stack is about to go: stay closed, nothing moves past the checkpoint
      });
      assert.ok(result.committed, `not prepared: ${JSON.stringify([...result.prepare.blockers().keys()])}`);
      for (const name of ["model/policy", "resources/counter"]) {
        assert.deepEqual(result.manifests.get(name).episodeIds.map(key), [`${ROLLOUT}/a0`], name);
      }
      const model = (await controller.status()).get("model/policy");
      assert.equal(model.phase, ParticipantPhase.COMMITTED);
      // The call in flight was cut: the model's record of the episode keeps the prefix it had.
      const [record] = readRecords(result.checkpointDir, result.manifests.get("model/policy"));
      assert.equal(key(record.episodeId), `${ROLLOUT}/a0`);
      assert.equal(record.body.case, "modelEpisode");
      assert.equal(record.body.value.cuts.length, 1);
      assert.equal(record.body.value.cuts[0].sourceRequestId, `${ROLLOUT}/a0/step1`);
      const settled = await Promise.race([inFlight.then(() => "delivered"), sleep(200).then(() => "held")]);
      assert.equal(settled, "held"); // and nothing of it reaches the episode past the checkpoint

      killStack();
      agentDies.abort(); // the stand-in agent goes down with the stack
      await assert.rejects(inFlight, GymrpcError);
      writeFileSync(handOver(), JSON.stringify({ checkpointDir: result.checkpointDir, boundary }));
    } finally {
      gym.close();
    }
  },
);

test(
  "restore: a fresh stack fences attempt 0 and continues the episode as attempt 1",
  { skip: phase("restore") },
  async () => {
    const { checkpointDir, boundary } = JSON.parse(readFileSync(handOver(), "utf8"));
    const restoreId = newCheckpointId("restore");
    const gym = new GymClient();
    try {
      const controller = await Controller.discover(gym);
      const restored = await controller.restore(restoreId, { checkpointDir, episodeIds: [episodeId(ROLLOUT, 0)] });
      for (const [name, reply] of restored) assert.deepEqual(reply.restored.map(key), [`${ROLLOUT}/a1`], name);
      for (const status of (await controller.status()).values()) assert.equal(status.phase, ParticipantPhase.RESTORED);
      await controller.resume(restoreId);

      const stale = StandInEpisode.fromJSON(gym, boundary);
      await assert.rejects(stale.advance(), (err) => err.reason === "STALE_ATTEMPT");

      const episode = StandInEpisode.fromJSON(gym, { ...boundary, attempt: 1 });
      const end = await episode.runUntil();
      // The increments ran once, before the checkpoint: run again on the restored counter they
      // would make it 9, and a fresh session would read 3. Only a true continuation reads 6.
      assert.deepEqual(
        end.toolCalls.map((c) => `${c.name} ${c.output}`),
        [
          'increment_counter {"success": true}',
          'increment_counter {"success": true}',
          'get_counter_value {"count": 6}',
        ],
      );
      assert.equal(end.reward, 1);
      const model = (await controller.status()).get("model/policy");
      assert.equal(model.report.counts.restored_cuts, 0n); // the cut call was continued, not lost
    } finally {
      gym.close();
    }
  },
);
