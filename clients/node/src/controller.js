// A coordinated-checkpoint controller (SPEC §7) over `gymrpc.v1.ParticipantService`.
//
// Every server of a stack is a participant. The controller finds them through the registry,
// prepares them stage by stage (environment, model, agent, resources: each stage parks what
// the next one waits on), commits all at once, resumes in reverse order, and restores a
// committed checkpoint into fresh processes all or nothing. Participants do the fencing,
// idempotency and lease work; the controller's duties are the orders, the deadlines, and
// cleaning up after a failed restore. Every call carries an absolute deadline, which also
// sets the participant's lease: a controller that vanishes leaves nothing closed for long.
import path from "node:path";
import { create } from "@bufbuild/protobuf";
import { timestampFromMs } from "@bufbuild/protobuf/wkt";
import { Code } from "@connectrpc/connect";
import { EpisodeIdSchema } from "../gen/gymrpc/v1/common_pb.js";
import { ParticipantKind, ParticipantPhase } from "../gen/gymrpc/v1/participant_service_pb.js";
import { toGymrpcError } from "./errors.js";

export const PREPARE_ORDER = [
  ParticipantKind.ENVIRONMENT,
  ParticipantKind.MODEL,
  ParticipantKind.AGENT,
  ParticipantKind.RESOURCES,
];
export const RESUME_ORDER = [...PREPARE_ORDER].reverse();
/** Callers before callees, so that no retired caller re-creates state in a callee already retired. */
export const RETIRE_ORDER = [
  [ParticipantKind.ENVIRONMENT],
  [ParticipantKind.AGENT],
  [ParticipantKind.MODEL, ParticipantKind.RESOURCES],
];
const DEFAULT_TIMEOUT_MS = 30_000;
/** Time a failed restore's cleanup gets at least. */
const CLEANUP_MS = 30_000;
/** Slack past the deadline before the call itself gives up: the participant enforces the deadline. */
const CALL_SLACK_MS = 5_000;

/** Failures of one step, by participant name. */
export class CoordinationError extends Error {
  /** @param {string} operation @param {Map<string, import("./errors.js").GymrpcError>} failures */
  constructor(operation, failures) {
    const summary = [...failures].map(([name, err]) => `${name}: ${err}`).join("; ");
    super(`${operation} failed on ${failures.size} participant(s): ${summary}`);
    this.name = "CoordinationError";
    this.operation = operation;
    this.failures = failures;
  }
}

/** A fresh checkpoint id: sortable by time, valid as a file name. */
export function newCheckpointId(prefix = "ckpt") {
  return `${prefix}-${Date.now()}-${Math.random().toString(16).slice(2, 10)}`;
}

/** `{rolloutId, attempt}` → a `gymrpc.v1.EpisodeId` message. */
export function episodeId(rolloutId, attempt = 0) {
  return create(EpisodeIdSchema, { rolloutId, attempt });
}

export class Controller {
  /**
   * @param {import("./client.js").GymClient} client
   * @param {{name: string, kind: ParticipantKind}[]} participants
   */
  constructor(client, participants) {
    this.client = client;
    this.participants = [...participants].sort(
      (a, b) => PREPARE_ORDER.indexOf(a.kind) - PREPARE_ORDER.indexOf(b.kind) || a.name.localeCompare(b.name),
    );
  }

  /**
   * Every registered server that serves ParticipantService (one that answers UNIMPLEMENTED is
   * not a participant and is left out; any other failure fails discovery).
   */
  static async discover(client, { prefix = "" } = {}) {
    const names = [...new Set((await client.endpoints(prefix)).map((e) => e.name))];
    const { replies, failures } = await fanOut(names, (name) =>
      client.participant(name).getStatus({}, { timeoutMs: 10_000 }),
    );
    for (const [name, err] of failures) if (err.code === Code.Unimplemented) failures.delete(name);
    if (failures.size) throw new CoordinationError("discover", failures);
    return new Controller(
      client,
      [...replies].map(([name, status]) => ({ name, kind: status.kind })),
    );
  }

  /** GetStatus of every participant, by name. */
  async status() {
    return this.#all("status", this.participants, (stub) => stub.getStatus({}, { timeoutMs: 10_000 }));
  }

