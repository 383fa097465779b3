// The index of a checkpoint folder, `<checkpointDir>/checkpoint.json` (a `gymrpc.v1.CheckpointIndex`
// in JSON), as `gymrpc.Controller` writes and reads it. A replica whose commit failed leaves no
// folder, which a restore cannot tell from a replica that never existed; so the controller writes
// the index once every member committed, last and create-only (an fsynced temporary file linked
// into place, then the folder fsynced), listing each member with the sha256 of its manifest. A
// restore reads exactly the replicas it lists, after checking every manifest against it, and
// refuses a folder without one (incomplete) unless the caller names the sources itself.
import { createHash, randomBytes } from "node:crypto";
import {
  closeSync,
  existsSync,
  fsyncSync,
  linkSync,
  openSync,
  readFileSync,
  readdirSync,
  statSync,
  unlinkSync,
  writeSync,
} from "node:fs";
import path from "node:path";
import { clone, create, equals, fromJson, toJson } from "@bufbuild/protobuf";
import { timestampFromMs } from "@bufbuild/protobuf/wkt";
import { Code } from "@connectrpc/connect";
import {
  CheckpointIndexSchema,
  CheckpointManifestSchema,
  ParticipantKind,
} from "../gen/gymrpc/v1/participant_service_pb.js";
import { ENDPOINT_ID } from "./client.js";
import { GymrpcError } from "./errors.js";

export const INDEX = "checkpoint.json";
export const INDEX_SCHEMA_VERSION = 1;
const MANIFEST = "manifest.json";
const NAME = /^[a-z0-9][a-z0-9_.-]{0,62}\/[a-z0-9][a-z0-9_.-]{0,62}$/;
const CHECKPOINT_ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;
const KIND_FOLDERS = Object.fromEntries(
  [ParticipantKind.ENVIRONMENT, ParticipantKind.MODEL, ParticipantKind.AGENT, ParticipantKind.RESOURCES].map((k) => [
    k,
    ParticipantKind[k].toLowerCase(),
  ]),
);

/** `<kind>/<instance>[#<endpointId>]/manifest.json`: where a replica's manifest is, relative to the checkpoint. */
export function manifestPath(kind, name, endpointId = "0") {
  const folder = KIND_FOLDERS[kind];
  if (folder === undefined || !NAME.test(name) || !ENDPOINT_ID.test(endpointId || "0")) {
    throw new Error(`no checkpoint folder for kind ${kind}, name ${JSON.stringify(name)}, replica ${endpointId}`);
  }
  const instance = name.split("/")[1];
  const id = endpointId || "0";
  return `${folder}/${id === "0" ? instance : `${instance}#${id}`}/${MANIFEST}`;
}

/** Endpoint ids in numeric order (`2` before `10`), others after them. */
export function compareIds(a, b) {
  const [x, y] = [/^\d+$/.test(a), /^\d+$/.test(b)];
  if (x && y) return Number(a) - Number(b);
  if (x !== y) return x ? -1 : 1;
  return a < b ? -1 : a > b ? 1 : 0;
}

/**
 * Index the manifests every member committed into `<checkpointDir>/checkpoint.json`, last and
 * create-only. Each manifest is read back from the folder (the controller must see it) and must
 * be the one its participant reported. An equal index already there (a retried commit) is kept.
 * @param {string} checkpointDir @param {string} checkpointId @param {object[]} manifests
 */
export function writeIndex(checkpointDir, checkpointId, manifests) {
  const folder = path.resolve(checkpointDir);
  const members = manifests.map((manifest) => {
    const relative = manifestPath(manifest.kind, manifest.name, manifest.endpointId);
    const file = path.join(folder, relative);
    let bytes;
    try {
      bytes = readFileSync(file);
    } catch (err) {
      if (err.code !== "ENOENT") throw err;
      throw new GymrpcError(
        `${file} does not exist here, though ${manifest.name} reported it committed: the controller must see ` +
          "the checkpoint folder its participants write (a shared filesystem) to index it",
        { code: Code.FailedPrecondition, metadata: { checkpoint_dir: folder, name: manifest.name } },
      );
    }
    const onDisk = parse(CheckpointManifestSchema, bytes, file, "manifest");
    const same = equals(CheckpointManifestSchema, timeless(onDisk), timeless(manifest));
    if (manifest.checkpointId !== checkpointId || !same) {
      throw dataLoss(`${file} is not the manifest ${manifest.name} reported for checkpoint ${checkpointId}`, folder);
    }
    return {
      name: manifest.name,
      kind: manifest.kind,
      endpointId: manifest.endpointId || "0",
      manifestPath: relative,
      manifestSha256: sha256(bytes),
    };
  });
  const index = create(CheckpointIndexSchema, {
    checkpointId,
    createTime: timestampFromMs(Date.now()),
    schemaVersion: INDEX_SCHEMA_VERSION,
    members,
  });
  const text = JSON.stringify(toJson(CheckpointIndexSchema, index, { useProtoFieldName: true }), null, 1) + "\n";
  if (createFile(path.join(folder, INDEX), text)) return index;
  const file = path.join(folder, INDEX);
  const existing = parse(CheckpointIndexSchema, readFileSync(file), file, "index");
  const same = clone(CheckpointIndexSchema, existing);
  same.createTime = index.createTime;
  if (!equals(CheckpointIndexSchema, same, index)) {
    throw new GymrpcError(
      `${file} already indexes another commit (checkpoint ${existing.checkpointId}); ` +
        `checkpoint ${checkpointId} was not indexed there`,
      { code: Code.Aborted, reason: "CHECKPOINT_CONFLICT", metadata: { checkpoint_id: checkpointId } },
    );
  }
  return existing;
}

