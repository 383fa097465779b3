// A coordinated-checkpoint controller (docs/design.md §7) over `gymrpc.v1.ParticipantService`.
//
// Every server of a stack is a participant, and every replica of a name a participant of its
// own: the controller finds them through the registry (every endpoint it lists) and calls each
// at its own address. It prepares them stage by stage (environment, model, agent, resources:
// each stage parks what the next one waits on), commits all at once and then writes the
// checkpoint's index (`checkpoints.js`), resumes in reverse order, and restores an indexed
// checkpoint into fresh processes all or nothing, onto any number of replicas: each replica is
// told which replicas committed, which replicas there are now and which one it is, and installs
// the records placed on it. Participants do the fencing, idempotency, lease and placement work;
// the controller's duties are the orders, the deadlines, and cleaning up after a failed
// restore. Every call carries an absolute deadline, which also sets the participant's lease: a
// controller that vanishes leaves nothing closed for long.
import path from "node:path";
import { create } from "@bufbuild/protobuf";
import { timestampFromMs } from "@bufbuild/protobuf/wkt";
import { Code } from "@connectrpc/connect";
import { EpisodeIdSchema } from "../gen/gymrpc/v1/common_pb.js";
import { ParticipantKind, ParticipantPhase } from "../gen/gymrpc/v1/participant_service_pb.js";
import { compareIds, indexSources, readIndex, writeIndex } from "./checkpoints.js";
import { GymrpcError, toGymrpcError } from "./errors.js";

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

/** Failures of one step, by member label (`name`, or `name#endpointId` for a name with replicas). */
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

/** The key of a member in every reply map: `name`, or `name#endpointId` when the name has replicas. */
export function memberLabel(name, endpointId, replicas = 1) {
  return endpointId === undefined || replicas <= 1 ? name : `${name}#${endpointId}`;
}

export class Controller {
  /**
   * @param {import("./client.js").GymClient} client
   * @param {{name: string, kind: ParticipantKind, endpointId?: string, replicas?: number, packedScope?: boolean}[]} participants
   *   members; without `endpointId` a member is reached by name (its first endpoint); `packedScope`:
   *   it reads a Commit's packed scope (`GetStatusResponse.acceptsPackedScope`, as `discover` finds)
   * @param {{prefix?: string}} [options] set by `discover`: a restore discovers again with it
   */
  constructor(client, participants, { prefix } = {}) {
    this.client = client;
    this.prefix = prefix;
    this.participants = sortMembers(participants);
  }

  /**
   * Every registered endpoint that serves ParticipantService, each replica a member of its own
   * (one that answers UNIMPLEMENTED is not a participant and is left out; any other failure
   * fails discovery).
   */
  static async discover(client, { prefix = "" } = {}) {
    return new Controller(client, await discoverMembers(client, prefix), { prefix });
  }