  /**
   * Prepare stage by stage; stop at the first stage not prepared by the deadline (admission
   * stays closed there until a resume or the lease runs out).
   * @returns {Promise<PrepareResult>}
   */
  async prepare(checkpointId, { deadlineMs = defaultDeadline() } = {}) {
    const replies = new Map();
    for (const kind of PREPARE_ORDER) {
      const stage = this.participants.filter((p) => p.kind === kind);
      const stageReplies = await this.#all("prepare", stage, (stub) =>
        stub.prepare({ checkpointId, deadline: timestampFromMs(deadlineMs) }, callOptions(deadlineMs)),
      );
      for (const [name, reply] of stageReplies) replies.set(name, reply);
      if ([...stageReplies.values()].some((r) => r.phase !== ParticipantPhase.PREPARED)) {
        return new PrepareResult(false, replies);
      }
    }
    return new PrepareResult(true, replies);
  }

  /**
   * Commit every participant at once. `episodeIds` must name every episode the controller
   * continues (an empty list commits none); left out, every parked one.
   * @returns {Promise<Map<string, object>>} the manifest each participant wrote
   */
  async commit(checkpointId, { checkpointDir, episodeIds, deadlineMs = defaultDeadline(), stop = false }) {
    const request = {
      checkpointId,
      checkpointDir: path.resolve(checkpointDir),
      episodeIds: episodeIds ?? [],
      explicitScope: episodeIds !== undefined,
      stop,
      deadline: timestampFromMs(deadlineMs),
    };
    const replies = await this.#all("commit", this.participants, (stub) =>
      stub.commit(request, callOptions(deadlineMs)),
    );
    return new Map([...replies].map(([name, reply]) => [name, reply.manifest]));
  }

  /**
   * Resume in reverse prepare order; also aborts an unpublished checkpoint. Keeps going past
   * failures (a participant that cannot be reached resumes itself when its lease runs out),
   * then reports them.
   */
  async resume(checkpointId) {
    const failures = new Map();
    const replies = new Map();
    for (const kind of RESUME_ORDER) {
      const stage = this.participants.filter((p) => p.kind === kind).map((p) => p.name);
      const result = await fanOut(stage, (name) =>
        this.client.participant(name).resume({ checkpointId }, { timeoutMs: 10_000 }),
      );
      result.replies.forEach((reply, name) => replies.set(name, reply));
      result.failures.forEach((err, name) => failures.set(name, err));
    }
    if (failures.size) throw new CoordinationError("resume", failures);
    return replies;
  }

  /**
   * Install a committed checkpoint into fresh processes, all or nothing: if any participant
   * fails, the new attempts are retired everywhere and everyone is resumed before the error
   * is raised. On success the participants are RESTORED; `resume` reopens admission.
   * @param {{checkpointDir: string, episodeIds: object[], deadlineMs?: number}} args
   *   `episodeIds`: the checkpointed attempts to continue; each comes back as attempt + 1.
   */
  async restore(checkpointId, { checkpointDir, episodeIds, deadlineMs = defaultDeadline() }) {
    const request = {
      checkpointId,
      checkpointDir: path.resolve(checkpointDir),
      episodeIds,
      deadline: timestampFromMs(deadlineMs),
    };
    try {
      return await this.#all("restore", this.participants, (stub) => stub.restore(request, callOptions(deadlineMs)));
    } catch (err) {
      const next = episodeIds.map((e) => episodeId(e.rolloutId, e.attempt + 1));
      const cleanupMs = Math.max(deadlineMs, Date.now() + CLEANUP_MS);
      try {
        if (next.length) await this.retire(`${checkpointId}-undo`, next, { deadlineMs: cleanupMs });
      } finally {
        await this.resume(checkpointId);
      }
      throw err;
    }
  }

  /** Fence attempts (and every earlier one) in caller-before-callee order. Only while no checkpoint is open. */
  async retire(operationId, episodeIds, { deadlineMs = defaultDeadline() } = {}) {
    const retired = new Map();
    for (const kinds of RETIRE_ORDER) {
      const stage = this.participants.filter((p) => kinds.includes(p.kind));
      const replies = await this.#all("retire", stage, (stub) =>
        stub.retire(
          { checkpointId: operationId, episodeIds, deadline: timestampFromMs(deadlineMs) },
          callOptions(deadlineMs),
        ),
      );
      replies.forEach((reply, name) => retired.set(name, reply.retired));
    }
    return retired;
  }

  /** Remove retire marks once the rollouts are done for good. */
  async forget(operationId, rolloutIds) {
    const forgotten = new Map();
    for (const kinds of RETIRE_ORDER) {
      const stage = this.participants.filter((p) => kinds.includes(p.kind));
      const replies = await this.#all("forget", stage, (stub) =>
        stub.forget({ checkpointId: operationId, rolloutIds }, { timeoutMs: 10_000 }),
      );
      replies.forEach((reply, name) => forgotten.set(name, reply.forgotten));
    }
    return forgotten;
  }

  /** Extend every participant's lease past a new deadline (a slow publish). */
  async renew(checkpointId, { deadlineMs }) {
    return this.#all("renew", this.participants, (stub) =>
      stub.renew({ checkpointId, deadline: timestampFromMs(deadlineMs) }, callOptions(deadlineMs)),
    );
  }

  /**
   * The whole checkpoint: prepare, commit into `<root>/<checkpointId>`, then resume (unless
   * `stop`, for a stack about to stop). `episodeIds`: the episodes to continue; those some
   * participant can only restart are left out of the commit (`restarted`). Not prepared by
   * the deadline: aborted, returned with `committed` false and the blockers in `prepare`.
   * Any failure: aborted, and raised.
   */
  async checkpoint(
    root,
    { episodeIds, checkpointId = newCheckpointId(), timeoutMs = DEFAULT_TIMEOUT_MS, stop = false } = {},
  ) {
    const result = {
      checkpointId,
      checkpointDir: path.join(path.resolve(root), checkpointId),
      prepare: new PrepareResult(false, new Map()),
      manifests: new Map(),
      continued: [],
      restarted: [],
      get committed() {
        return this.manifests.size > 0;
      },
    };
    try {
      result.prepare = await this.prepare(checkpointId, { deadlineMs: Date.now() + timeoutMs });
      if (result.prepare.prepared) {
        if (episodeIds !== undefined) {
          const restarts = new Set(result.prepare.restarts().map(key));
          result.continued = episodeIds.filter((e) => !restarts.has(key(e)));
          result.restarted = episodeIds.filter((e) => restarts.has(key(e)));
        }
        result.manifests = await this.commit(checkpointId, {
          checkpointDir: result.checkpointDir,
          episodeIds: episodeIds === undefined ? undefined : result.continued,
          deadlineMs: Date.now() + timeoutMs,
          stop,
        });
      }
    } catch (err) {
      await this.resume(checkpointId).catch(() => {}); // unreachable ones abort when their lease runs out
      throw err;
    }
    if (!(stop && result.committed)) await this.resume(checkpointId);
    return result;
  }

  /** Run `call` on each participant at once; all replies by name, or a CoordinationError. */
  async #all(operation, participants, call) {
    const { replies, failures } = await fanOut(
      participants.map((p) => p.name),
      (name) => call(this.client.participant(name)),
    );
    if (failures.size) throw new CoordinationError(operation, failures);
    return replies;
  }
}

