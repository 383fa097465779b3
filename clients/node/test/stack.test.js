// Against a live Python stack (the default one, or any with agent/counter and resources/counter).
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { Code } from "@connectrpc/connect";
import { EpisodePhase } from "../gen/gymrpc/v1/agent_service_pb.js";
import { GymClient, GymrpcError, episodeId } from "../src/index.js";
import { NEEDS_STACK, counterTask, server, waitFor } from "./support.js";

describe("a live stack", { skip: NEEDS_STACK }, () => {
  let gym;
  before(() => {
    gym = new GymClient();
  });
  after(() => gym?.close());

  test("names resolve to the addresses the servers registered", async () => {
    assert.equal(await gym.resolve("agent/counter"), server("agent/counter").address);
    const names = (await gym.endpoints("resources/")).map((e) => e.name);
    assert.ok(names.includes("resources/counter"), names.join(", "));
    await assert.rejects(gym.resolve("agent/never-registered"), (err) => {
      assert.ok(err instanceof GymrpcError);
      assert.equal(err.code, Code.NotFound);
      assert.equal(err.metadata.name, "agent/never-registered");
      assert.match(err.message, /agent\/counter/); // the registry lists what is registered
      return true;
    });
  });

  test("an episode runs to the end through the agent's stable name", async () => {
    const trajectory = await gym.run(counterTask(0), {
      agent: "agent/counter",
      episodeId: episodeId(`node-run-${process.pid}`),
      policyVersion: "node:0",
    });
    assert.equal(trajectory.episodeId.rolloutId, `node-run-${process.pid}`);
    assert.equal(trajectory.reward, 1);
    assert.deepEqual(
      trajectory.toolCalls.map((r) => r.call.name),
      ["increment_counter", "increment_counter", "get_counter_value"],
    );
    assert.equal(trajectory.modelCalls.length, trajectory.steps);
    assert.ok(trajectory.modelCalls.every((c) => c.tokens.completionTokenIds.length > 0));
  });

  test("RunStream reports every boundary, then the trajectory", async () => {
    const phases = [];
    let trajectory;
    const request = {
      task: counterTask(1),
      episodeId: episodeId(`node-stream-${process.pid}`),
      policyVersion: "node:0",
    };
    for await (const event of gym.agent("agent/counter").runStream({ request })) {
      if (event.event.case === "progress") phases.push(event.event.value.phase);
      else trajectory = event.event.value;
    }
    assert.equal(phases[0], EpisodePhase.READY_FOR_MODEL);
    assert.equal(phases.at(-1), EpisodePhase.COMPLETED);
    assert.equal(trajectory.reward, 1);
  });

  test("a SIGKILLed agent is followed to the port its restart registers", async () => {
    const before = server("agent/counter");
    assert.equal(await gym.resolve("agent/counter"), before.address);
    process.kill(before.pid, "SIGKILL");
    const trajectory = await gym.run(counterTask(2), {
      agent: "agent/counter",
      episodeId: episodeId(`node-kill-${process.pid}`),
      policyVersion: "node:0",
      timeoutMs: 60_000,
    });
    assert.equal(trajectory.reward, 1);
    // stack.json names the new pid as soon as it is spawned, and its address only once it serves.
    const restarted = () => {
      const now = server("agent/counter");
      return now.pid !== before.pid && now.state === "serving" && now;
    };
    const after = await waitFor(restarted, { what: "the restarted agent serving in stack.json" });
    // The kernel may hand the restart the same free port; what matters is that the name follows it.
    assert.equal(await gym.resolve("agent/counter"), after.address);
  });
});