  /** GetStatus of every participant, by label. */
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
      for (const [label, reply] of stageReplies) replies.set(label, reply);
      if ([...stageReplies.values()].some((r) => r.phase !== ParticipantPhase.PREPARED)) {
        return new PrepareResult(false, replies);
      }
    }
    return new PrepareResult(true, replies);
  }

  /**
   * Commit every participant at once. `episodeIds` must name every episode the controller
   * continues (an empty list commits none); left out, every parked one. Once every member
   * committed, the checkpoint's index (`checkpoint.json`) is written into the folder, last.
   * @returns {Promise<Map<string, object>>} the manifest each participant wrote
   */
  async commit(checkpointId, options) {
    const captured = await this.#capture(checkpointId, options);
    return (await this.#publish(captured, options.deadlineMs ?? defaultDeadline())).manifests;
  }

  /**
   * Commit every member at once. With `background`, each member replies once its state is captured
   * in memory (`persisting`) and writes afterwards, so a resume may follow at once.
   */
  async #capture(
    checkpointId,
    { checkpointDir, episodeIds, deadlineMs = defaultDeadline(), stop = false, background = false },
  ) {
    const request = {
      checkpointId,
      checkpointDir: path.resolve(checkpointDir),
      explicitScope: episodeIds !== undefined,
      stop,
      persistInBackground: background,
      deadline: timestampFromMs(deadlineMs),
    };
    // The packed scope (two flat lists, not a message per episode) goes to members whose GetStatus
    // says they read it; an older participant would take it for an empty scope.
    const episodes = episodeIds ?? [];
    const packed = {
      ...request,
      scopeRolloutIds: episodes.map((e) => e.rolloutId),
      scopeAttempts: episodes.map((e) => e.attempt ?? 0),
    };
    const messages = { ...request, episodeIds: episodes };
    const replies = await this.#all("commit", this.participants, (stub, p) =>
      stub.commit(p.packedScope ? packed : messages, callOptions(deadlineMs)),
    );
    return { checkpointId, checkpointDir: request.checkpointDir, replies };
  }

  /**
   * Wait for the write of every member that answered `persisting` (`Persist`), then write the
   * index: only a checkpoint every member persisted is published. A member restarted since its
   * capture answers CHECKPOINT_INCOMPLETE, and nothing is indexed.
   */
  async #publish({ checkpointId, checkpointDir, replies }, deadlineMs) {
    const waiting = this.participants.filter((p) => replies.get(p.label).persisting);
    const request = { checkpointId, deadline: timestampFromMs(deadlineMs) };
    const persisted = await this.#all("persist", waiting, (stub) => stub.persist(request, callOptions(deadlineMs)));
    const manifests = new Map(
      this.participants.map((p) => [p.label, (persisted.get(p.label) ?? replies.get(p.label)).manifest]),
    );
    const index = writeIndex(
      checkpointDir,
      checkpointId,
      this.participants.map((p) => manifests.get(p.label)),
    );
    return { manifests, index };
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
      const stage = this.participants.filter((p) => p.kind === kind);
      const result = await fanOut(stage, (p) => stub(this.client, p).resume({ checkpointId }, { timeoutMs: 10_000 }));
      result.replies.forEach((reply, label) => replies.set(label, reply));
      result.failures.forEach((err, label) => failures.set(label, err));
    }
    if (failures.size) throw new CoordinationError("resume", failures);
    return replies;
  }

  /**
   * Install an indexed checkpoint into fresh processes, all or nothing: if any participant
   * fails, the new attempts are retired everywhere and everyone is resumed before the error
   * is raised. On success the participants are RESTORED; `resume` reopens admission.
   *
   * The replicas that committed are those the checkpoint's index lists (each manifest checked
   * against it first); a folder without an index is refused, as incomplete, before anything is
   * installed. Each replica registered now (discovered again, for a controller from `discover`)
   * installs the records placed on it, so the replica counts may differ from the checkpoint's.
   * @param {{checkpointDir: string, episodeIds: object[], deadlineMs?: number,
   *   sources?: Map<string, string[]> | Record<string, string[]>}} args
   *   `episodeIds`: the checkpointed attempts to continue; each comes back as attempt + 1.
   *   `sources`: name → endpoint ids that committed; given, the index is not read (a folder
   *   committed by hand, or one this process cannot see): the caller vouches for them.
   */
  async restore(checkpointId, { checkpointDir, episodeIds, deadlineMs = defaultDeadline(), sources }) {
    const folder = path.resolve(checkpointDir);
    const from = sources === undefined ? indexSources(readIndex(folder)) : new Map(Object.entries(toObject(sources)));
    // Placement is over the replicas registered now, never over those of a stack seen earlier.
    if (this.prefix !== undefined) this.participants = sortMembers(await discoverMembers(this.client, this.prefix));
    const replicas = new Map();
    for (const p of this.participants) {
      if (p.endpointId !== undefined) replicas.set(p.name, [...(replicas.get(p.name) ?? []), p.endpointId]);
    }
    const request = (p) => {
      const out = { checkpointId, checkpointDir: folder, episodeIds, deadline: timestampFromMs(deadlineMs) };
      const committed = from.get(p.name);
      if (p.endpointId === undefined || !committed?.length) return out;
      return { ...out, sourceEndpointIds: committed, endpointIds: replicas.get(p.name), endpointId: p.endpointId };
    };
    try {
      return await this.#all("restore", this.participants, (stub, p) =>
        stub.restore(request(p), callOptions(deadlineMs)),
      );
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
      replies.forEach((reply, label) => retired.set(label, reply.retired));
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
      replies.forEach((reply, label) => forgotten.set(label, reply.forgotten));
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
   *
   * `nonstop` (default; not with `stop`): the commit only captures each member's state, the
   * episodes resume at once, and the index is written once every member persisted its records.
   * A publish that fails raises after the resume; the folder has no index and is never
   * restored. `nonstop: false`: the episodes stay parked until every member has written.
   */
  async checkpoint(
    root,
    { episodeIds, checkpointId = newCheckpointId(), timeoutMs = DEFAULT_TIMEOUT_MS, stop = false, nonstop = true } = {},
  ) {
    const result = {
      checkpointId,
      checkpointDir: path.join(path.resolve(root), checkpointId),
      prepare: new PrepareResult(false, new Map()),
      manifests: new Map(),
      /** The checkpoint's index, written once every member committed. */
      index: undefined,
      continued: [],
      restarted: [],
      /** Every member committed and the index is written: the checkpoint can be restored. */
      get committed() {
        return this.manifests.size > 0 && this.index !== undefined;
      },
    };
    const background = nonstop && !stop;
    let resumed = false;
    try {
      result.prepare = await this.prepare(checkpointId, { deadlineMs: Date.now() + timeoutMs });
      if (result.prepare.prepared) {
        if (episodeIds !== undefined) {
          const restarts = new Set(result.prepare.restarts().map(key));
          result.continued = episodeIds.filter((e) => !restarts.has(key(e)));
          result.restarted = episodeIds.filter((e) => restarts.has(key(e)));
        }
        const deadlineMs = Date.now() + timeoutMs;
        const captured = await this.#capture(checkpointId, {
          checkpointDir: result.checkpointDir,
          episodeIds: episodeIds === undefined ? undefined : result.continued,
          deadlineMs,
          stop,
          background,
        });
        if (background) {
          resumed = true; // the capture is all the episodes waited for
          await this.resume(checkpointId);
        }
        ({ manifests: result.manifests, index: result.index } = await this.#publish(captured, deadlineMs));
      }
    } catch (err) {
      if (!resumed) await this.resume(checkpointId).catch(() => {}); // unreachable ones abort when their lease runs out
      throw err;
    }
    if (!resumed && !(stop && result.committed)) await this.resume(checkpointId);
    return result;
  }

  async #all(operation, participants, call) {
    const { replies, failures } = await fanOut(participants, (p) => call(stub(this.client, p), p));
    if (failures.size) throw new CoordinationError(operation, failures);
    return replies;
  }
}

