// A stand-in agent for the checkpoint scenario: the episode loop of servers/agent/loop.py,
// driven from Node against the real resources and model servers (as
// tests/control/test_process.py does from Python). Its state at the last boundary is plain
// JSON, so that it crosses the crash in a hand-over file, as the agent participant's records do.
import { create, fromJson, toJson } from "@bufbuild/protobuf";
import { MessageSchema, Role, TaskSchema, ToolDefinitionSchema } from "../gen/gymrpc/v1/common_pb.js";
import { episodeId } from "../src/index.js";

const MAX_STEPS = 8;
export const Phase = { NEW: "new", MODEL: "ready_for_model", TOOL: "ready_for_tool", VERIFY: "ready_for_verify" };

export class StandInEpisode {
  /** @param {import("../src/client.js").GymClient} gym */
  /**
   * `callTimeoutMs`: how long one call may take, retries after UNAVAILABLE included (the agent's
   * call timeout); `signal`: aborts every call (the stand-in dies with the stack).
   */
  constructor(
    gym,
    state,
    { resources = "resources/counter", model = "model/policy", callTimeoutMs = 30_000, signal } = {},
  ) {
    this.state = state;
    const options = { timeoutMs: callTimeoutMs, signal };
    const bind = (stub) =>
      Object.fromEntries(Object.entries(stub).map(([name, call]) => [name, (request) => call(request, options)]));
    this.resources = bind(gym.resources(resources));
    this.model = bind(gym.model(model));
  }

  static start(gym, rolloutId, task, options) {
    const state = {
      rolloutId,
      attempt: 0,
      sessionId: `${rolloutId}-a0`, // kept by later attempts: a restored session keeps its id
      task,
      phase: Phase.NEW,
      step: 0,
      messages: [],
      tools: [],
      pending: [],
      toolCalls: [], // {name, output}, in order
      reward: undefined,
    };
    return new StandInEpisode(gym, state, options);
  }

  get episodeId() {
    return episodeId(this.state.rolloutId, this.state.attempt);
  }

  /** One transition from the current boundary to the next (servers/agent/loop.py `advance`). */
  async advance() {
    const s = this.state;
    const ids = { sessionId: s.sessionId, episodeId: this.episodeId };
    if (s.phase === Phase.NEW) {
      const reply = await this.resources.seedSession({ ...ids, task: s.task });
      s.messages = [...s.task.input, ...reply.observations.map((m) => ({ ...m, role: Role.USER }))];
      s.tools = s.task.tools.length ? s.task.tools : reply.tools;
      s.phase = Phase.MODEL;
    } else if (s.phase === Phase.MODEL) {
      const request = { requestId: `${s.rolloutId}/a${s.attempt}/step${s.step}`, episodeId: this.episodeId };
      const reply = await this.model.generate({
        ...request,
        messages: s.messages,
        tools: s.tools,
        sampling: s.task.sampling,
      });
      const message = { ...reply.message, role: Role.ASSISTANT };
      message.toolCalls = message.toolCalls.map((call, i) => ({ ...call, id: `call_${s.step}_${i}` }));
      s.messages.push(message);
      s.step += 1;
      s.pending = [...message.toolCalls]; // a copy: running them must not edit the message
      s.phase = s.pending.length && s.step < MAX_STEPS ? Phase.TOOL : Phase.VERIFY;
    } else if (s.phase === Phase.TOOL) {
      const call = s.pending.shift();
      const reply = await this.resources.callTool({ ...ids, call });
      s.messages.push({ role: Role.TOOL, toolCallId: call.id, name: call.name, content: reply.output });
      s.toolCalls.push({ name: call.name, output: reply.output });
      if (!s.pending.length) s.phase = Phase.MODEL;
    } else if (s.phase === Phase.VERIFY) {
      s.reward = (await this.resources.verify({ ...ids, messages: s.messages })).reward;
      await this.resources.closeSession(ids);
      s.phase = undefined;
    }
  }

  /** Advance until `done(state)` holds, or the episode ends. */
  async runUntil(done = () => false) {
    while (this.state.phase && !done(this.state)) await this.advance();
    return this.state;
  }

  /** The state as JSON text (messages, tools and task in the protobuf JSON form). */
  toJSON() {
    const s = this.state;
    const message = (m) => toJson(MessageSchema, create(MessageSchema, m));
    return {
      ...s,
      task: toJson(TaskSchema, s.task),
      messages: s.messages.map(message),
      tools: s.tools.map((t) => toJson(ToolDefinitionSchema, create(ToolDefinitionSchema, t))),
      pending: s.pending.map(({ id, name, argumentsJson }) => ({ id, name, argumentsJson })),
    };
  }

  static fromJSON(gym, json, options) {
    const state = {
      ...json,
      task: fromJson(TaskSchema, json.task),
      messages: json.messages.map((m) => fromJson(MessageSchema, m)),
      tools: json.tools.map((t) => fromJson(ToolDefinitionSchema, t)),
    };
    return new StandInEpisode(gym, state, options);
  }
}
