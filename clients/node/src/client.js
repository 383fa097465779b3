// `GymClient`: reach gymrpc services by stable name (`agent/counter`), survive their restarts.
// The Node twin of `gymrpc.Client`: a name is resolved through the registry and cached; a call
// that fails with UNAVAILABLE (server gone or draining) drops the cached address, resolves
// again and is retried with full-jitter backoff until the call's overall deadline, as is one
// that fails with ABORTED or RESOURCE_EXHAUSTED and a RetryInfo delay (an episode lease is held,
// the server is past its in-flight limit). Only methods the
// protocol marks idempotent or side-effect free are retried, which in gymrpc.v1 is all of them.
// A name with replicas: calls by name go to its first endpoint (no session affinity here: drive
// replicated resources and models through an agent), while a controller pins each control call
// to one replica by its endpoint id (`participant(name, endpointId)`).
import { Code, createClient } from "@connectrpc/connect";
import { create } from "@bufbuild/protobuf";
import { MethodOptions_IdempotencyLevel } from "@bufbuild/protobuf/wkt";
import { AgentService } from "../gen/gymrpc/v1/agent_service_pb.js";
import { EpisodeIdSchema } from "../gen/gymrpc/v1/common_pb.js";
import { ModelService } from "../gen/gymrpc/v1/model_service_pb.js";
import { ParticipantService } from "../gen/gymrpc/v1/participant_service_pb.js";
import { RegistryService } from "../gen/gymrpc/v1/registry_service_pb.js";
import { ResourcesService } from "../gen/gymrpc/v1/resources_service_pb.js";
import { GymrpcError, toGymrpcError } from "./errors.js";
import { readRunDir } from "./rundir.js";
import { connect } from "./transport.js";

/** Services whose every method is a control call (they need the stack token, not a role token). */
export const CONTROL_SERVICES = new Set([ParticipantService.typeName]);
export const DEFAULT_TIMEOUT_MS = 60_000;
/** Default overall deadline of `run`: episodes are long and may outlive several agent restarts. */
export const RUN_TIMEOUT_MS = 4 * 3600_000;
const NAME = /^[a-z0-9][a-z0-9_.-]{0,62}\/[a-z0-9][a-z0-9_.-]{0,62}$/;
export const ENDPOINT_ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;
const RETRYABLE_LEVELS = new Set([
  MethodOptions_IdempotencyLevel.NO_SIDE_EFFECTS,
  MethodOptions_IdempotencyLevel.IDEMPOTENT,
]);

export class GymClient {
  #addresses = new Map(); // name -> address of its first endpoint
  #replicas = new Map(); // name -> Map(endpoint id -> address)
  #known = new Set(); // names resolved once: a later NOT_FOUND from the registry means "restarting"
  #connections = new Map(); // address -> {transport, close, clients: Map}
  #registry;