/**
 * An agent with durable resume (registry label `recovery=durable`) is no participant: a
 * checkpoint would silently leave its episodes out, so the stack is refused (docs/design.md §6).
 */
function refuseDurableAgents(listed) {
  const durable = [...new Set(listed.filter((e) => e.labels?.recovery === "durable").map((e) => e.name))].sort();
  if (!durable.length) return;
  const failures = new Map(
    durable.map((name) => [
      name,
      new GymrpcError(
        `${name} runs durable resume (--resume-dir): it is not a ParticipantService participant, so a ` +
          "coordinated checkpoint would leave its episodes out; run that agent without resume_dir to checkpoint it, " +
          "or recover it by durable resume alone (no controller)",
        { code: Code.FailedPrecondition, reason: "INVALID_REQUEST", metadata: { service: name, recovery: "durable" } },
      ),
    ]),
  );
  throw new CoordinationError("discover", failures);
}

/** Every registered endpoint under `prefix` that is a participant: `{name, kind, endpointId, replicas}`. */
async function discoverMembers(client, prefix) {
  const ids = new Map();
  const listed = await client.endpoints(prefix);
  refuseDurableAgents(listed);
  for (const e of listed) {
    ids.set(e.name, (ids.get(e.name) ?? new Set()).add(e.endpointId || "0"));
  }
  const targets = [...ids].flatMap(([name, found]) =>
    [...found].map((endpointId) => ({ name, endpointId, replicas: found.size })),
  );
  const { replies, failures } = await fanOut(targets, (t) =>
    client.participant(t.name, t.endpointId).getStatus({}, { timeoutMs: 10_000 }),
  );
  for (const [label, err] of failures) if (err.code === Code.Unimplemented) failures.delete(label);
  if (failures.size) throw new CoordinationError("discover", failures);
  return targets
    .filter((t) => replies.has(labelOf(t)))
    .map((t) => {
      const reply = replies.get(labelOf(t));
      return { ...t, kind: reply.kind, packedScope: reply.acceptsPackedScope };
    });
}

/** Prepare order, then name, then endpoint id; each member gets its `label`. */
function sortMembers(members) {
  return members
    .map((m) => ({ ...m, replicas: m.replicas ?? 1, label: labelOf(m) }))
    .sort(
      (a, b) =>
        PREPARE_ORDER.indexOf(a.kind) - PREPARE_ORDER.indexOf(b.kind) ||
        (a.name < b.name ? -1 : a.name > b.name ? 1 : 0) ||
        compareIds(a.endpointId ?? "0", b.endpointId ?? "0"),
    );
}

function labelOf(member) {
  return memberLabel(member.name, member.endpointId, member.replicas ?? 1);
}

/** The member's control stub: its own replica, or its name (first endpoint) without an endpoint id. */
function stub(client, member) {
  const { name, endpointId } = member;
  return endpointId === undefined ? client.participant(name) : client.participant(name, endpointId);
}

function toObject(sources) {
  return sources instanceof Map ? Object.fromEntries(sources) : sources;
}

async function fanOut(targets, call) {
  const settled = await Promise.allSettled(targets.map((t) => call(t)));
  const replies = new Map();
  const failures = new Map();
  settled.forEach((result, i) => {
    const label = labelOf(targets[i]);
    if (result.status === "fulfilled") replies.set(label, result.value);
    else failures.set(label, toGymrpcError(result.reason));
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

/** Prepare replies of the stages reached, by member label. */
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