async function fanOut(names, call) {
  const settled = await Promise.allSettled(names.map((name) => call(name)));
  const replies = new Map();
  const failures = new Map();
  settled.forEach((result, i) => {
    if (result.status === "fulfilled") replies.set(names[i], result.value);
    else failures.set(names[i], toGymrpcError(result.reason));
  });
  return { replies, failures };
}

function defaultDeadline() {
  return Date.now() + DEFAULT_TIMEOUT_MS;
}

function callOptions(deadlineMs) {
  return { timeoutMs: Math.max(1, deadlineMs - Date.now()) + CALL_SLACK_MS };
}

/** `rollout/aN`: one string per attempt, for sets and messages. */
export function key(episode) {
  return `${episode.rolloutId}/a${episode.attempt}`;
}

/** Prepare replies of the stages reached, by participant name. */
export class PrepareResult {
  constructor(prepared, replies) {
    this.prepared = prepared;
    this.replies = replies;
  }

  /** Episodes still running, by participant (only participants that reported some). */
  blockers() {
    const blocked = [...this.replies].filter(([, reply]) => reply.report.blockers.length);
    return new Map(blocked.map(([name, reply]) => [name, reply.report.blockers]));
  }

  /** Episodes some participant can only restart: they cannot be continued from this checkpoint. */
  restarts() {
    const all = new Map();
    for (const reply of this.replies.values()) for (const e of reply.report.restarts) all.set(key(e), e);
    return [...all.values()];
  }
}