  /**
   * @param {{runDir?: string, registry?: string, token?: string, tls?: object, timeoutMs?: number}} [options]
   *   `registry`, `token` and `tls` (`TlsFiles` of transport.js) default to the run folder's (see
   *   `readRunDir`); `timeoutMs` is the default overall deadline of a call, retries included.
   */
  constructor({ runDir, registry, token, tls, timeoutMs = DEFAULT_TIMEOUT_MS } = {}) {
    const found = readRunDir(runDir, { registry });
    this.registryAddress = found.registry;
    this.token = token ?? found.token;
    this.tls = tls ?? found.tls;
    this.timeoutMs = timeoutMs;
    this.#registry = connect(this.registryAddress, { tls: this.tls });
    /** The registry's own client (Resolve, ListEndpoints and Watch need no token). */
    this.registry = createClient(RegistryService, this.#registry.transport);
  }

  close() {
    for (const connection of this.#connections.values()) connection.close();
    this.#connections.clear();
    this.#registry.close();
  }

  agent(name) {
    return this.service(AgentService, name);
  }

  resources(name) {
    return this.service(ResourcesService, name);
  }

  model(name) {
    return this.service(ModelService, name);
  }

  /** Control calls to `name`; with `endpointId`, to that replica of it (a controller addresses each). */
  participant(name, endpointId) {
    return this.service(ParticipantService, name, { endpointId });
  }

  /**
   * Run one episode to the end and return its trajectory, following the agent across restarts.
   * @param {object} task a `gymrpc.v1.Task` (or its init object, see `taskFromRow`)
   * @param {{episodeId: string | {rolloutId: string, attempt?: number}, policyVersion: string,
   *   agent?: string, options?: object, timeoutMs?: number, signal?: AbortSignal}} args
   */
  async run(task, { episodeId, policyVersion, agent = "agent/simple", options, timeoutMs = RUN_TIMEOUT_MS, signal }) {
    const id = typeof episodeId === "string" ? { rolloutId: episodeId, attempt: 0 } : episodeId;
    const reply = await this.agent(agent).run(
      { task, episodeId: create(EpisodeIdSchema, id), policyVersion, options },
      { timeoutMs, signal },
    );
    return reply.trajectory;
  }

  /**
   * Current address of `name` (its first endpoint), or of its replica `endpointId`: cached, or
   * asked of the registry. A replica not registered right now (restarting) is UNAVAILABLE.
   */
  async resolve(name, { fresh = false, endpointId } = {}) {
    if (!NAME.test(name)) throw new Error(`service name ${JSON.stringify(name)} is invalid: expected role/instance`);
    const cached = endpointId === undefined ? this.#addresses.get(name) : this.#replicas.get(name)?.get(endpointId);
    if (!fresh && cached !== undefined) return cached;
    let reply;
    try {
      reply = await this.registry.resolve({ name }, { timeoutMs: 10_000 });
    } catch (caught) {
      const err = toGymrpcError(caught);
      if (err.code !== Code.NotFound || !this.#known.has(name)) throw err;
      // A name that was live is gone from the registry while its server restarts: retryable.
      throw new GymrpcError(`${name} is not registered right now (restarting?): ${err.message}`, {
        code: Code.Unavailable,
        reason: err.reason,
        metadata: err.metadata,
        cause: err,
      });
    }
    const address = reply.endpoints[0].address;
    this.#addresses.set(name, address);
    this.#replicas.set(name, new Map(reply.endpoints.map((e) => [e.endpointId || "0", e.address])));
    this.#known.add(name);
    if (endpointId === undefined) return address;
    const replica = this.#replicas.get(name).get(endpointId);
    if (replica === undefined) {
      throw new GymrpcError(`replica ${endpointId} of ${name} is not registered right now (restarting?)`, {
        code: Code.Unavailable,
        metadata: { name, endpoint_id: endpointId },
      });
    }
    return replica;
  }

  /** Every live endpoint, optionally under a name prefix. */
  async endpoints(prefix = "") {
    try {
      return (await this.registry.listEndpoints({ namePrefix: prefix })).endpoints;
    } catch (err) {
      throw toGymrpcError(err);
    }
  }

  /**
   * A client for `service` at the stable `name`: one async function per method, named as in
   * the generated service (`run`, `getStatus`, ...). Unary calls resolve, retry and throw
   * `GymrpcError`; server-streaming calls return an async iterable and are not retried
   * (a stream that broke needs an application-level resume).
   * Call options: Connect's (`timeoutMs` is the overall deadline, retries included; `signal`).
   */
  service(service, name, { endpointId } = {}) {
    if (!NAME.test(name)) throw new Error(`service name ${JSON.stringify(name)} is invalid: expected role/instance`);
    if (endpointId !== undefined && !ENDPOINT_ID.test(endpointId)) {
      throw new Error(`endpoint id ${JSON.stringify(endpointId)} is invalid: expected ${ENDPOINT_ID.source}`);
    }
    const target = { name, endpointId };
    const methods = {};
    for (const method of service.methods) {
      methods[method.localName] =
        method.methodKind === "unary"
          ? (request, options) => this.#unary(service, method, target, request, options)
          : (request, options) => this.#stream(service, method, target, request, options);
    }
    return methods;
  }

  async #unary(service, method, { name, endpointId }, request, options = {}) {
    const deadline = Date.now() + (options.timeoutMs ?? this.timeoutMs);
    const retryable = RETRYABLE_LEVELS.has(method.idempotency);
    for (let attempt = 0; ; attempt++) {
      let err;
      try {
        const client = this.#clientAt(service, await this.resolve(name, { fresh: attempt > 0, endpointId }));
        return await client[method.localName](request, { ...options, timeoutMs: Math.max(1, deadline - Date.now()) });
      } catch (caught) {
        err = toGymrpcError(caught);
      }
      const delay = retryable ? this.#retryDelay(err, name, attempt) : undefined;
      if (delay === undefined || Date.now() + delay >= deadline || options.signal?.aborted) throw err;
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }

  async *#stream(service, method, { name, endpointId }, request, options = {}) {
    const client = this.#clientAt(service, await this.resolve(name, { endpointId }));
    try {
      yield* client[method.localName](request, options);
    } catch (err) {
      throw toGymrpcError(err);
    }
  }

  /** Milliseconds to wait before retrying after `err`, or undefined when it is final. */
  #retryDelay(err, name, attempt) {
    if (err.code === Code.Unavailable) {
      this.#addresses.delete(name);
      this.#replicas.delete(name);
      return Math.random() * Math.min(1000, 50 * 2 ** attempt); // full jitter, capped at 1 s
    }
    // ABORTED: an episode lease is held; RESOURCE_EXHAUSTED (OVERLOADED): the server turned the call away unrun.
    const backOff = err.code === Code.Aborted || err.code === Code.ResourceExhausted;
    if (backOff && err.retryDelayMs !== undefined) return err.retryDelayMs * (1 + Math.random());
    return undefined;
  }

  #clientAt(service, address) {
    let connection = this.#connections.get(address);
    if (!connection) {
      connection = { ...connect(address, { interceptors: [this.#bearer()], tls: this.tls }), clients: new Map() };
      this.#connections.set(address, connection);
    }
    let client = connection.clients.get(service.typeName);
    if (!client) {
      client = createClient(service, connection.transport);
      connection.clients.set(service.typeName, client);
    }
    return client;
  }

  /** Adds `authorization: Bearer <token>` to every call: control and data-plane calls both need it. */
  #bearer() {
    return (next) => async (req) => {
      if (!this.token) {
        throw new GymrpcError(`${req.service.typeName}/${req.method.name} needs a credential and there is no token`, {
          code: Code.Unauthenticated,
        });
      }
      req.header.set("authorization", `Bearer ${this.token}`);
      return next(req);
    };
  }
}