/**
 * The index of a checkpoint folder, every manifest it lists checked against its sha256, and
 * every manifest in the folder listed. NOT_FOUND: no such folder; FAILED_PRECONDITION
 * `CHECKPOINT_INCOMPLETE`: no index (not restored as if whole); DATA_LOSS: damaged or changed.
 */
export function readIndex(checkpointDir) {
  const folder = path.resolve(checkpointDir);
  const file = path.join(folder, INDEX);
  if (!existsSync(folder) || !statSync(folder).isDirectory()) {
    throw new GymrpcError(`${folder} is not a checkpoint folder: it does not exist`, {
      code: Code.NotFound,
      metadata: { checkpoint_dir: folder },
    });
  }
  if (!existsSync(file)) {
    throw new GymrpcError(
      `${folder} has no ${INDEX}: the checkpoint is incomplete (some member's commit failed, or its controller ` +
        "stopped before indexing it) and is not restored. Restore an earlier checkpoint, or name the replicas " +
        "that committed yourself (restore's `sources`)",
      { code: Code.FailedPrecondition, reason: "CHECKPOINT_INCOMPLETE", metadata: { checkpoint_dir: folder } },
    );
  }
  const index = parse(CheckpointIndexSchema, readFileSync(file), file, "index");
  const problems = [];
  if (index.schemaVersion !== INDEX_SCHEMA_VERSION) {
    problems.push(`schema ${index.schemaVersion} is not one this controller reads (${INDEX_SCHEMA_VERSION})`);
  }
  if (!CHECKPOINT_ID.test(index.checkpointId)) problems.push(`checkpoint id ${JSON.stringify(index.checkpointId)}`);
  const seen = new Set();
  for (const member of index.members) {
    let expected;
    try {
      if (!member.endpointId) throw new Error(`${member.name} has no endpoint id`);
      expected = manifestPath(member.kind, member.name, member.endpointId);
    } catch (err) {
      problems.push(err.message);
      continue;
    }
    if (member.manifestPath !== expected || seen.has(expected)) {
      problems.push(`${member.name} replica ${member.endpointId} is listed at ${member.manifestPath}`);
      continue;
    }
    seen.add(expected);
    let bytes;
    try {
      bytes = readFileSync(path.join(folder, expected));
    } catch (err) {
      problems.push(`${expected} cannot be read (${err.code})`);
      continue;
    }
    if (sha256(bytes) !== member.manifestSha256) {
      problems.push(`${expected} is not the manifest that was committed (sha256 differs)`);
    }
  }
  const unlisted = manifestsIn(folder).filter((m) => !seen.has(m));
  if (unlisted.length) problems.push(`it does not list ${unlisted.slice(0, 5).join(", ")}`);
  if (problems.length) throw dataLoss(`${file}: ${problems.join("; ")}; nothing was restored`, folder);
  return index;
}

/** Name → endpoint ids of the replicas an index lists: `RestoreRequest.source_endpoint_ids`. */
export function indexSources(index) {
  const sources = new Map();
  for (const m of index.members) sources.set(m.name, [...(sources.get(m.name) ?? []), m.endpointId || "0"]);
  for (const ids of sources.values()) ids.sort(compareIds);
  return sources;
}

/** Create `file` holding `text`, durably, never replacing a file there: false if one exists. */
function createFile(file, text) {
  const temp = path.join(path.dirname(file), `.${path.basename(file)}-${randomBytes(6).toString("hex")}.tmp`);
  const fd = openSync(temp, "wx");
  try {
    writeSync(fd, text);
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
  try {
    linkSync(temp, file);
  } catch (err) {
    if (err.code === "EEXIST") return false;
    throw err;
  } finally {
    unlinkSync(temp);
  }
  const dir = openSync(path.dirname(file), "r");
  try {
    fsyncSync(dir);
  } finally {
    closeSync(dir);
  }
  return true;
}

function manifestsIn(folder) {
  const found = [];
  for (const kind of Object.values(KIND_FOLDERS)) {
    let entries;
    try {
      entries = readdirSync(path.join(folder, kind));
    } catch {
      continue;
    }
    for (const entry of entries) {
      if (existsSync(path.join(folder, kind, entry, MANIFEST))) found.push(`${kind}/${entry}/${MANIFEST}`);
    }
  }
  return found;
}

function parse(schema, bytes, file, what) {
  try {
    return fromJson(schema, JSON.parse(bytes.toString("utf8")), { ignoreUnknownFields: true });
  } catch (err) {
    throw dataLoss(`${file} is not a gymrpc checkpoint ${what}: ${err.message}`, path.dirname(file));
  }
}

function timeless(manifest) {
  const copy = clone(CheckpointManifestSchema, manifest);
  copy.createTime = undefined;
  return copy;
}

function sha256(bytes) {
  return createHash("sha256").update(bytes).digest("hex");
}

function dataLoss(message, folder) {
  return new GymrpcError(message, {
    code: Code.DataLoss,
    reason: "CORRUPT_SNAPSHOT",
    metadata: { checkpoint_dir: folder },
  });
}
